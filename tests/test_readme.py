"""The README's usage example runs as written, and its two commands point at real scripts."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_commands_exist_and_ci_runs_the_test_command():
    commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert "bash scripts/demo.sh" in commands[0] and "bash scripts/test.sh" in commands[1]
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/find-python", "scripts/setup-venv"):
        assert (ROOT / script).is_file(), script
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
