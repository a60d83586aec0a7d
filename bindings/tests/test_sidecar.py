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
from conftest import ROOT, _die_with_parent, _free_ports, need


def _hotstart_bin() -> str:
    exe = os.environ.get("HOTSTART_BIN") or str(ROOT / "target" / "debug" / "hotstart")
    if not os.access(exe, os.X_OK):
        need("the hotstart binary", f"{exe} is missing (`cargo build --bin hotstart`)")
    return exe


class Sidecar:
    """`hotstart serve` on loopback with a disk tier, no peers (insecure: loopback only)."""

    def __init__(self, tmp: Path) -> None:
        peer, http = _free_ports(2)
        self.socket = tmp / "sidecar.sock"
        self.http = f"http://127.0.0.1:{http}"
        self.log = tmp / "sidecar.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
        env["HOTSTART_LOG"] = "info"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    _hotstart_bin(), "serve", "--insecure", "--node-id", "py-0",
                    "--listen", f"127.0.0.1:{peer}", "--http", f"127.0.0.1:{http}",
                    "--socket", str(self.socket), "--disk-dir", str(tmp / "disk"),
                    "--memory-budget", "256MiB",
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the sidecar did not become ready:\n{self.log.read_text()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.http + "/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str, labels: str) -> float:
        with urllib.request.urlopen(self.http + "/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    s = Sidecar(tmp_path)
    try:
        yield s
    finally:
        s.stop()


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


def test_the_socket_comes_from_the_environment(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSTART_SOCKET", str(sidecar.socket))
    with hotstart.Checkpointer(job="py-env") as ck:
        assert ck.engine.tiers[0] == "memory"
        h = ck.save(7, {"x": np.arange(10, dtype=np.int64)})
        h.wait()
        assert h.status()["memory"] == "done"
        assert np.array_equal(ck.load()["x"], np.arange(10))
