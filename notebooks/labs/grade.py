"""Grade a lab: ``python notebooks/labs/grade.py lab01 path/to/solution.py``.

Exit status 0 and a ``PASS`` line when every property holds; otherwise a non-zero exit and one
``FAIL labNN: ...`` line naming what went wrong: the solution does not import, a function is missing,
raises, returns the wrong shape or dtype, calls the library's answer, a property fails on an example
(fixed ones and hypothesis draws of ``ringattn_ref.testing``, against the float64 oracle), or the
solution ran past the lab's time limit. The lines before it say which properties passed.

This process (the parent) never imports the solution. It writes the inputs to a temporary directory,
runs the solution in a child process (this file with ``--child``; 8 simulated CPU devices set before
JAX is imported, killed at the time limit: ``--time-limit``), reads back the child's arrays and
exported programs, compiles and runs those itself and decides (threat model: ``_grader/common.py``).
Exit codes: 0 pass, 1 fail, 2 bad command line, 3 time limit, 4 the child died without results.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# lab -> (skeleton file, time limit of the child in seconds on a loaded 2-core machine, JAX: None
# (numpy only), "x64" (float64 against the float64 oracle) or "x32" (the Pallas lab: float32))
LABS = {
    "lab01": ("lab01_online_softmax.py", 60, None),
    "lab02": ("lab02_ring_step.py", 60, None),
    "lab03": ("lab03_zigzag.py", 120, "x64"),
    "lab04": ("lab04_bidirectional_ring.py", 120, "x64"),
    "lab05": ("lab05_pallas_hop.py", 150, "x32"),
    "lab06": ("lab06_ring_backward.py", 120, "x64"),
    "lab07": ("lab07_decode.py", 120, "x64"),
    "lab08": ("lab08_strategy.py", 120, "x32"),
    "lab09": ("lab09_programmable_mask.py", 60, None),
}


def _lab_name(text):
    """'lab01', '01' or '1' -> 'lab01' (None if no such lab)."""
    digits = text.lower().removeprefix("lab")
    name = f"lab{int(digits):02d}" if digits.isdigit() else None
    return name if name in LABS else None


def _setup_jax(lab):
    """8 CPU devices and the lab's float mode, before anything imports JAX."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if LABS[lab][2]:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_enable_x64", LABS[lab][2] == "x64")
    sys.path[:0] = [str(HERE), str(ROOT)]


def _child(lab, workdir, path):
    """In the child process: run the solution on the parent's tasks (``_grader/child.py``)."""
    _setup_jax(lab)
    from _grader import child

    return child.main(lab, workdir, path)


def _forward(out):
    """The child's output as the student sees it: every line marked as the solution's."""
    for line in out.splitlines()[-200:]:
        print(f"| {line}"[:1000])


def _run_child(lab, path, workdir, limit):
    """Run the child with a time limit; returns (exit code or None on timeout, last stderr line)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "notebooks"), os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, __file__, "--child", lab, str(path), "--workdir", workdir],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True, cwd=workdir)
    try:
        out, err = child.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the child and anything it started
        except ProcessLookupError:  # it ended just now
            pass
        out, err = child.communicate()
        _forward(out)
        return None, ""
    _forward(out)
    return child.returncode, ((err or "").strip().splitlines() or ["(no output)"])[-1]


def grade(lab, path, limit):
    """The parent: plan the tasks, run the child, check its results; prints the verdict, returns the exit code."""
    _setup_jax(lab)
    from _grader.common import Died, Fail, Results, Tasks
    from _grader.source import check_source

    start = time.perf_counter()
    try:
        if os.environ.get("_RINGATTN_GRADER_TEST_SKIP_SOURCE_CHECK") != "1":  # tests/test_labs.py only: shows
            check_source(path)  # that the parent/child split alone stops a solution that patches the grader
        grader = importlib.import_module(f"_grader.{lab}")
        tasks = Tasks()
        verify = grader.build(tasks)
        with tempfile.TemporaryDirectory(prefix=f"grade-{lab}-") as workdir:
            tasks.write(workdir)
            status, last = _run_child(lab, path, workdir, limit)
            if status is None:
                print(f"FAIL {lab}: TIMEOUT: the solution ran past the lab's time limit of {limit:g} s and was "
                      f"stopped (an endless loop, or far too slow?)", flush=True)
                return 3
            results = Results(workdir, tasks, status)
            try:
                passed = verify(results)
            except Died:
                print(f"FAIL {lab}: the grading process died without a verdict (exit code {status}): {last[:300]}",
                      flush=True)
                return 4
    except Fail as e:
        print(f"FAIL {lab}: {e}", flush=True)
        return 1
    print(f"PASS {lab}: {passed} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lab", help="lab01 ... lab08")
    parser.add_argument("solution", help="your solution file (start from notebooks/labs/labNN_*.py)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds (default: the lab's own)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lab = _lab_name(args.lab)
    if lab is None:
        print(f"FAIL: no lab {args.lab!r}; the labs are {', '.join(LABS)}", flush=True)
        return 2
    if args.child:
        return _child(lab, args.workdir, args.solution)
    path = Path(args.solution)
    if not path.is_file():
        print(f"FAIL {lab}: no file {args.solution!r} (start from notebooks/labs/{LABS[lab][0]})", flush=True)
        return 2
    return grade(lab, path.resolve(), LABS[lab][1] if args.time_limit is None else args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
