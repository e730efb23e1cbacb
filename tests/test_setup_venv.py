"""scripts/setup-venv (shared by scripts/demo.sh and scripts/test.sh) installs what is asked, the demo
without the project's dependencies, and skips pip when the venv's stamp says it has it already.
pip is faked (a venv python that logs pip's arguments): no network, about a second."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
# pip only logs its arguments; everything else runs on the real interpreter.
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "${{@:3}}" >> "$(dirname "$0")/pip.log"; exit 0; fi
exec {real} "$@"
"""


@pytest.fixture
def checkout(tmp_path):
    """What setup-venv reads (itself, find-python, pyproject.toml) and a venv with the fake python."""
    for name in ("scripts/setup-venv", "scripts/find-python", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(real=sys.executable))
    python.chmod(0o755)
    return tmp_path


def setup_venv(checkout, *args, ok=True):
    """Run setup-venv; returns (the pip commands it ran, its stderr)."""
    log = checkout / "venv" / "bin" / "pip.log"
    log.unlink(missing_ok=True)
    run = subprocess.run(["bash", str(checkout / "scripts" / "setup-venv"), *args], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "VENV": str(checkout / "venv")})
    assert (run.returncode == 0) == ok, run.stderr
    if ok:
        assert run.stdout == f"{checkout}/venv/bin/python\n"  # what the callers run
    return (log.read_text().splitlines() if log.exists() else []), run.stderr


def test_demo_installs_no_dependencies_and_a_second_run_installs_nothing(checkout):
    pip, err = setup_venv(checkout, "--no-deps", "demo")
    assert pip == ["install -q numpy>=1.26 matplotlib>=3.8", f"install -q --no-deps -e {checkout}"]
    assert "installing ringattn (editable, without its dependencies) and [demo]" in err
    pip, err = setup_venv(checkout, "--no-deps", "demo")
    assert pip == [] and "up to date" in err


def test_the_test_extras_install_after_the_demo_and_cover_it(checkout):
    setup_venv(checkout, "--no-deps", "demo")
    pip, _ = setup_venv(checkout, "test,flax")  # scripts/test.sh asks for more than the demo installed
    assert pip == [f"install -q -e {checkout}[test,flax]"]
    for covered in (["--no-deps", "demo"], ["test"], ["flax,test"]):
        assert setup_venv(checkout, *covered)[0] == [], covered
    assert setup_venv(checkout, "test,notebooks")[0] == [f"install -q -e {checkout}[test,notebooks]"]


def test_a_changed_pyproject_reinstalls(checkout):
    setup_venv(checkout, "test")
    with open(checkout / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    assert setup_venv(checkout, "test")[0] == [f"install -q -e {checkout}[test]"]


def test_an_unknown_extra_is_refused_by_name(checkout):
    _, err = setup_venv(checkout, "--no-deps", "demo,nosuch", ok=False)
    assert "no extra named 'nosuch' in pyproject.toml" in err
