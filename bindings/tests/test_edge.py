"""The promise at the user's edge, through the public API as the README writes a loop: a tier
that cannot be read is an error, never "no checkpoint"; a step is written by one save at a
time and by one process; a sidecar that restarts under a job does not end it; loaded tensors
never keep a deleted file, and small ones own their memory."""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import hotstart
from conftest import Sidecar, _die_with_parent, torch_or_fail


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 256), dtype=np.float32), "step": seed}


# --- a tier that cannot be read -----------------------------------------------------------


def test_an_unreachable_store_is_an_error_not_no_checkpoint(unreachable_s3: None) -> None:
    ck = hotstart.Checkpointer(store="s3://nowhere/runs", job="outage")
    # (Each call waits out the store client's retries, about 20 s, before it raises.)
    for call in (ck.latest_step, ck.load):
        with pytest.raises(hotstart.TierUnavailable) as e:
            call()
        assert "store tier cannot be read" in str(e.value), e.value
        # The cause at the bottom of the client's chain, not only "error sending request".
        assert "Connection refused" in str(e.value), e.value
        assert isinstance(e.value, hotstart.StoreError)


def test_a_plain_http_endpoint_without_allow_http_is_refused_at_construction(
        unreachable_s3: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    with pytest.raises(hotstart.ConfigError, match="AWS_ALLOW_HTTP=true"):
        hotstart.Checkpointer(store="s3://nowhere/runs", job="http")


def test_a_local_dir_under_a_file_fails_at_construction(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(hotstart.ConfigError, match="local_dir"):
        hotstart.Checkpointer(local_dir=f / "ckpt", job="j")
    with pytest.raises(hotstart.ConfigError, match="store"):
        hotstart.Checkpointer(store=str(f / "store"), job="j")


def test_a_nearer_tier_answers_while_the_store_is_down(tmp_path: Path, unreachable_s3: None) -> None:
    disk = tmp_path / "disk"
    with hotstart.Checkpointer(local_dir=disk, job="near") as ck:
        ck.save(5, state(5)).wait()
    ck = hotstart.Checkpointer(local_dir=disk, store="s3://nowhere/runs", job="near")
    # Every save reaches the disk before the store: the store cannot hold a newer step.
    assert ck.latest_step() == 5
    # A list of every step cannot leave the store out.
    with pytest.raises(hotstart.TierUnavailable):
        ck.steps()


# --- a step is written once ---------------------------------------------------------------


def test_a_step_saved_twice_at_once_is_refused_and_saved_again_replaces(tmp_path: Path) -> None:
    ck = hotstart.Checkpointer(local_dir=tmp_path / "d", store=str(tmp_path / "s"), job="twice")
    # 8 MiB per save, fsynced to two tiers: the first save is almost always still running when
    # the second call comes. When it is not, the second save is accepted and must replace it.
    def big(seed: int) -> dict:
        return {"w": np.random.default_rng(seed).standard_normal((2048, 1024), dtype=np.float32),
                "step": seed}

    a, b = big(1), big(2)
    refused = 0
    for _ in range(10):
        h1 = ck.save(6, a)
        try:
            h2 = ck.save(6, b)
        except hotstart.StepInFlight as e:
            assert "step 6 is already being saved" in str(e), e
            refused += 1
            h1.wait()
            got = ck.load(step=6)
            assert np.array_equal(got["w"], a["w"]) and got["step"] == a["step"]
            ck.save(6, b).wait()
        else:
            # Accepted only because the first save was over.
            assert h1.done(), "a second save of step 6 was accepted while the first one ran"
            h2.wait()
        got = ck.load(step=6)
        assert np.array_equal(got["w"], b["w"]) and got["step"] == b["step"]
        a, b = b, a
    assert refused > 0, "no second save of a step in flight was refused"
    ck.close()


HOLDER = """
import sys, numpy as np, hotstart
ck = hotstart.Checkpointer(local_dir=sys.argv[1], job="owned")
ck.save(1, {"w": np.ones(4)}).wait()
print("saved", flush=True)
sys.stdin.read()
"""


def test_a_second_writer_of_the_same_rank_is_refused_with_the_first_ones_name(tmp_path: Path) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    first = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "saved"
        second = hotstart.Checkpointer(local_dir=tmp_path, job="owned")
        with pytest.raises(hotstart.SecondWriter, match=f"pid {first.pid} "):
            second.save(2, state(2))
        # Readers are welcome; another rank is another writer; this process's other engines
        # share its lock.
        assert second.latest_step() == 1
        other = hotstart.Checkpointer(local_dir=tmp_path, job="owned", rank=1, world_size=2)
        other.save(1, state(1)).wait()
        other.close()
    finally:
        first.kill()
        first.wait()
    # The holder is gone (killed): its lock went with it.
    second.save(2, state(2)).wait()
    again = hotstart.Checkpointer(local_dir=tmp_path, job="owned")
    again.save(3, state(3)).wait()
    again.close()
    second.close()


def test_engines_of_one_process_are_one_writer_and_keep_each_others_steps(tmp_path: Path) -> None:
    # Two engines of one process for one rank (as a new DCP StorageWriter per save makes them):
    # the first's retention, after its slow save of step 2, must not take the step 3 that the
    # second saved meanwhile for a step abandoned by a job that went back.
    a = hotstart.Checkpointer(local_dir=tmp_path, job="one")
    b = hotstart.Checkpointer(local_dir=tmp_path, job="one")
    slow = a.save(2, {"w": np.random.default_rng(2).standard_normal((64, 1 << 20), dtype=np.float32)})
    b.save(3, state(3)).wait()
    slow.wait()
    assert a.steps() == [2, 3]
    assert np.array_equal(b.load(step=3)["w"], state(3)["w"])
    a.close()
    b.close()


# --- the sidecar ------------------------------------------------------------------------------


def test_a_sidecar_restart_under_the_loop_is_not_an_error(tmp_path: Path) -> None:
    side = Sidecar(tmp_path)
    try:
        ck = hotstart.Checkpointer(sidecar=side.socket, job="restarts")
        h = None
        for step in range(1, 9):
            if step in (3, 6):
                # Stopped and started again between two saves: the segment prepared ahead
                # belongs to the old sidecar.
                side.stop()
                side = Sidecar(tmp_path)
            if h is not None:
                h.wait_staged()
            h = ck.save(step, state(step))
        h.wait_staged()
        h.wait()
        assert ck.latest_step() == 8
        # The sidecar's answer covers every tier it reads, as latest_step() does.
        steps = ck.steps()
        assert steps[-1] == 8 and steps == sorted(steps) and len(steps) >= 2, steps
        assert np.array_equal(ck.load()["w"], state(8)["w"])
        ck.close()
    finally:
        side.stop()


def big_state(seed: int) -> dict:
    # 64 MiB: the sidecar hashes it as it commits, long after wait_staged() has returned.
    return {"w": np.random.default_rng(seed).standard_normal((16, 1 << 20), dtype=np.float32)}


@pytest.mark.parametrize("lost", ["stopped", "killed"])
def test_a_sidecar_lost_right_after_wait_staged_costs_no_staged_step(tmp_path: Path,
                                                                     lost: str) -> None:
    side = Sidecar(tmp_path)
    try:
        ck = hotstart.Checkpointer(sidecar=side.socket, job=lost)
        want = big_state(1)
        h = ck.save(1, want)
        h.wait_staged()
        # The training process may now change its tensors; the sidecar has not acknowledged
        # the commit yet (it is still hashing).
        if lost == "stopped":
            # SIGTERM: the drain waits for a save whose bytes are all in its memory, commits
            # it and persists it before it exits.
            side.stop()
            log = side.log.read_text()
            assert "drained: everything committed is persisted" in log, log
            assert "NOT PERSISTED" not in log and "NOT COMMITTED" not in log, log
        else:
            # SIGKILL: the process hands the step to the next life from the segment it still
            # holds, read-only.
            side.kill()
        side = Sidecar(tmp_path)
        h.wait()
        assert ck.latest_step() == 1
        assert np.array_equal(ck.load()["w"], want["w"])
        ck.save(2, state(2)).wait()
        assert ck.latest_step() == 2
        ck.close()
    finally:
        side.stop()


def test_a_sidecar_that_is_gone_leaves_every_read_to_the_own_tiers(tmp_path: Path) -> None:
    side = Sidecar(tmp_path)
    try:
        # The sidecar's disk as this process's own tier: read only while the sidecar is gone.
        ck = hotstart.Checkpointer(sidecar=side.socket, local_dir=tmp_path / "disk", job="gone")
        for step in (1, 2):
            ck.save(step, state(step)).wait()
    finally:
        side.stop()
    # As the README's loop asks, in its order: which step, then the step.
    assert ck.latest_step() == 2
    assert ck.steps() == [1, 2]
    assert ck.latest_step(below=2) == 1
    assert ck.saved_world_size(2) == 1
    assert np.array_equal(ck.load()["w"], state(2)["w"])
    assert ck.loaded_from and set(ck.loaded_from) == {"disk"}, ck.loaded_from


def test_a_sidecar_that_does_not_come_back_fails_the_save_with_sidecar_error(tmp_path: Path) -> None:
    side = Sidecar(tmp_path)
    try:
        ck = hotstart.Checkpointer(sidecar=side.socket, job="never", sidecar_wait=1)
        ck.save(1, state(1)).wait()
    finally:
        side.stop()
    h = ck.save(2, state(2))
    # The kind a loop catches, after the wait: not a bare HotstartError.
    with pytest.raises(hotstart.SidecarError, match="step 2 was not staged: .*hotstart serve"):
        h.wait_staged()
    with pytest.raises(hotstart.SidecarError):
        ck.close()


def test_a_step_of_another_world_size_through_the_sidecar_says_how_to_load_it(sidecar: Sidecar) -> None:
    for rank in (0, 1):
        with hotstart.Checkpointer(sidecar=sidecar.socket, job="resized", rank=rank, world_size=2) as ck:
            ck.save(1, state(rank)).wait()
    ck = hotstart.Checkpointer(sidecar=sidecar.socket, job="resized", rank=0, world_size=1)
    assert ck.latest_step() == 1 and ck.saved_world_size(1) == 2
    # Not "the sidecar failed", not "no checkpoint": what it is, and the way to load it.
    for call in (lambda: ck.load(step=1), ck.load):
        with pytest.raises(hotstart.ConfigError, match="saved by 2 ranks.*torch.distributed.checkpoint"):
            call()
    ck.close()


def test_a_missing_sidecar_says_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(hotstart.SidecarError, match="hotstart serve"):
        hotstart.Checkpointer(sidecar=tmp_path / "none.sock", job="j", sidecar_wait=0)
    with pytest.raises(hotstart.ConfigError, match="sidecar_wait=-1"):
        hotstart.Checkpointer(sidecar=tmp_path / "none.sock", job="j", sidecar_wait=-1)


def test_a_checkpointer_made_before_its_sidecar_listens_waits_for_it(tmp_path: Path) -> None:
    # As in a pod whose trainer and sidecar start together, or a job restarted while its
    # node's sidecar restarts.
    made: dict = {}

    def make() -> None:
        try:
            made["ck"] = hotstart.Checkpointer(sidecar=tmp_path / "sidecar.sock", job="early")
        except BaseException as e:  # noqa: BLE001 (reported below)
            made["error"] = e

    t = threading.Thread(target=make)
    t.start()
    side = Sidecar(tmp_path)
    try:
        t.join(90)
        assert "error" not in made, made["error"]
        ck = made["ck"]
        ck.save(1, state(1)).wait()
        assert ck.latest_step() == 1
        assert np.array_equal(ck.load()["w"], state(1)["w"])
        ck.close()
    finally:
        side.stop()


def test_keep_with_a_sidecar_warns(sidecar: Sidecar) -> None:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hotstart.Checkpointer(sidecar=sidecar.socket, job="k", keep=5).close()
    assert any("hotstart serve --keep" in str(x.message) for x in w)


# --- loads ------------------------------------------------------------------------------------


PLAIN_LOG = """
import sys, numpy as np, hotstart
ck = hotstart.Checkpointer(local_dir=sys.argv[1], job="log")
for _ in range(2):
    ck.save(1, {"w": np.ones(4)}).wait()  # the second logs a warning: the step is replaced
ck.close()
"""


def test_logs_written_to_a_file_carry_no_colour_codes(tmp_path: Path) -> None:
    script = tmp_path / "log.py"
    script.write_text(PLAIN_LOG)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "d")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step saved again" in r.stderr and "\x1b[" not in r.stderr, r.stderr


def test_a_step_that_is_no_step_is_a_config_error_in_every_call(tmp_path: Path) -> None:
    ck = hotstart.Checkpointer(local_dir=tmp_path, job="neg")
    for bad in (-1, True, 1.0, "3", 1 << 64):
        for call in (lambda: ck.save(bad, state(1)), lambda: ck.load(step=bad),
                     lambda: ck.latest_step(below=bad), lambda: ck.saved_world_size(bad)):
            with pytest.raises(hotstart.ConfigError, match=r"step .*: expected an integer from 0 to 2\*\*64-1|below .*: expected"):
                call()
    # A numpy integer is a step.
    ck.save(np.int64(3), state(3)).wait()
    assert ck.latest_step(below=np.uint32(4)) == 3
    assert np.array_equal(ck.load(step=np.int64(3))["w"], state(3)["w"])
    # A step that is not there says which are.
    with pytest.raises(hotstart.NoCheckpoint, match="Complete steps of this world size: 3; load one"):
        ck.load(step=999)
    ck.close()


def test_loaded_tensors_keep_no_deleted_file_and_small_ones_own_their_memory(tmp_path: Path) -> None:
    torch = torch_or_fail()
    ck = hotstart.Checkpointer(store=str(tmp_path), job="own", keep=1)
    torch.manual_seed(1)
    rng_state = torch.get_rng_state()
    big = torch.randn(600, 601)  # views of the file's mapping: 1 MiB and more
    ck.save(1, {"rng": rng_state, "m": big, "n": np.arange(7)}).wait()
    got = ck.load()
    assert got["rng"].storage_offset() == 0 and got["rng"].is_contiguous()
    torch.set_rng_state(got["rng"])
    assert torch.equal(torch.get_rng_state(), rng_state)
    step1 = str(tmp_path / "own" / "step-1")
    assert step1 in Path("/proc/self/maps").read_text(), "the large tensor maps the file"
    # Retention removes step 1 while its tensors live on (an optimizer's state does): the next
    # save moves the mapping into memory of the process's own, and the file is freed.
    ck.save(2, {"rng": rng_state, "m": torch.zeros(3), "n": np.arange(3)})
    ck.wait()  # retention after it is done too
    assert f"{step1}/rank-0.safetensors (deleted)" in Path("/proc/self/maps").read_text()
    ck.save(3, {"rng": rng_state, "m": torch.zeros(3), "n": np.arange(3)}).wait()
    maps = Path("/proc/self/maps").read_text()
    assert step1 not in maps, [line for line in maps.splitlines() if step1 in line]
    assert torch.equal(got["m"], big)
    got["m"].add_(1)  # still writable memory of its own
    assert torch.equal(got["m"], big + 1)
    ck.close()
