"""torch.distributed.checkpoint through hotstart.torch.StorageWriter / StorageReader: a plain
round trip, async_save, and 2 ranks (gloo, two processes) saving then 1 rank loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hotstart

from conftest import SeaweedFs, Sidecar, _free_ports, torch_or_fail

torch = torch_or_fail()
import torch.distributed.checkpoint as dcp  # noqa: E402

from hotstart.torch import StorageReader, StorageWriter  # noqa: E402

WORKER = str(Path(__file__).with_name("dcp_worker.py"))

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).t()},
        "optim": {"m": torch.randn(3, 3, generator=g, dtype=torch.float64)[:, 1]},  # a view
        "epoch": seed,
        "tags": ["a", "b"],
        "c": torch.randn(4, dtype=torch.complex64, generator=g),
    }


def zeros_like(s: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optim": {"m": torch.zeros(3, dtype=torch.float64)},
        "epoch": -1,
        "tags": [],
        "c": torch.zeros(4, dtype=torch.complex64),
    }


def check(got: dict, want: dict) -> None:
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["optim"]["m"], want["optim"]["m"])
    assert torch.equal(got["c"], want["c"])
    assert got["epoch"] == want["epoch"] and got["tags"] == want["tags"]


def test_round_trip_and_async_save(local_dir: Path) -> None:
    s1, s2 = state(1), state(2)
    dcp.save(s1, storage_writer=StorageWriter(local_dir=local_dir, job="dcp"), checkpoint_id=10)
    future = dcp.async_save(s2, storage_writer=StorageWriter(local_dir=local_dir, job="dcp"), checkpoint_id="step-20")
    future.result()
    for step, want in ((10, s1), (20, s2)):
        got = zeros_like(want)
        w_ptr = got["model"]["w"].data_ptr()
        dcp.load(got, storage_reader=StorageReader(local_dir=local_dir, job="dcp"), checkpoint_id=step)
        check(got, want)
        assert got["model"]["w"].data_ptr() == w_ptr  # loaded in place
    # The steps are ordinary engine steps: complete, verified, readable by other tools.
    with hotstart.Checkpointer(local_dir=local_dir, job="dcp") as ck:
        assert ck.steps() == [10, 20]
    manifest = json.loads((local_dir / "dcp" / "step-10" / "rank-0.manifest.json").read_text())
    assert "hotstart.dcp.metadata" in manifest["extras"]
    assert "model.w" in {t["name"] for t in manifest["tensors"]}


def test_a_save_whose_only_peer_is_down_warns_and_is_saved(tmp_path: Path) -> None:
    """A replica no peer can take (the one peer is down) is a warning, not a failed dcp.save:
    the step is in the node's memory and disk, and training goes on."""
    (down,) = _free_ports(1)  # nobody listens there
    sidecar = Sidecar(tmp_path, node="node-a", peers={"node-b": down})
    try:
        s = state(4)
        with pytest.warns(RuntimeWarning, match="no peer holds a replica") as caught:
            dcp.save(s, storage_writer=StorageWriter(sidecar=sidecar.socket, job="lonely"),
                     checkpoint_id=7)
        ours = [str(w.message) for w in caught if "no peer holds a replica" in str(w.message)]
        assert len(ours) == 1 and "node-b" in ours[0], ours
        got = zeros_like(s)
        dcp.load(got, storage_reader=StorageReader(sidecar=sidecar.socket, job="lonely"))
        check(got, s)
        with hotstart.Checkpointer(sidecar=sidecar.socket, job="lonely") as ck:
            assert ck.steps() == [7]
    finally:
        sidecar.stop()
    assert (tmp_path / "node-a" / "disk" / "lonely" / "step-7" / "rank-0.manifest.json").exists()


def test_round_trip_through_seaweedfs(seaweed: SeaweedFs) -> None:
    bucket = seaweed.fresh_bucket("dcp")
    s = state(3)
    dcp.save(s, storage_writer=StorageWriter(store=bucket, job="dcp"), checkpoint_id=1)
    got = zeros_like(s)
    dcp.load(got, storage_reader=StorageReader(store=bucket, job="dcp", step=1))
    check(got, s)


