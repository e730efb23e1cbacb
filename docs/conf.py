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
"""
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
copyright = "2025, ringattn contributors"
release = "0.1.0"

extensions = [
    "myst_nb",                   # MyST markdown + executable notebooks (also provides myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = [
    "_build", "jupyter_execute", "Thumbs.db", ".DS_Store",
    "notebooks/ipynb", "notebooks/README.md", "notebooks/**/.ipynb_checkpoints",
]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["dropdown.css"]
html_theme = "alabaster"
html_title = "ringattn"
html_theme_options = {
    "description": "Ring Attention from the paper to a fused kernel",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "230px",
}

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


# --- docstrings that are not valid reStructuredText ---------------------------------------------------
# The library's docstrings are written to be read as plain text (shapes, aligned continuation lines,
# equations in indented blocks). Most of them are also valid reST; a docstring that is not would make
# ``-W`` fail on layout that reads fine in ``help()``. Such a docstring is shown verbatim (a literal
# block) instead, and listed at the end of the build (``-v`` shows which), so the site never breaks on
# a docstring's indentation while errors in the site's own pages still fail the build.
_VERBATIM = []
_IGNORED = ("interpreted text role", "directive type", "No role entry", "No directive entry")


def _rst_problems(text, env):
    import docutils.core
    import docutils.utils

    doctree = docutils.core.publish_doctree(  # Sphinx's roles (:func: ...) need the env
        text, settings_overrides={"report_level": 5, "halt_level": 5, "warning_stream": False,
                                  "env": env})
    messages = [m for m in doctree.findall(docutils.nodes.system_message)
                if m["level"] >= docutils.utils.Reporter.WARNING_LEVEL]
    return [m.astext() for m in messages if not any(key in m.astext() for key in _IGNORED)]


def _verbatim_if_not_rst(app, what, name, obj, options, lines):
    if lines and _rst_problems("\n".join(lines), app.env):
        _VERBATIM.append(name)
        lines[:] = ["::", ""] + ["    " + line for line in lines] + [""]


def _report_verbatim(app, exception):
    from sphinx.util import logging

    if _VERBATIM:
        logging.getLogger(__name__).info(
            "docstrings shown verbatim (not valid reST): %s", ", ".join(sorted(set(_VERBATIM))))


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim_if_not_rst, priority=900)  # after napoleon
    app.connect("build-finished", _report_verbatim)
