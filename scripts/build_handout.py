"""Build the student handout of the course: ``python scripts/build_handout.py DEST``.

DEST gets what a student needs and nothing an instructor keeps back: the two libraries
(``ringattn_ref``, ``ringattn_fast``), the notebooks (lectures) with the lab skeletons and the
grader (``notebooks/labs``), the examples (notebook 12 imports the recall example, ``examples/recall``;
``scripts/demo.sh`` runs ``examples/demo.py``), the pages of ``docs/`` a student reads or a notebook
reads (the course and install pages with the install line, ``docs/training.md`` and the full training
run's metrics and figure, which notebook 12 checks), ``pyproject.toml``, the README and the install
scripts. It does not get ``tests/`` (where the reference solutions and the wrong variants live), the
instructor's kit (``docs/instructor/``: the answer key, the exam), the rest of the docs or the
benchmarks. Only files git tracks are copied (no notebook outputs, no virtualenv). The grader works
from the handout as it is: ``python notebooks/labs/grade.py lab01 my_lab01.py`` in DEST
(tests/test_labs.py builds a handout and grades reference solutions there); every notebook runs from
it, installed with the documented extras only (tests/test_notebooks.py runs them there).

As a guard, the build fails if any copied file lies under what is kept back or holds a reference
solution's text.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ("ringattn_ref/", "ringattn_fast/", "notebooks/", "examples/", "pyproject.toml", "README.md", "Makefile",
           "scripts/setup-venv", "scripts/find-python", "scripts/demo.sh",
           "docs/course.md", "docs/install.md", "docs/training.md", "docs/_static/training_full.json",
           "docs/_static/training_full.png")
# Never in a handout, whatever INCLUDE says: the solutions, the wrong variants, the answer key and exam.
KEPT_BACK = ("tests/", "docs/instructor/")
SOLUTIONS = ROOT / "tests" / "lab_solutions"


def handout_files(root=ROOT):
    """The tracked files of the handout, relative to the repository root."""
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in tracked if f.startswith(INCLUDE) and (root / f).is_file()]


def _solution_bodies():
    """The reference solutions' own code lines (long ones, not in the skeleton: what must not leak)."""
    bodies = []
    for path in sorted(SOLUTIONS.glob("lab*.py")):
        skeleton = ROOT / "notebooks" / "labs" / path.name
        given = {line.strip() for line in skeleton.read_text().splitlines()} if skeleton.exists() else set()
        lines = [line.strip() for line in path.read_text().splitlines()]
        code = [line for line in lines if line and line not in given and not line.startswith(("#", '"""'))]
        bodies.append((path.name, [line for line in code if len(line) > 40]))
    return bodies


def build(dest):
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"build_handout: {dest} exists and is not empty")
    files = handout_files()
    kept = [rel for rel in files if rel.startswith(KEPT_BACK)]
    if kept:  # before anything is copied
        raise SystemExit(f"build_handout: {kept[0]} is kept back from students ({', '.join(KEPT_BACK)})")
    bodies = _solution_bodies()
    for rel in files:
        text = (ROOT / rel).read_bytes()
        if rel.endswith(".py") and rel.startswith("notebooks/labs/"):
            src = text.decode("utf-8", "replace")
            for name, lines in bodies:
                leaked = [line for line in lines if line in src]
                if len(leaked) >= 3:
                    raise SystemExit(f"build_handout: {rel} holds lines of the reference solution {name}: "
                                     f"{leaked[:2]}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return dest, len(files)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="an empty or new directory")
    args = parser.parse_args(argv)
    dest, n = build(args.dest)
    print(f"handout: {n} files in {dest} (no tests/, no docs/instructor/, no reference solutions); grade with "
          f"python notebooks/labs/grade.py labNN my_solution.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
