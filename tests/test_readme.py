"""The README's examples run as written, each in a fresh process, and its commands point at real scripts.

Each fenced ``python`` block runs as ``python -c BLOCK`` from the repository root, in an environment
without conftest's device-count flag: a block that uses ``ringattn_fast`` must make its 8 simulated
devices itself, with the notebooks' first line, so the README shows a new user how.
"""
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
DEVICE_LINE = 'import jax\njax.config.update("jax_num_cpu_devices", 8)'


def fresh_env():
    """This process's environment without the 8 devices conftest forces, sharing its compilation cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    return env


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 5, "README lost python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs_in_a_fresh_process(index):
    block = BLOCKS[index]
    if "ringattn_fast" in block:  # it makes its devices, and gets 8
        assert block.startswith(DEVICE_LINE), f"README block {index} must start with\n{DEVICE_LINE}"
        block += "\nassert jax.device_count() == 8, jax.devices()\n"
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=fresh_env())
    assert run.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{run.stderr[-3000:]}"


def test_readme_commands_use_the_venv_python():
    """The commands that need the installed project run the venv's python, the one the two commands make."""
    assert not re.findall(r"(?<!\.venv/bin/)python (?:-m benchmarks|scripts/launch_local|tests/)", README)
    assert ("`.venv/bin/python scripts/launch_local.py --processes 2 --devices-per-process 4 -- "
            ".venv/bin/python tests/_multiprocess_worker.py`") in README


def test_readme_commands_exist_and_ci_runs_the_test_command():
    commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert "bash scripts/demo.sh" in commands[0] and "bash scripts/test.sh" in commands[1]
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/find-python", "scripts/setup-venv"):
        assert (ROOT / script).is_file(), script
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
