"""The shipped type information is checked: mypy --strict over the package (its .py modules and
the native module's _core.pyi) and a typed usage file, and stubtest of _core.pyi against the
built extension."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT, run_python

PKG = ROOT / "bindings" / "python" / "hotstart"


def test_package_files_ship_the_stubs() -> None:
    assert (PKG / "_core.pyi").is_file() and (PKG / "py.typed").is_file()


def test_mypy_strict_on_the_package_and_a_usage_file() -> None:
    usage = str(Path(__file__).with_name("typing_usage.py"))
    r = run_python(["-m", "mypy", "--strict", "--no-incremental", str(PKG), usage], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout


def test_stubtest_matches_the_extension() -> None:
    r = run_python(["-m", "mypy.stubtest", "hotstart._core"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
