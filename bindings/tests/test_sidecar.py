"""With a sidecar (`hotstart serve`): a training process killed with SIGKILL restores its
state from the sidecar's memory, bit-exact, as the sidecar's metrics show."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import hotstart
from conftest import Sidecar, _die_with_parent


TRAINER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import hotstart

    socket, job = sys.argv[1], sys.argv[2]
    ck = hotstart.Checkpointer(sidecar=socket, job=job)
    for step in (1, 2, 3):
        rng = np.random.default_rng(step)
        state = {"w": rng.standard_normal((256, 1024), dtype=np.float32),
                 "b": rng.integers(0, 255, 4096, dtype=np.uint8),
                 "meta": {"step": step, "lr": 0.5 / step}}
        ck.save(step, state).wait()
    print("saved", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_trainer_restores_from_the_sidecars_memory(sidecar: Sidecar, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), str(sidecar.socket), "py-sidecar"],
                            stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saved"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    before = sidecar.metric("hotstart_restores_total", 'source="memory"')
    ck = hotstart.Checkpointer(sidecar=sidecar.socket, job="py-sidecar")
    assert ck.latest_step() == 3
    got = ck.load()
    rng = np.random.default_rng(3)
    assert np.array_equal(got["w"], rng.standard_normal((256, 1024), dtype=np.float32))
    assert np.array_equal(got["b"], rng.integers(0, 255, 4096, dtype=np.uint8))
    assert got["meta"] == {"step": 3, "lr": 0.5 / 3}
    assert sidecar.metric("hotstart_restores_total", 'source="memory"') == before + 1

    # In place, into the caller's arrays, through the same single request.
    into = {"w": np.zeros((256, 1024), np.float32), "b": np.zeros(4096, np.uint8),
            "meta": {}}
    ck.load(into, step=2)
    rng = np.random.default_rng(2)
    assert np.array_equal(into["w"], rng.standard_normal((256, 1024), dtype=np.float32))
    assert into["meta"] == {"step": 2, "lr": 0.25}
    ck.close()


KILLED_AFTER_STAGING = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import hotstart

    socket, job = sys.argv[1], sys.argv[2]
    ck = hotstart.Checkpointer(sidecar=socket, job=job)
    ck.save(1, {"w": np.full(1 << 20, 1, np.uint8)}).wait()
    state = {"w": np.random.default_rng(2).integers(0, 255, 64 << 20, dtype=np.uint8)}
    ck.save(2, state).wait_staged()
    # Killed at once: usually before the save thread has committed step 2.
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_trainer_killed_right_after_wait_staged_keeps_that_step(sidecar: Sidecar, tmp_path: Path) -> None:
    """`wait_staged()` through a sidecar is the point from which a save survives its process:
    the sidecar commits a step whose bytes were all in place when the process died. Whether the
    kill lands before or after the process's own commit is a race; either way the step must load
    bit-exact. The sidecar's own commit of a filled segment is tested without the race in
    sidecar/tests/sidecar.rs."""
    script = tmp_path / "trainer.py"
    script.write_text(KILLED_AFTER_STAGING)
    proc = subprocess.run([sys.executable, str(script), str(sidecar.socket), "py-staged"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_die_with_parent)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ck = hotstart.Checkpointer(sidecar=sidecar.socket, job="py-staged")
    # The sidecar finishes the step once it sees the connection close (hashing 64 MiB).
    deadline = time.monotonic() + 30
    while ck.latest_step() != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ck.latest_step() == 2, sidecar.log.read_text()[-3000:]
    got = ck.load()
    assert np.array_equal(got["w"], np.random.default_rng(2).integers(0, 255, 64 << 20, dtype=np.uint8))
    ck.close()


def test_the_socket_comes_from_the_environment(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSTART_SOCKET", str(sidecar.socket))
    with hotstart.Checkpointer(job="py-env") as ck:
        assert ck.engine.tiers[0] == "memory"
        h = ck.save(7, {"x": np.arange(10, dtype=np.int64)})
        h.wait()
        assert h.status()["memory"] == "done"
        assert np.array_equal(ck.load()["x"], np.arange(10))


def test_new_arrays_after_a_sidecar_restart_map_the_file_it_hands_over(sidecar: Sidecar, tmp_path: Path) -> None:
    """A restarted sidecar (memory empty, disk kept) hands the step's file over: new arrays are
    a private mapping of it, verified where they lie, as without a sidecar, and writing one
    changes neither the file nor the sidecar's memory."""
    rng = np.random.default_rng(9)
    state = {f"t{i}": rng.standard_normal(140_000) for i in range(4)}  # views: 1 MiB and more
    with hotstart.Checkpointer(sidecar=sidecar.socket, job="py-handed") as ck:
        ck.save(1, state).wait()
    sidecar.stop()
    again = Sidecar(tmp_path)
    try:
        data = tmp_path / "disk" / "py-handed" / "step-1" / "rank-0.safetensors"
        raw = data.read_bytes()
        with hotstart.Checkpointer(sidecar=again.socket, job="py-handed") as ck:
            out = ck.load()
            assert ck.loaded_from and set(ck.loaded_from) == {"disk"}, ck.loaded_from
            for k, v in state.items():
                assert out[k].dtype == v.dtype and out[k].tobytes() == v.tobytes(), k
                assert out[k].flags.writeable
            assert str(data) in Path("/proc/self/maps").read_text(), "new arrays map the handed file"
            out["t0"][:] = 0
            assert data.read_bytes() == raw
            assert again.metric("hotstart_memory_shards", 'origin="local"') == 0
            assert ck.load()["t0"].tobytes() == state["t0"].tobytes()
            del out
    finally:
        again.stop()
