#!/usr/bin/env bash
# The short run on the oldest supported pair: Python 3.11 + JAX 0.10.2 (scripts/oldest-constraints.txt),
# in its own venv ($VENV, default .venv-oldest/) and compilation cache (.jax_cache-oldest/).
# What runs: the quick suite (pytest -m "not slow"; extra arguments go to pytest) of the tests whose outcome
# can depend on the JAX version, on two workers (pytest-xdist), with the hypothesis profile "oldest" (a
# quarter of the examples: this run checks that each path works on that JAX; the properties' full counts
# run on the newest pair, in the same CI run). Left out, because nothing in them calls JAX: the float64
# reference's own tests (the numpy-only tests/test_ref_*.py below), the venv tooling (test_setup_venv) and
# the course's matplotlib figures (test_course_figures). What cannot run on that JAX skips inside the
# tests, each with its reason (tests/helpers.py: needs_fused_interpreter).
# Installed: the test, flax and demo (matplotlib, for the benchmark-report tests) extras; not the
# notebooks and docs extras (jupyter, sphinx): their tests (test_notebooks, test_exercises, test_docs)
# skip at import here (importorskip) and run in the full run on the newest pair (scripts/test.sh): the
# course's notebooks are executed once per CI run, which keeps this run to a few minutes.
# The Python: $PYTHON_OLDEST, else python3.11 on PATH, else a pyenv 3.11.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$here/.venv-oldest}
say() { echo "test-oldest: $*" >&2; }
is311() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' >/dev/null 2>&1; }

if [ ! -x "$venv/bin/python" ]; then
  py=
  for c in ${PYTHON_OLDEST:-} python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11.*/bin/python3 \
           /root/.pyenv/versions/3.11.*/bin/python3; do
    if p=$(command -v "$c" 2>/dev/null) && is311 "$p"; then py=$p; break; fi
  done
  [ -n "$py" ] || { say "no Python 3.11 found (PYTHON_OLDEST, python3.11 on PATH, pyenv 3.11.*)"; exit 1; }
  say "creating the venv $venv ($py)"
  "$py" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi
say "installing ringattn[test,flax,demo] with $(grep -v '^#' "$here/scripts/oldest-constraints.txt" | paste -sd' ' -)"
"$venv/bin/python" -m pip install -q -c "$here/scripts/oldest-constraints.txt" -e "$here[test,flax,demo]" >&2
"$venv/bin/python" -c 'import sys, jax; print(f"test-oldest: Python {sys.version.split()[0]}, jax {jax.__version__}")' >&2
cd "$here"
export RINGATTN_JAX_CACHE=${RINGATTN_JAX_CACHE:-$here/.jax_cache-oldest}
export RINGATTN_HYPOTHESIS_PROFILE=${RINGATTN_HYPOTHESIS_PROFILE:-oldest}
numpy_only="attention balance cost errors hybrid inference ring strategies"
ignore=(--ignore=tests/test_setup_venv.py --ignore=tests/test_course_figures.py)
for m in $numpy_only; do ignore+=("--ignore=tests/test_ref_$m.py"); done
exec "$venv/bin/python" -m pytest -m "not slow" -n "${RINGATTN_WORKERS:-2}" --dist loadfile "${ignore[@]}" "$@"
