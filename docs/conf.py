"""Sphinx configuration for the ringattn site (Sphinx + myst-nb, builds offline).

Two ways the site is built, on purpose:

* ``make docs`` runs ``sphinx-build -W -b html docs docs/_build/html`` with
  ``nb_execution_mode = "force"`` (the default below): every notebook of the course is executed
  during the build and an error in any cell fails it (``nb_execution_raise_on_error``), as does any
  Sphinx warning (``-W``).
* ``tests/test_docs.py`` (run in CI) builds the same site with ``-W`` but
  ``-D nb_execution_mode=off``, because ``tests/test_notebooks.py`` already executes every notebook
  once; running them twice would double the notebooks' share of CI time. Everything else
  (toctree, cross-references, autodoc of both packages, MyST syntax) is checked by that build, so
  the site cannot rot.

The course pages come from ``docs/notebooks``, a symlink to ``../notebooks`` (Sphinx follows
symlinks), so the MyST notebooks have a single source and need no copy step.

The theme is sphinx-book-theme. Every notebook page has a download button (the page's ``.md``
source, and an ``.ipynb``: the Colab copy of ``make notebooks-ipynb``, install cell first, written
into the site by :func:`_colab_copy` below) and a Colab button. Colab opens notebooks from GitHub
only, so the Colab button needs the repository: one setting, ``RINGATTN_REPO_URL`` (see
``REPO_URL`` and ``docs/install.md``).
"""
import datetime
import functools
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import the packages from this checkout even when they are not pip-installed, and let the notebook
# kernels that myst-nb starts (child processes) find them too.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# Autodoc imports ringattn_fast, i.e. JAX: use the CPU, quietly.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "ringattn"
author = "ringattn contributors"
copyright = f"{datetime.date.today().year}, ringattn contributors"
release = "0.1.0"

extensions = [
    "myst_nb",                   # MyST markdown + executable notebooks (also provides myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",         # a copy button on every code block
]

exclude_patterns = [
    "_build", "jupyter_execute", "Thumbs.db", ".DS_Store",
    "notebooks/ipynb", "notebooks/README.md", "notebooks/**/.ipynb_checkpoints",
]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["course.css"]  # folded answers, source listings
# --- theme: sphinx-book-theme (on pydata-sphinx-theme) ------------------------------------------------
# The repository the site's Colab and repository buttons point to: the one setting to change when the
# project has a public home. A GitHub URL (Colab opens notebooks from GitHub only), optionally with
# ``/tree/BRANCH`` (default ``main``). The placeholder keeps the buttons' shape until then.
REPO_URL = os.environ.get("RINGATTN_REPO_URL", "https://github.com/OWNER/ringattn")
_repo, _, _branch = REPO_URL.rstrip("/").partition("/tree/")
# Where a Colab copy of notebook NN_name lives in that repository (what ``make notebooks-ipynb``
# writes; the folder is git-ignored, so it must be published for the Colab button to open it).
COLAB_COPY = "notebooks/ipynb/{name}.ipynb"

html_theme = "sphinx_book_theme"
html_title = "ringattn"
html_theme_options = {
    "repository_url": _repo,
    "repository_branch": _branch or "main",
    "path_to_docs": "docs",
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "home_page_in_toc": False,  # the sidebar's title links home
    "navbar_persistent": [],  # the sidebar has the search field; no second one in a header bar
    "show_toc_level": 2,
}
html_context = {"default_mode": "auto"}  # light or dark as the reader's system says (unset: a console error)
html_favicon = "_static/favicon.svg"     # else every browser asks for /favicon.ico, a 404
# An object documented under two modules (ringattn_fast.masks re-exports ringattn_ref.masks) must not
# send the source page's [docs] links of one module to the other's anchors, which do not exist.
viewcode_follow_imported_members = False

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath", "deflist"]
myst_heading_anchors = 3

# --- notebook execution (override on the command line with -D nb_execution_mode=off) -------------
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 180            # per cell, seconds
nb_execution_in_temp = False          # run in the notebook's folder, like tests/test_notebooks.py
nb_kernel_rgx_aliases = {".*": "python3"}
nb_output_stderr = "show"

