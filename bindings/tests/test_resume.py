"""Kill -9 a training loop mid-run, restart it, and check it resumes from the last complete step
with the loss sequence of a run that was never interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import hotstart

from conftest import ROOT, SeaweedFs, run_python, torch_or_fail

STEP = re.compile(r"^step (\d+) loss (\S+)$")


def losses(out: str) -> Dict[int, str]:
    got = {}
    for line in out.splitlines():
        m = STEP.match(line)
        if m:
            got[int(m.group(1))] = m.group(2)
    return got


def run_until_killed(args: List[str], kill_after: int, env: Optional[Dict[str, str]] = None) -> Tuple[str, int]:
    """Runs the example and SIGKILLs it as soon as it has printed step `kill_after`."""
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, **(env or {})))
    lines = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            m = STEP.match(line.strip())
            if m and int(m.group(1)) >= kill_after:
                p.send_signal(signal.SIGKILL)
                break
    finally:
        p.kill()
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, f"exited {p.returncode} before the kill: {p.stderr.read() if p.stderr else ''}"
    return "".join(lines), kill_after


@pytest.mark.parametrize("example", ["train_numpy.py", "train_torch.py"])
def test_killed_training_resumes_with_the_same_losses(example: str, tmp_path: Path) -> None:
    if example == "train_torch.py":
        torch_or_fail()
    script = str(ROOT / "examples" / example)
    common = ["--steps", "60", "--every", "5", "--seed", "3"]
    extra = ["--device", "cpu"] if example == "train_torch.py" else []

    reference = losses(run_python([script, *common, *extra, "--local-dir", str(tmp_path / "ref"), "--job", "ref"]).stdout)
    assert sorted(reference) == list(range(1, 61))

    ckpt = ["--local-dir", str(tmp_path / "run"), "--job", "run"]
    killed_out, killed_at = run_until_killed([script, *common, *extra, *ckpt], kill_after=33)
    before = losses(killed_out)
    assert all(before[s] == reference[s] for s in before)

    with hotstart.Checkpointer(local_dir=tmp_path / "run", job="run") as ck:
        last = ck.latest_step()
    assert last is not None and last % 5 == 0 and last <= killed_at

    resumed = run_python([script, *common, *extra, *ckpt]).stdout
    assert f"resumed from step {last}\n" in resumed
    after = losses(resumed)
    assert sorted(after) == list(range(last + 1, 61))
    assert all(after[s] == reference[s] for s in after), "losses differ after the resume"


def test_resume_from_the_object_store(seaweed: SeaweedFs, tmp_path: Path) -> None:
    """The same through SeaweedFS only: a new machine has nothing on its local disk."""
    bucket = seaweed.fresh_bucket("resume")
    script = str(ROOT / "examples" / "train_numpy.py")
    args = [script, "--steps", "40", "--every", "4", "--store", bucket, "--job", "s3run"]
    reference = losses(run_python([script, "--steps", "40", "--local-dir", str(tmp_path), "--job", "ref"]).stdout)
    killed_out, _ = run_until_killed(args, kill_after=22, env=seaweed.env())
    resumed = run_python(args, env=seaweed.env()).stdout
    first = re.search(r"resumed from step (\d+)", resumed)
    assert first is not None
    last = int(first.group(1))
    assert last % 4 == 0 and last <= 22
    after = losses(resumed)
    assert sorted(after) == list(range(last + 1, 41))
    assert all(after[s] == reference[s] for s in after)
