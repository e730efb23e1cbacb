"""Build the docs site with warnings as errors, so it cannot rot.

Notebook execution is switched off here (``-D nb_execution_mode=off``) because
``tests/test_notebooks.py`` executes every notebook already; ``make docs`` builds with
``nb_execution_mode="force"`` (see ``docs/conf.py``). Everything else is checked: the toctree
(every ``notebooks/NN_*.md`` is in the course), cross-references, MyST syntax, and autodoc of
``ringattn_ref`` and ``ringattn_fast`` (whose docstrings must render: ``docs/conf.py`` turns a block
quote or a docutils warning in one into a Sphinx warning).

The site is built once per session (``site``) and then also opened in headless Chromium
(``tests/_browser.py``): every page, failing on console errors, broken images, requests of the site
that fail and links inside the site that lead nowhere. The notebook pages of this build have no
outputs (execution is off), so their figures are checked by ``make docs`` plus
``python tests/_browser.py docs/_build/html``, not here. Without Chromium the browser test is
skipped, unless ``RINGATTN_REQUIRE_BROWSER=1`` (CI: ``.ci/run`` installs it and sets that).
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once for this module: ``(html folder, sphinx-build's CompletedProcess)``."""
    tmp = tmp_path_factory.mktemp("docs")
    out = tmp / "html"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         "-D", "nb_execution_mode=off", "-d", str(tmp / "doctrees"), str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    return out, proc


@pytest.mark.slow
def test_docs_build_without_warnings(site):
    out, proc = site
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


@pytest.mark.slow
def test_notebook_pages_offer_colab_and_download(site):
    """Each course page links its Colab copy (install cell first) for download and in Colab."""
    out, proc = site
    if proc.returncode:
        pytest.skip("the build failed (test_docs_build_without_warnings says why)")
    for src in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.md")):
        page = (out / "notebooks" / f"{src.stem}.html").read_text()
        assert f'href="../_sources/notebooks/{src.stem}.ipynb"' in page, f"{src.stem}: no .ipynb download"
        assert f'href="../_sources/notebooks/{src.stem}.md"' in page, f"{src.stem}: no .md download"
        assert "colab.research.google.com/github/" in page and f"/notebooks/ipynb/{src.stem}.ipynb" in page, \
            f"{src.stem}: no Colab button"
        copy = json.loads((out / "_sources" / "notebooks" / f"{src.stem}.ipynb").read_text())
        assert "%pip install" in "".join(copy["cells"][0]["source"]), f"{src.stem}: the .ipynb lacks the install cell"
    assert f"{datetime.date.today().year}, ringattn contributors" in (out / "index.html").read_text()


def _browser():
    spec = importlib.util.spec_from_file_location("ringattn_browser", ROOT / "tests" / "_browser.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses need it
    spec.loader.exec_module(module)
    return module


def _chromium_or_skip(browser):
    if browser.find_chromium() is None:
        reason = ("no Chromium on this machine (apt-get install chromium, or set RINGATTN_CHROMIUM=/path); "
                  "CI installs it and sets RINGATTN_REQUIRE_BROWSER=1, so there this check never skips")
        if os.environ.get("RINGATTN_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.mark.slow
def test_browser_check_sees_breakage(tmp_path):
    """The check itself, on a two-page site with one of each fault: it must report them all."""
    browser = _browser()
    _chromium_or_skip(browser)
    (tmp_path / "index.html").write_text(
        '<html><body><img src="missing.png"><script>console.error("boom")</script>'
        '<a href="gone.html">x</a><a href="b.html#nowhere">y</a><a href="b.html#here">z</a></body></html>')
    (tmp_path / "b.html").write_text('<html><body><p id="here">ok</p><script>undefined_name()</script></body></html>')
    report = browser.check_site(tmp_path)
    text = "\n".join(report.errors)
    assert report.pages == ["b.html", "index.html"]
    for fault in ["image did not load: missing.png", "console.error: boom", "link to gone.html gives HTTP 404",
                  "link to b.html#nowhere", "uncaught: ReferenceError", "HTTP 404 for missing.png"]:
        assert fault in text, f"not reported: {fault}\n{text}"
    assert "#here" not in text


@pytest.mark.slow
def test_site_in_browser(site, record_property):
    """Every page of the site in headless Chromium: no console error, broken image, failed request of
    the site or dead link inside it. Screenshots for a person: ``docs/_build/screenshots/``."""
    out, proc = site
    if proc.returncode:
        pytest.skip("the build failed (test_docs_build_without_warnings says why)")
    browser = _browser()
    _chromium_or_skip(browser)
    shots = ROOT / "docs" / "_build" / "screenshots"
    report = browser.check_site(out, browser.screenshot_paths(shots))
    summary = (f"{len(report.pages)} pages, {report.links_checked} links to the site, "
               f"{len(report.external)} external URLs not fetched, {report.seconds:.1f} s")
    (shots / "browser_check.txt").write_text("\n".join([summary, *report.errors, *sorted(report.external)]) + "\n")
    record_property("browser_check", summary)
    pages = [p for p in out.rglob("*.html") if p.relative_to(out).parts[0] != "_static"]
    assert len(report.pages) == len(pages), f"opened {len(report.pages)} of {len(pages)} pages"
    assert not report.errors, f"{len(report.errors)} problems in the browser:\n" + "\n".join(report.errors[:50])