def test_errors(local_dir: Path) -> None:
    """Errors raised inside dcp arrive wrapped in its CheckpointException, which carries the
    hotstart error and message of each failing rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(hotstart.ConfigError, match="is not a step number"):
        dcp.save(state(1), storage_writer=StorageWriter(local_dir=local_dir, job="e"), checkpoint_id="latest")
    # A step that is no step is refused where it is given, naming it.
    for bad in (-1, True, 1 << 64):
        with pytest.raises(hotstart.ConfigError, match="step .*: expected an integer"):
            StorageWriter(local_dir=local_dir, job="e", step=bad)
        with pytest.raises(hotstart.ConfigError, match="step .*: expected an integer"):
            StorageReader(local_dir=local_dir, job="e", step=bad)
    with pytest.raises(hotstart.ConfigError, match="checkpoint_id 18446744073709551616: expected"):
        dcp.save(state(1), storage_writer=StorageWriter(local_dir=local_dir, job="e"), checkpoint_id=1 << 64)
    # Of a path, as trainers pass one, the last component is the step; the writer's job decides where.
    dcp.save(state(1), storage_writer=StorageWriter(local_dir=local_dir, job="p"), checkpoint_id="elsewhere/step-7")
    assert (local_dir / "p" / "step-7" / "rank-0.manifest.json").exists()

    def load_error(step: int, dst: dict) -> str:
        with pytest.raises(CheckpointException) as e:
            dcp.load(dst, storage_reader=StorageReader(local_dir=local_dir, job="e"), checkpoint_id=step)
        return str(e.value)

    assert "no complete checkpoint at step 5 for rank 0 of job" in load_error(5, zeros_like(state(1)))
    # A step written by a Checkpointer is not a DCP checkpoint.
    with hotstart.Checkpointer(local_dir=local_dir, job="e") as ck:
        ck.save(6, {"x": torch.ones(1)}).wait()
    msg = load_error(6, {"x": torch.zeros(1)})
    assert "step 6 of job 'e' was not written by hotstart.torch.StorageWriter" in msg
    # Corrupt bytes are caught by the engine's checksums.
    dcp.save(state(1), storage_writer=StorageWriter(local_dir=local_dir, job="e"), checkpoint_id=7)
    data = local_dir / "e" / "step-7" / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))
    assert "hotstart.errors.CorruptCheckpoint: step 7 rank 0: chunk 0 is corrupt" in load_error(7, zeros_like(state(1)))


def test_load_goes_back_past_a_damaged_checkpoint_and_raises_other_failures(local_dir: Path) -> None:
    """hotstart.torch.load: the newest checkpoint that can be read, or NoCheckpoint saying what
    failed; a failure that is not damaged data is raised as dcp.load raises it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from hotstart.torch import load

    with pytest.raises(hotstart.NoCheckpoint, match="no complete checkpoint of job 'g' to load: save one first"):
        load(zeros_like(state(0)), local_dir=local_dir, job="g")
    writer = lambda: StorageWriter(local_dir=local_dir, job="g")  # noqa: E731
    for step in (1, 2):
        dcp.save(state(step), storage_writer=writer(), checkpoint_id=step)
    data = local_dir / "g" / "step-2" / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))
    dst = zeros_like(state(0))
    assert load(dst, local_dir=local_dir, job="g") == 1
    check(dst, state(1))
    # A destination that does not fit is the caller's mistake, not a reason to go back.
    wrong = zeros_like(state(0))
    wrong["model"]["w"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointException, match="w"):
        load(wrong, local_dir=local_dir, job="g")
    # With step 1 damaged too, nothing is left.
    data = local_dir / "g" / "step-1" / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(hotstart.NoCheckpoint, match=r"checkpoint 1 of job 'g' cannot be read \(step 1 rank 0: chunk 0 "
                       r"is corrupt.*no complete checkpoint is older: start from a freshly built state"):
        load(zeros_like(state(0)), local_dir=local_dir, job="g")


def test_two_ranks_save_one_rank_loads(tmp_path: Path) -> None:
    (port,) = _free_ports(1)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, WORKER, "save", str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        finally:
            p.kill()
        outs.append(out)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        assert f"rank {rank} ok" in out
    # Both ranks wrote their part of each step.
    for step in (1, 2):
        names = sorted(f.name for f in (tmp_path / "dcp" / f"step-{step}").iterdir())
        assert names == ["rank-0.manifest.json", "rank-0.safetensors", "rank-1.manifest.json", "rank-1.safetensors"]
    r = subprocess.run([sys.executable, WORKER, "load", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1 ok" in r.stdout and "step 2 ok" in r.stdout and "newest ok" in r.stdout
