"""Errors: each engine failure arrives as its hotstart.HotstartError subclass with the engine's
message; a failing store never breaks the training loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hotstart
from hotstart import errors


def test_hierarchy() -> None:
    for cls in (errors.ConfigError, errors.StateDictError, errors.CorruptCheckpoint, errors.NoCheckpoint,
                errors.StoreError, errors.SaveSkipped, errors.CudaError):
        assert issubclass(cls, hotstart.HotstartError)
    assert issubclass(errors.StateDictError, ValueError) and issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.NoCheckpoint, LookupError) and issubclass(errors.StoreError, OSError)
    assert set(errors.__all__) <= set(hotstart.__all__)
    assert all(getattr(hotstart, name) is getattr(errors, name) for name in errors.__all__)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(job="j"), "nowhere to save"),
        (dict(local_dir="/tmp/x"), "no job name"),
        (dict(local_dir="/tmp/x", job="../escape"), "job name \"../escape\": empty, '.' or '..' path component"),
        (dict(local_dir="/tmp/x", job="j", rank=2, world_size=2), "rank 2 of world size 2"),
        (dict(store="s3://", job="j"), "store \"s3://\""),
        (dict(local_dir="/tmp/x", job="j", when_full="drop"), "when_full='drop'"),
        (dict(local_dir="/tmp/x", job="j", keep=-1), "keep -1: expected an integer from 0"),
        (dict(local_dir="/tmp/x", job="j", rank=-1, world_size=2), "rank -1: expected an integer from 0"),
        (dict(local_dir="/tmp/x", job="j", rank=0, world_size=0), "world_size 0: expected an integer from 1"),
        (dict(local_dir="/tmp/x", job="j", max_inflight=0), "max_inflight 0: expected an integer from 1"),
        (dict(local_dir="/tmp/x", job="j", threads="4"), "threads '4': expected an integer"),
        (dict(local_dir="/tmp/x", job="j", when_full="Skip"), "when_full='Skip': expected \"block\" or \"skip\""),
        (dict(local_dir="/tmp/x", job="j", when_full=None), "when_full=None"),
        (dict(local_dir="/tmp/x", job="j", chunk_size=1 << 40), "chunk_size 1099511627776: expected an integer from 1 to 2**31-1"),
    ],
)
def test_bad_configuration(kwargs, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HOTSTART_STORE", "HOTSTART_LOCAL_DIR", "HOTSTART_JOB", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(hotstart.ConfigError) as e:  # a HotstartError, and a ValueError
        hotstart.Checkpointer(**kwargs)
    assert message in str(e.value)


def test_defaults_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSTART_LOCAL_DIR", str(tmp_path))
    monkeypatch.setenv("HOTSTART_JOB", "env-job")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ck = hotstart.Checkpointer()
    assert (ck.job, ck.rank, ck.world_size) == ("env-job", 1, 3)
    assert ck.engine.tiers == ["disk"]
    ck.close()


def test_no_checkpoint(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="empty") as ck:
        with pytest.raises(hotstart.NoCheckpoint, match='no complete checkpoint for rank 0 of job "empty"'):
            ck.load()
        with pytest.raises(hotstart.NoCheckpoint, match="no complete checkpoint at step 4 for rank 0"):
            ck.load(step=4)


def test_incomplete_step_of_another_rank_is_not_loaded(local_dir: Path) -> None:
    # Rank 0 of 2 commits; rank 1 never does: the step is not complete.
    with hotstart.Checkpointer(local_dir=local_dir, job="half", rank=0, world_size=2) as ck:
        ck.save(1, {"x": np.ones(2)}).wait()
        assert ck.latest_step() is None
        with pytest.raises(hotstart.NoCheckpoint):
            ck.load()
    with hotstart.Checkpointer(local_dir=local_dir, job="half", rank=1, world_size=2) as ck:
        ck.save(1, {"x": np.zeros(2)}).wait()
        assert ck.latest_step() == 1
        assert ck.load()["x"].tolist() == [0.0, 0.0]


def test_corrupt_bytes_and_manifests(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="bad", keep=0) as ck:
        ck.save(1, {"x": np.arange(1000.0)}).wait()
        ck.save(2, {"x": np.arange(1000.0)}).wait()
    step1 = local_dir / "bad" / "step-1"
    data = step1 / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    manifest = local_dir / "bad" / "step-2" / "rank-0.manifest.json"
    m = json.loads(manifest.read_text())
    m["file_len"] = 1 << 62  # hostile: claims an absurd size
    manifest.write_text(json.dumps(m))
    with hotstart.Checkpointer(local_dir=local_dir, job="bad") as ck:
        with pytest.raises(hotstart.CorruptCheckpoint) as e:
            ck.load(step=1)
        assert "step 1 rank 0: chunk 0 is corrupt or missing in every tier" in str(e.value)
        assert "checksum mismatch" in str(e.value)
        # The step with the hostile manifest is not complete, so the newest good one is 1 (corrupt)
        assert ck.latest_step() == 1
        with pytest.raises(hotstart.NoCheckpoint):
            ck.load(step=2)


def test_store_failure_is_reported_on_the_handle(local_dir: Path, unreachable_s3: None) -> None:
    ck = hotstart.Checkpointer(store="s3://nowhere", local_dir=local_dir, job="down")
    h = ck.save(1, {"x": np.ones(4)})
    h.wait_staged()  # training goes on
    h.wait_persisted("disk")  # the disk tier is unaffected
    with pytest.raises(hotstart.StoreError) as e:
        h.wait_persisted("store")
    assert "step 1 rank 0 was not persisted to the store tier" in str(e.value)
    exc = h.exception()
    assert isinstance(exc, hotstart.StoreError) and str(exc) == str(e.value)
    assert h.status()["store"].startswith("failed: ")
    with pytest.raises(hotstart.StoreError):
        ck.wait()
    ck.close()
    # The disk copy is complete and loads.
    with hotstart.Checkpointer(local_dir=local_dir, job="down") as ck:
        assert ck.load()["x"].tolist() == [1.0] * 4


def test_closed_checkpointer(local_dir: Path) -> None:
    ck = hotstart.Checkpointer(local_dir=local_dir, job="closed")
    ck.close()
    ck.close()
    with pytest.raises(hotstart.HotstartError, match="closed"):
        ck.save(1, {})
