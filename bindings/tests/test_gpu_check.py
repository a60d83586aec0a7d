"""scripts/gpu-check.sh: `build` makes the bundle the GPU machine runs (CUDA test binary, stall
benchmark, abi3 wheel, the Python half); `run` without a GPU says so and exits
cleanly; and its self-test runs every step of `run` here (the Python half on CPU tensors, the torchrun job
on gloo, the CUDA tests on their no-driver path), so the script's own logic is checked before a GPU is.

The bundle is built with the dev profile (GPU_CHECK_PROFILE=dev): the same parts, from what `cargo
test` and `maturin develop` compiled before, instead of a release build from scratch. The release
bundle's 64 MiB bound is checked by the script when it builds one for a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, torch_or_fail

torch = torch_or_fail()


def test_the_gpu_check_builds_its_bundle_and_runs_every_step_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    env = dict(os.environ, GPU_CHECK_DIR=str(out), PYTHON=sys.executable, GPU_CHECK_TMP=str(tmp_path),
               GPU_CHECK_PROFILE="dev")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "build"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["bin", "gpu-check.sh", "gpu_check.py", "train.py", "wheel"]
    (wheel,) = (out / "wheel").glob("*.whl")
    assert "-abi3-" in wheel.name  # installs on the GPU machine's Python 3.12
    for name in ("ckpt-cuda-tests", "gpu_stall", "hotstart"):
        assert os.access(out / "bin" / name, os.X_OK), name

    run = ["bash", str(out / "gpu-check.sh"), "run"]
    if not torch.cuda.is_available():
        r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "no GPU here" in r.stdout, r.stdout + r.stderr
        assert not (out / "results").exists()

    r = subprocess.run(run, env=dict(env, GPU_CHECK_SELFTEST="1"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads((out / "results" / "summary.json").read_text())
    parts = summary["parts"]
    assert parts["cuda-tests"] == "passed" and parts["python"] == "passed", parts
    # A real torchrun job (gloo here): a killed worker resumed from the sidecar's memory bit-exact.
    assert parts["torchrun"] == "passed" and summary["torchrun"]["bit-exact"] is True, parts
    for name in ("stall-4gib", "stall-16gib"):
        assert parts[name] == "passed" or parts[name].startswith("skipped: CUDA: no CUDA driver"), parts
    assert summary["python"]["checks"] and all(summary["python"]["checks"].values()), summary["python"]
    text = (out / "results" / "summary.md").read_text()
    assert "| cuda-tests | passed |" in text and "hotstart save → wait_staged" in text
    assert "floor of the process copying: copy the bytes out of shared memory" in text
    # The restore through a sidecar that does not pin for the GPU, beside the one that does.
    assert "| sidecar `--no-gpu-pin`: load() into device tensors, the process copies |" in text
    # A training loop checkpointing every few steps, each way in the same run; hotstart's last
    # checkpoint loaded back bit-exact.
    assert parts["train-loop"] == "passed", parts
    loop = summary["train_loop"]
    assert loop["bit-exact"] == {"hotstart Checkpointer, local disk tier": True, "hotstart through the sidecar": True}
    assert "| hotstart through the sidecar |" in text and "| DCP async_save |" in text
    assert loop["not measured"] == {}, loop["not measured"]  # DCP with pinned staging too
    # Each part's temporary files went with it (a part stopped at its limit leaves gigabytes).
    assert not list(tmp_path.glob("gpu-check-*")), list(tmp_path.iterdir())
    assert "kill → state loaded from the sidecar's memory" in text and "resumed bit-exact: yes" in text
    # What the sidecar's pinning thread did, read from its metrics once no step waited for it:
    # without a GPU it pins nothing (and fails nothing), and the table says so.
    pinned = [rows["sidecar: pinning each step for the GPU, in the background"]
              for rows in summary["python"]["sizes"].values()]
    pinned.append(loop["sidecar: pinning each step for the GPU, in the background"])
    for p in pinned:
        assert p["waiting"] == 0 and p["failed"] == 0, p
        assert torch.cuda.is_available() or p["pinned"] == 0, p
    if not torch.cuda.is_available():
        assert text.count("| sidecar: steps pinned for the GPU, in the background | 0 pinned, 0 failed, "
                          "0 still waiting | none |") == len(pinned), text
    # Where the sidecar's copies into device tensors spent their time, read from its metrics:
    # without a GPU it copies none, and the table says so.
    sizes = list(summary["python"]["sizes"].values())
    uploads = [rows["sidecar: its copies, by phase"] for rows in sizes]
    # The cost of a restore beyond its copy, measured at the first size (a 4 KiB restore).
    assert sizes[0]["sidecar: load() of 4 KiB into a device tensor, the cost per restore (s)"] > 0, sizes[0]
    assert "| sidecar: load of 4 KiB into a device tensor (the cost per restore) |" in text
    uploads.append(sizes[0]["sidecar: 4 KiB, its copies, by phase"])
    uploads.append(summary["torchrun"]["the state read: the sidecar's copies, by phase"])
    for u in uploads:
        assert set(u) == {"restores copied", "handles each", "open (ms each)", "copy (ms each)", "close (ms each)"}, u
        assert torch.cuda.is_available() or u["restores copied"] == 0, u
    if not torch.cuda.is_available():
        assert text.count("| … the sidecar's copies, by phase | none copied | | |") == len(uploads), text

    # A rerun of some parts only: the others are listed as not run, and the run still passes.
    r = subprocess.run(run, env=dict(env, GPU_CHECK_SELFTEST="1", GPU_CHECK_PARTS="cuda-tests"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    parts = json.loads((out / "results" / "summary.json").read_text())["parts"]
    assert parts["cuda-tests"] == "passed", parts
    assert {v for k, v in parts.items() if k != "cuda-tests"} == {"not run (GPU_CHECK_PARTS)"}, parts


def test_a_dcp_stager_that_closed_itself_is_replaced_before_the_next_save(tmp_path: Path, monkeypatch) -> None:
    """Some torch versions close a DefaultStager after every stage (its copier table cleared, so
    a second save would fail with KeyError: <class 'type'>): the loop's DCP row makes a new
    one then, and every save's bytes land."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    stage = DefaultStager._stage

    def stage_and_close(self, state_dict, **kw):  # as those versions do
        staged = stage(self, state_dict, **kw)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_and_close)
    saver = gpu_check.DCPSaver(tmp_path, "dcp", gpu_check.pinned_stager("cpu"))
    made = [saver.stager]
    for step in (1, 2, 3):
        st = {"w": torch.arange(1000, dtype=torch.float32) + step}
        saver.save(step, st)
        saver.ready()
        saver.upload.result()
        back = {"w": torch.zeros(1000)}
        dcp.load(back, checkpoint_id=str(saver.where))
        assert torch.equal(back["w"], st["w"]), step
        made.append(saver.stager)
    saver.drain()
    saver.close()
    assert len({id(s) for s in made}) == 3, "a new stager for each save after the first"
