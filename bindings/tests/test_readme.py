"""The README's Python example runs as written: from scratch, then killed with SIGKILL and
resumed, and the resumed run's checkpoint is bit-exact with an uninterrupted run's (model,
optimizer, scheduler and every RNG state restored). Every ```python block of the README and
docs/ runs, so none can rot."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest

import hotstart
from conftest import ROOT, run_python, torch_or_fail

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> List[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", doc.read_text(), re.M | re.S)):
            out.append((f"{doc.name}#{i}", m.group(1)))
    return out


def readme_loop() -> str:
    blocks = [code for name, code in python_blocks() if name.startswith("README.md")]
    loops = [b for b in blocks if "hotstart.Checkpointer(job=\"example\")" in b]
    assert len(loops) == 1, "the README's training loop is not where this test looks for it"
    return loops[0]


# Runs the README's block, killed with SIGKILL when it asks to save step 40, once step 30 is
# durable: a crash between two checkpoints.
KILLED = """
import os, signal, sys
import hotstart
save = hotstart.Checkpointer.save
def killing_save(self, step, state):
    if step == 40:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return save(self, step, state)
hotstart.Checkpointer.save = killing_save
block = open(sys.argv[1]).read()
exec(compile(block, "README.md", "exec"))
"""


def flat(x: Any, path: str = "") -> dict:
    torch = torch_or_fail()
    if isinstance(x, dict):
        return {k2: v2 for k, v in x.items() for k2, v2 in flat(v, f"{path}.{k}").items()}
    if isinstance(x, (list, tuple)):
        return {k2: v2 for i, v in enumerate(x) for k2, v2 in flat(v, f"{path}.{i}").items()}
    if isinstance(x, torch.Tensor):
        return {path: ("torch", str(x.dtype), tuple(x.shape), x.numpy().tobytes())}
    if isinstance(x, np.ndarray):
        return {path: ("numpy", str(x.dtype), x.shape, x.tobytes())}
    return {path: x}


@pytest.mark.parametrize("name,code", python_blocks(), ids=[n for n, _ in python_blocks()])
def test_every_python_block_of_the_docs_runs(name: str, code: str, tmp_path: Path) -> None:
    torch_or_fail()
    script = tmp_path / "block.py"
    script.write_text(code)
    run_python([str(script)], env={"HOTSTART_STORE": str(tmp_path / "store")}, timeout=300)


def test_the_readme_loop_resumes_after_kill_bit_exact(tmp_path: Path) -> None:
    torch_or_fail()
    block = tmp_path / "loop.py"
    block.write_text(readme_loop())
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    run_python([str(block)], env={"HOTSTART_STORE": str(whole)})

    harness = tmp_path / "killed.py"
    harness.write_text(KILLED)
    r = run_python([str(harness), str(block)], env={"HOTSTART_STORE": str(killed)}, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ck = hotstart.Checkpointer(store=str(killed), job="example")
    assert ck.latest_step() == 30
    ck.close()
    # Resumed as written: from step 30, with its scheduler and RNG states.
    run_python([str(block)], env={"HOTSTART_STORE": str(killed)})

    a = hotstart.Checkpointer(store=str(whole), job="example")
    b = hotstart.Checkpointer(store=str(killed), job="example")
    assert a.steps() == b.steps() == [20, 30, 40]
    sa, sb = flat(a.load(step=40)), flat(b.load(step=40))
    assert sa.keys() == sb.keys() and len(sa) > 10
    for k in sa:
        assert sa[k] == sb[k], f"{k} differs after the resume"
    a.close()
    b.close()

    # A step removed from every tier is trained and saved again, and replaces nothing wrongly:
    # the resumed run from step 20 lands on the same step 40.
    for step in (30, 40):
        shutil.rmtree(killed / "example" / f"step-{step}")
    run_python([str(block)], env={"HOTSTART_STORE": str(killed)})
    b = hotstart.Checkpointer(store=str(killed), job="example")
    sb = flat(b.load(step=40))
    for k in sa:
        assert sa[k] == sb[k], f"{k} differs after the resume from step 20"
    b.close()
