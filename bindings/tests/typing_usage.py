"""Typed use of the public API, checked by `mypy --strict` in test_stubs.py (never run)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import hotstart
from hotstart.torch import StorageReader, StorageWriter, latest_step


def train(steps: int) -> Optional[int]:
    state: Dict[str, Any] = {"w": np.zeros(4), "t": torch.zeros(2), "step": 0}
    with hotstart.Checkpointer(store="s3://bucket/runs", job="run", keep=2, local_dir="/tmp/x") as ck:
        latest: Optional[int] = ck.latest_step()
        if latest is not None:
            state = ck.load(state, strict=False)
        for step in range(steps):
            h: hotstart.SaveHandle = ck.save(step, state)
            h.wait_staged()
            h.wait_persisted("disk")
            done: bool = h.done()
            err: Optional[BaseException] = h.exception()
            status: Dict[str, object] = h.status()
            del done, err, status
        ck.wait()
        steps_done: List[int] = ck.steps()
        rank: int = ck.rank + ck.world_size
        saved_by: int = ck.saved_world_size(0)
        newest_dcp: Optional[int] = latest_step(store="s3://bucket/runs", job="dcp", local_dir="/tmp/x")
        del steps_done, rank, saved_by, newest_dcp
        return ck.latest_step()


def errors() -> str:
    try:
        hotstart.Checkpointer(job="j").load()
    except hotstart.NoCheckpoint as e:
        return str(e)
    except (hotstart.CorruptCheckpoint, hotstart.StoreError, hotstart.StateDictError) as e:
        return str(e)
    except hotstart.HotstartError as e:
        return str(e)
    return hotstart.__version__ + str(hotstart.CUDA_BUILT)


def distributed(sd: Dict[str, Any]) -> None:
    dcp_save(sd, storage_writer=StorageWriter(store="s3://b", job="dcp", keep=0), checkpoint_id=3)
    dcp_load(sd, storage_reader=StorageReader(store="s3://b", job="dcp", step=3))


def environment() -> Optional[int]:
    try:
        r: hotstart.env.EnsureResult = hotstart.env.ensure(
            "s3://b/envs", ["requirements.txt"], "/opt/venv", ["sh", "-c", "pip install -r requirements.txt"],
            relocatable=True,
        )
        action: str = r.action
        published: Optional[bool] = r.published
        del action, published
        return r.files
    except hotstart.InstallFailed as e:
        return e.returncode
    except (hotstart.TargetInUse, hotstart.CorruptSnapshot):
        return None