# --- API reference ---------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_mock_imports = []
napoleon_google_docstring = True
napoleon_numpy_docstring = True

nitpicky = False
# `name` in a docstring (single backticks) links to that object where it resolves, else shows as code;
# reST's own default would set it in italics.
default_role = "py:obj"


# --- docstrings: one convention, checked ---------------------------------------------------------------
# The library's docstrings are reStructuredText as napoleon reads it, so that the same text reads well
# in ``help()`` and renders here: prose with ``literal`` code and roles (:func:`x`); arguments and
# shapes as a bullet list, one argument per item (``- q: [batch, seq, heads, dim]``, continuation lines
# indented two spaces); notation tables as bullets too (``- Br, Bc: ...``); equations, diagrams and
# command lines as literal blocks after ``::``. An indented block without ``::`` (which reST makes a
# block quote, its lines run together) and any docutils warning are Sphinx warnings naming the
# docstring, so ``-W`` fails on them (tests/test_docs.py).
_IGNORED = ("interpreted text role", "directive type", "No role entry", "No directive entry")


def _rst_problems(text, env):
    import docutils.core
    import docutils.utils
    from docutils.parsers.rst import roles

    default = roles._roles.get("")  # docutils' parser drops the default role (Sphinx's default_role)
    try:
        doctree = docutils.core.publish_doctree(  # Sphinx's roles (:func: ...) need the env
            text, settings_overrides={"report_level": 5, "halt_level": 5, "warning_stream": False,
                                      "env": env})
    finally:
        if default is not None:
            roles._roles[""] = default
    messages = [m.astext() for m in doctree.findall(docutils.nodes.system_message)
                if m["level"] >= docutils.utils.Reporter.WARNING_LEVEL]
    problems = [m for m in messages if not any(key in m for key in _IGNORED)]
    problems += [f"an indented block without '::' (a block quote): {quote.astext()[:70]!r}"
                 for quote in doctree.findall(docutils.nodes.block_quote)]
    return [" ".join(problem.split()) for problem in problems]


def _check_docstring(app, what, name, obj, options, lines):
    import inspect

    from sphinx.util import logging

    owner = getattr(obj, "__module__", None) or ""
    if (inspect.isclass(obj) or inspect.isroutine(obj)) and not owner.startswith("ringattn"):
        return  # not ours (autosummary also scans imported names such as functools.partial)
    for problem in _rst_problems("\n".join(lines), app.env) if lines else []:
        logging.getLogger(__name__).warning("docstring of %s does not render: %s", name, problem)


# --- the notebook pages' download and Colab buttons -------------------------------------------------
@functools.cache
def _nb_tools():
    spec = importlib.util.spec_from_file_location("ringattn_nb_tools", ROOT / "notebooks" / "_tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    return tools


def _colab_copy(app, pagename, templatename, context, doctree):
    """On a course notebook's page: the download button's ``.ipynb`` is the Colab copy (install cell
    first, ``notebooks/_tools.py``), and the Colab button opens that copy in the repository.

    Runs after sphinx-book-theme's own buttons (priority 501), which would offer myst-nb's notebook
    without the install cell and open the ``.md`` source in Colab (Colab cannot read it).
    """
    src = ROOT / f"{pagename}.md"
    if not pagename.startswith("notebooks/") or not src.exists():
        return
    _nb_tools().to_ipynb(src, Path(app.outdir) / "_sources" / "notebooks")  # what download links to
    colab = f"{html_theme_options['launch_buttons']['colab_url']}/github/{_repo.split('github.com/')[-1]}"
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            if button.get("text") == "Colab":
                button["url"] = f"{colab}/blob/{html_theme_options['repository_branch']}/" + \
                    COLAB_COPY.format(name=src.stem)


def setup(app):
    app.connect("autodoc-process-docstring", _check_docstring, priority=900)  # after napoleon
    app.connect("html-page-context", _colab_copy, priority=502)
