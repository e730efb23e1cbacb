# ringattn: notebooks and docs. The README's two commands (scripts/demo.sh, scripts/test.sh) need no make.
#
#   make notebooks-ipynb   .ipynb copies of the course for Colab -> notebooks/ipynb/ (git-ignored)
#   make docs              the site, every notebook executed, warnings are errors -> docs/_build/html
#   make jupyter           Jupyter Lab on notebooks/ (the .md files open as notebooks via jupytext)
#
# PYTHON defaults to the project's .venv, created/updated by scripts/setup-venv with the extras the
# target needs; pass PYTHON=/path/to/python to use an environment that already has them.

SETUP = scripts/setup-venv

.PHONY: help notebooks-ipynb docs jupyter clean-docs

help:
	@sed -n '3,6p' Makefile

notebooks-ipynb:
	$(or $(PYTHON),$(shell $(SETUP) notebooks)) notebooks/_tools.py ipynb notebooks/ipynb

docs:
	$(or $(PYTHON),$(shell $(SETUP) docs,notebooks)) -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

# notebooks/jupytext.toml pairs each .md with a git-ignored .ipynb that keeps your outputs locally.
jupyter:
	$(or $(PYTHON),$(shell $(SETUP) notebooks)) -m jupyter lab --ServerApp.root_dir=notebooks

clean-docs:
	rm -rf docs/_build docs/jupyter_execute docs/_autosummary/*.rst
