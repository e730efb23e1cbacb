"""``ring_attention`` across 2 JAX processes x 4 CPU devices, started by ``scripts/launch_local.py``.

The slow test runs ``tests/_multiprocess_worker.py`` as processes 0 and 1 of one job (gloo
collectives over localhost) and checks the JSON line each prints: 8 devices, 4 of them local (not
the 8 that conftest's ``XLA_FLAGS`` asks for: the launcher removes that flag), both processes agree,
and the ring's forward and gradients match the float64 oracle. The fast tests check the launcher
itself: a failing process stops the others, and a timeout stops them all.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

import ringattn_fast as rf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py")]
TOL = 2e-5  # float32 vs the float64 oracle, relative to max(1, max |oracle|)


def launch(*args, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(LAUNCH + list(args), env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_ring_attention_on_two_processes_of_four_devices():
    start = time.monotonic()
    run = launch("--processes", "2", "--devices-per-process", "4", "--timeout", "240", "--",
                 sys.executable, os.path.join(ROOT, "tests", "_multiprocess_worker.py"), timeout=300)
    print(f"2 processes x 4 devices: {time.monotonic() - start:.1f} s")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    reports = {int(i): json.loads(line) for i, line in re.findall(r"^\[(\d+)\] (\{.*\})$", run.stdout, re.M)}
    assert sorted(reports) == [0, 1], run.stdout[-3000:]
    for i, report in reports.items():
        assert (report["process"], report["processes"], report["devices"], report["local_devices"]) == (i, 2, 8, 4)
    errors = reports[0]["errors"]
    assert reports[1]["errors"] == errors, "the processes gathered different results"
    cases = ("causal gqa contiguous", "causal segments zigzag", "causal data=2")
    want = {f"{case}/{what}" for case in cases for what in ("o", "dq", "dk", "dv")}
    want |= {"dot_product_attention/o"} if hasattr(rf, "dot_product_attention") else set()
    assert set(errors) == want, errors
    assert all(e <= TOL for e in errors.values()), errors
    print(json.dumps(errors))


def test_launcher_stops_the_others_when_one_fails():
    program = "import os, sys, time; pid = os.environ['JAX_PROCESS_ID']; print('hi from', pid, flush=True); " \
              "sys.exit(3) if pid == '1' else time.sleep(120)"
    start = time.monotonic()
    run = launch("--processes", "3", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == 3, run.stdout + run.stderr
    assert time.monotonic() - start < 30  # processes 0 and 2 were stopped, not waited for
    assert "[1] hi from 1" in run.stdout.splitlines(), run.stdout  # its output, prefixed with its id
    assert "[launch] process 1 exited with 3" in run.stdout, run.stdout


def test_launcher_timeout_stops_every_process():
    run = launch("--processes", "2", "--timeout", "1", "--", sys.executable, "-c", "import time; time.sleep(120)",
                 timeout=60)
    assert run.returncode == 124, run.stdout + run.stderr
    assert "timeout" in run.stdout
