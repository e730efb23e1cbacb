#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k ring -x). The tests run on several workers
# (pytest-xdist, one test file per worker so that module fixtures and compiles stay together): as many as
# there are cores, at most 4 (each worker holds its own compiled programs); RINGATTN_WORKERS=N sets it,
# RINGATTN_WORKERS=0 runs in this process (pdb, -s).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
py=$("$here/scripts/setup-venv" test,notebooks,docs,flax,train)
# libtpu beside the venv, for the deviceless TPU compile tests (tests/test_compile.py); a failed
# install (no network) leaves those tests to skip, or to fail where RINGATTN_REQUIRE_LIBTPU=1 (CI)
"$here/scripts/setup-libtpu" "$py" >/dev/null || echo "test.sh: libtpu not installed; tests/test_compile.py will skip" >&2
# JAX's CUDA plugin beside the venv, for the deviceless GPU compiles of the overlap check
# (tests/test_overlap.py: 8 H100s, 8 A100s); without it those tests skip, or fail where
# RINGATTN_REQUIRE_CUDA_PLUGIN=1 (CI)
"$here/scripts/setup-cuda-plugin" "$py" >/dev/null || echo "test.sh: CUDA plugin not installed; the GPU overlap tests will skip" >&2
cd "$here"
workers=${RINGATTN_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); echo $(( n < 4 ? n : 4 )))}
exec "$py" -m pytest -n "$workers" --dist loadfile "$@"
