"""One rank of the torch.distributed.checkpoint tests (run by test_dcp.py as a subprocess).

    python dcp_worker.py save DIR     # RANK/WORLD_SIZE/MASTER_* set: gloo group, then
                                      #   dcp.save (step 1), dcp.async_save (step 2), and a
                                      #   load of step 1 back with the same world size; then
                                      #   step 3, rank 1's file damaged, and
                                      #   hotstart.torch.load going back to step 2
    python dcp_worker.py load DIR     # no process group: load steps 1 and 2 on one rank, then
                                      #   the newest step that can be read (2)

The state is a row-sharded DTensor, a replicated plain tensor, a per-rank Python value and
nested items; expected values are functions of the step, so any rank can check them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import hotstart
from hotstart.torch import StorageReader, StorageWriter, latest_step, load

ROWS, COLS = 12, 5


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step


def expected_plain(step: int) -> torch.Tensor:
    return torch.linspace(0, 1, 7, dtype=torch.float64) + step


def flip_a_byte(root: str, step: int, rank: int) -> None:
    """Damages a tensor byte of one rank's file of one step (its only copy)."""
    data = Path(root) / "dcp" / f"step-{step}" / f"rank-{rank}.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    writer = lambda: StorageWriter(local_dir=root, job="dcp")  # noqa: E731
    reader = lambda: StorageReader(local_dir=root, job="dcp")  # noqa: E731
    if mode == "save":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))

        def state(step: int) -> dict:
            return {
                "sharded": distribute_tensor(full(step), mesh, [Shard(0)]),
                "plain": expected_plain(step),
                "nested": {"bf16": torch.full((3,), step, dtype=torch.bfloat16), "step": step},
            }

        dcp.save(state(1), storage_writer=writer(), checkpoint_id=1)
        dcp.async_save(state(2), storage_writer=writer(), checkpoint_id=2).result()
        dist.barrier()
        # Same world size: into fresh DTensors, each rank reading its own shard.
        back = state(0)
        dcp.load(back, storage_reader=reader(), checkpoint_id=1)
        local = back["sharded"].to_local()
        rows = ROWS // dist.get_world_size()
        assert torch.equal(local, full(1)[rank * rows:(rank + 1) * rows]), local
        assert torch.equal(back["plain"], expected_plain(1))
        assert back["nested"]["step"] == 1
        # No checkpoint_id: rank 0 finds the newest step and every rank loads that one.
        newest = state(0)
        dcp.load(newest, storage_reader=reader())
        assert torch.equal(newest["sharded"].to_local(), full(2)[rank * rows:(rank + 1) * rows])
        assert newest["nested"]["step"] == 2
        # Step 3, with rank 1's only copy damaged: hotstart.torch.load goes back to step 2 on
        # every rank, where dcp.load would fail on step 3 at every restart.
        dcp.save(state(3), storage_writer=writer(), checkpoint_id=3)
        dist.barrier()
        if rank == 1:
            flip_a_byte(root, 3, rank)
        dist.barrier()
        back = state(0)
        assert load(back, local_dir=root, job="dcp") == 2
        assert torch.equal(back["sharded"].to_local(), full(2)[rank * rows:(rank + 1) * rows])
        assert torch.equal(back["plain"], expected_plain(2))
        assert back["nested"]["step"] == 2
        dist.barrier()
        dist.destroy_process_group()
        print(f"rank {rank} ok", flush=True)
        # Every save has completed and been checked. Leave without interpreter finalization:
        # with torch's gloo backend, a finished collective's work object can still be destroyed
        # on gloo's own thread while the interpreter tears down, and that thread's GIL take
        # aborts the process ("terminate called without an active exception"), about one
        # run in forty on a 2-core machine.
        os._exit(0)
    else:
        # Saved by 2 ranks, found by 1; step 3 is complete, but rank 1's part of it is damaged.
        assert latest_step(local_dir=root, job="dcp") == 3
        ck = hotstart.Checkpointer(local_dir=root, job="dcp", rank=0, world_size=1)
        assert (ck.latest_step(), ck.saved_world_size(2)) == (3, 2)
        for step in (1, 2, None):
            dst = {
                "sharded": torch.zeros(ROWS, COLS),
                "plain": torch.zeros(7, dtype=torch.float64),
                "nested": {"bf16": torch.zeros(3, dtype=torch.bfloat16), "step": 0},
            }
            if step is None:
                # The newest complete step that can be read, whatever world size saved it.
                try:
                    dcp.load(dst, storage_reader=reader())
                    raise AssertionError("step 3 loaded with a damaged chunk")
                except CheckpointException as e:
                    assert "CorruptCheckpoint" in str(e), e
                step = load(dst, local_dir=root, job="dcp")
                assert step == 2, step
                print("newest ok")
            else:
                dcp.load(dst, storage_reader=reader(), checkpoint_id=step)
            assert torch.equal(dst["sharded"], full(step)), dst["sharded"]
            assert torch.equal(dst["plain"], expected_plain(step))
            assert torch.equal(dst["nested"]["bf16"], torch.full((3,), step, dtype=torch.bfloat16))
            assert dst["nested"]["step"] == step
            print(f"step {step} ok")


if __name__ == "__main__":
    main()
