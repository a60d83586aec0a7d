"""`hotstart demo --trainer torch`: the main job's three faults (kill -9 of a trainer, of a
whole node, every node plus a flipped byte on disk) with PyTorch trainers under torchrun, each
checkpointing through its node's sidecar with `hotstart.Checkpointer`. The demo's own checks
hold: every restored state hashes as it did when it was saved, every step trained again gives
the same loss to the bit, and each recovery came from the tier it should."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import _hotstart_bin, torch_or_fail

torch_or_fail()


def test_demo_with_torch_trainers_recovers_every_fault_bit_exact(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(
        [
            _hotstart_bin(), "demo", "--trainer", "torch", "--python", sys.executable,
            "--size", "8MiB", "--every", "20", "--json", "--dir", str(tmp_path / "demo"),
        ],
        env=env, capture_output=True, text=True, timeout=900,
    )
    logs = "".join(
        f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted((tmp_path / "demo").glob("*.log"))
    ) if r.returncode != 0 else ""
    assert r.returncode == 0, f"hotstart demo failed:\n{r.stderr[-6000:]}{logs}"
    summary = json.loads(r.stdout)
    assert summary["trainer"] == "torch"
    assert summary["problems"] == [], r.stderr[-6000:]
    faults = summary["faults"]
    assert len(faults) == 3, summary
    steps = [f["step"] for f in faults]
    assert steps == sorted(set(steps)), summary
    for f in faults:
        assert f["exact"] is True, f
        assert len(f["sources"]) == 3, f
    # A trainer killed: every rank comes back from its sidecar's memory.
    assert all(s == "memory" for s in faults[0]["sources"]), faults[0]
    # Every node killed: no memory survives; rank 0's flipped chunk comes from the store.
    third = faults[2]["sources"]
    assert all("memory" not in s for s in third), third
    assert "store" in third[0], third
    assert {t["tier"] for t in summary["tiers"]} >= {"memory", "peer", "disk", "store"}


def test_demo_with_torch_trainers_names_a_python_without_torch(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = subprocess.run(
        [_hotstart_bin(), "demo", "--trainer", "torch", "--python", str(fake),
         "--dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0
    needs = "--trainer torch needs a Python with torch and the hotstart package"
    assert needs in r.stderr, r.stderr
    assert "No module named torch" in r.stderr, r.stderr
    assert not (tmp_path / "demo").exists(), "nothing is started before the check"
