#!/usr/bin/env bash
# Install the project with its test extras into .venv and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k ring -x).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
py=$("$here/scripts/setup-venv" test,notebooks,docs,flax,train)
cd "$here"
exec "$py" -m pytest "$@"
