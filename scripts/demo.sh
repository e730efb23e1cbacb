#!/usr/bin/env bash
# Install the project into .venv and run the demo: the ring simulation on 8 virtual hosts.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
py=$("$here/scripts/setup-venv" notebooks)
cd "$here"
exec "$py" -m ringattn_ref.demo "$@"
