"""The store tier against a real SeaweedFS, and the fallback from a corrupt disk tier."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

import hotstart

from conftest import SeaweedFs


def state(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((256, 256)).astype(np.float32), "b": rng.integers(0, 9, 100), "step": seed}


def test_round_trip_through_seaweedfs(bucket: str) -> None:
    s = state(1)
    with hotstart.Checkpointer(store=f"{bucket}/runs", job="s3-job") as ck:
        h = ck.save(5, s)
        h.wait_persisted("store")
        assert h.status() == {"step": 5, "staged": "done", "memory": "off", "peer": "off",
                              "disk": "off", "store": "done"}
    # A new process's view: a fresh engine over the same bucket.
    with hotstart.Checkpointer(store=f"{bucket}/runs", job="s3-job") as ck:
        assert ck.latest_step() == 5
        dst = {"w": np.zeros((256, 256), np.float32), "b": np.zeros(100, np.int64), "step": None}
        ck.load(dst)
    assert np.array_equal(dst["w"], s["w"]) and np.array_equal(dst["b"], s["b"]) and dst["step"] == 1


def test_corrupt_disk_copy_falls_back_to_the_store(bucket: str, local_dir: Path) -> None:
    s = state(2)
    with hotstart.Checkpointer(store=bucket, local_dir=local_dir, job="both") as ck:
        ck.save(1, s).wait()
    data = local_dir / "both" / "step-1" / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with hotstart.Checkpointer(store=bucket, local_dir=local_dir, job="both") as ck:
        dst = {"w": np.zeros((256, 256), np.float32), "b": np.zeros(100, np.int64), "step": 0}
        ck.load(dst)
        # The engine names where each chunk came from: the one chunk, from the store.
        assert ck.engine.load(1, []) == ["store"]
    assert np.array_equal(dst["w"], s["w"])
    # With the store gone too, the corruption is reported, not loaded.
    with hotstart.Checkpointer(local_dir=local_dir, job="both") as ck:
        with pytest.raises(hotstart.CorruptCheckpoint, match="step 1 rank 0: chunk 0 is corrupt"):
            ck.load()


def test_save_is_skipped_when_the_pool_is_full(seaweed: SeaweedFs) -> None:
    bucket = seaweed.fresh_bucket("skip")
    ck = hotstart.Checkpointer(store=bucket, job="skip", max_inflight=1, when_full="skip")
    os.kill(seaweed.proc.pid, signal.SIGSTOP)  # the store tier of the first save hangs
    try:
        first = ck.save(1, state(1))
        first.wait_staged()
        second = ck.save(2, state(2))
        with pytest.raises(hotstart.SaveSkipped, match="step 2 was skipped: 1 checkpoints already in flight"):
            second.wait_staged()
        assert second.done() and ck.engine.skipped == 1
        assert isinstance(second.exception(), hotstart.SaveSkipped)
    finally:
        os.kill(seaweed.proc.pid, signal.SIGCONT)
    first.wait()
    assert ck.latest_step() == 1
    # The skip is the mode asked for: its handle and the count report it, and closing (as a
    # `with` block's exit does, after later saves all succeeded) raises nothing.
    third = ck.save(3, state(3))
    third.wait()
    skipped = ck.engine.skipped
    ck.close()
    assert skipped == 1 and isinstance(second.exception(), hotstart.SaveSkipped)
