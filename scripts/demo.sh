#!/usr/bin/env bash
# Install what the demo needs into .venv (or $VENV) and run it: the ring simulation on 8 virtual hosts.
# The demo (examples/demo.py) imports ringattn_ref, numpy and matplotlib only, so the project goes in
# without its dependencies (no jax) plus the "demo" extra; a second run installs nothing.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
py=$("$here/scripts/setup-venv" --no-deps demo)
cd "$here"
echo "demo: python -m examples.demo${*:+ $*}" >&2
exec "$py" -m examples.demo "$@"
