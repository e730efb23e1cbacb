"""Build the docs site with warnings as errors, so it cannot rot.

Notebook execution is switched off here (``-D nb_execution_mode=off``) because
``tests/test_notebooks.py`` executes every notebook already; ``make docs`` builds with
``nb_execution_mode="force"`` (see ``docs/conf.py``). Everything else is checked: the toctree
(every ``notebooks/NN_*.md`` is in the course), cross-references, MyST syntax, and autodoc of
``ringattn_ref`` and ``ringattn_fast``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_without_warnings(tmp_path):
    out = tmp_path / "html"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         "-D", "nb_execution_mode=off", "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}"
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    for page in ["index.html", "install.html", "course.html", "design.html", "api.html", "benchmarks.html",
                 "distributed.html"]:
        assert page in pages, f"{page} missing from the site"
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.md"))
    for name in notebooks:
        assert f"notebooks/{name}.html" in pages, f"notebook {name} missing from the site"
    course = (out / "course.html").read_text()
    positions = [course.find(f"notebooks/{name}.html") for name in notebooks]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), "course out of order"
    assert any(p.startswith("_autosummary/ringattn_ref.") for p in pages), "no API pages for ringattn_ref"
    assert any(p.startswith("_autosummary/ringattn_fast") for p in pages), "no API pages for ringattn_fast"
