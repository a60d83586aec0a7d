"""hotstart.env.ensure with real venvs and real pip: install and publish on a miss, restore on a
hit (byte for byte, and the package imports), the errors a caller can catch. On a local directory
store and on SeaweedFS."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

import hotstart
import hotstart.env
from conftest import ROOT


def wheelhouse() -> Path:
    """The test wheelhouse of scripts/wheelhouse-test.txt, downloaded once."""
    subprocess.run(["bash", str(ROOT / "scripts" / "wheelhouse.sh"), "test",
                    str(ROOT / "scripts" / "wheelhouse-test.txt")], check=True)
    return ROOT / ".cache" / "wheelhouse" / "test"


def venv_install(lock: Path) -> List[str]:
    """A venv without pip, then the lock's packages from the wheelhouse (no network)."""
    py = sys.executable
    script = (
        f"'{py}' -m venv --without-pip \"$HOTSTART_ENV_TARGET\" && "
        f"'{py}' -m pip --disable-pip-version-check --python \"$HOTSTART_ENV_TARGET/bin/python\" "
        f"install -q --no-index --find-links '{wheelhouse()}' -r '{lock}'"
    )
    return ["sh", "-c", script]


def files(root: Path) -> Dict[str, str]:
    """Every file and symlink under root: blake2 of its bytes, or the link's target."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            out[rel] = "-> " + os.readlink(p) if p.is_symlink() else hashlib.blake2b(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(params=["local", "seaweedfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    bucket: str = request.getfixturevalue("bucket")
    return f"{bucket}/envs"


def test_install_then_restore_a_real_venv(store: str, tmp_path: Path) -> None:
    lock = tmp_path / "requirements.txt"
    lock.write_text("six==1.17.0\n")
    target = tmp_path / "venv"
    cache = tmp_path / "cache"
    install = venv_install(lock)

    first = hotstart.env.ensure(store, lock, target, install, python=sys.executable, cache_dir=cache)
    assert (first.action, first.published) == ("installed", True), first.details
    assert len(first.key) == 64 and first.target == str(target) and first.seconds > 0
    original = files(target)
    assert any(k.endswith("site-packages/six.py") for k in original), sorted(original)

    shutil.rmtree(target)
    again = hotstart.env.ensure(store, [lock], target, install, python=sys.executable, cache_dir=cache)
    assert again.action == "restored", again.details
    assert again.key == first.key
    assert again.files == sum(1 for v in original.values() if not v.startswith("-> "))
    assert again.bytes > 0
    assert files(target) == original
    out = subprocess.run([str(target / "bin" / "python"), "-c", "import six; print(six.__version__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1.17.0"

    present = hotstart.env.ensure(store, lock, target, install, python=sys.executable, cache_dir=cache)
    assert present.action == "present"


def test_errors_a_caller_can_catch(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    lock = tmp_path / "requirements.txt"
    lock.write_text("anything==1\n")
    target = tmp_path / "venv"

    # A failing install command: its exit code, nothing left, nothing published.
    with pytest.raises(hotstart.InstallFailed) as failed:
        hotstart.env.ensure(store, lock, target, ["sh", "-c", "mkdir -p \"$HOTSTART_ENV_TARGET\"; exit 7"],
                            cache_dir=tmp_path / "cache")
    assert failed.value.returncode == 7
    assert "exit code 7" in str(failed.value)
    assert not target.exists()
    assert not (tmp_path / "store" / "envs" / "snapshots").exists()

    # A directory ensure did not make is left alone.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine").write_text("precious")
    with pytest.raises(hotstart.TargetInUse) as in_use:
        hotstart.env.ensure(store, lock, foreign, ["true"], cache_dir=tmp_path / "cache")
    assert isinstance(in_use.value, FileExistsError)
    assert (foreign / "mine").read_text() == "precious"

    # Bad arguments, and a lazy mount, which only the command line serves.
    with pytest.raises(hotstart.ConfigError, match="hotstart env ensure --lazy"):
        hotstart.env.ensure(store, lock, target, ["true"], lazy=True)
    with pytest.raises(hotstart.ConfigError, match="install command"):
        hotstart.env.ensure(store, lock, target, [], cache_dir=tmp_path / "cache")
    with pytest.raises(hotstart.ConfigError, match="list of arguments"):
        hotstart.env.ensure(store, lock, target, "pip install six")
    with pytest.raises(hotstart.HotstartError, match="missing.txt"):
        hotstart.env.ensure(store, tmp_path / "missing.txt", target, ["true"], cache_dir=tmp_path / "cache")
