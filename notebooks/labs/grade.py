"""Grade a lab: ``python notebooks/labs/grade.py lab01 path/to/solution.py``.

Exit status 0 and a ``PASS`` line when every property holds; otherwise a non-zero exit and one
``FAIL labNN: ...`` line naming what went wrong: the solution does not import, a function is missing,
raises, returns the wrong shape or dtype, a property fails on a drawn example (hypothesis strategies
of ``ringattn_ref.testing``, the float64 oracle ``ringattn_ref.attention``), or the grade ran past
the lab's time limit. The lines before it say which properties passed.

The grader never hangs: the solution runs in a child process (this file with ``--child``) with 8
simulated CPU devices set before JAX is imported, killed at the time limit (``--time-limit`` to
change it). Exit codes: 0 pass, 1 fail, 2 bad command line, 3 time limit, 4 the child died.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# lab -> (skeleton file, time limit in seconds on a loaded 2-core machine, JAX: None (numpy only),
# "x64" (the ring labs compare float64 with the float64 oracle) or "x32" (the Pallas lab: float32))
LABS = {
    "lab01": ("lab01_online_softmax.py", 60, None),
    "lab02": ("lab02_ring_step.py", 60, None),
    "lab03": ("lab03_zigzag.py", 150, "x64"),
    "lab04": ("lab04_bidirectional_ring.py", 150, "x64"),
    "lab05": ("lab05_pallas_hop.py", 180, "x32"),
}


def _lab_name(text):
    """'lab01', '01' or '1' -> 'lab01' (None if no such lab)."""
    digits = text.lower().removeprefix("lab")
    name = f"lab{int(digits):02d}" if digits.isdigit() else None
    return name if name in LABS else None


def _child(lab, path):
    """In the child process: set up JAX, import the solution, run the lab's checks, print a verdict.

    The verdict line starts with a one-time token the parent sends on stdin (read before the solution
    is imported), so a solution that prints its own "PASS" line does not pass.
    """
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if LABS[lab][2]:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_enable_x64", LABS[lab][2] == "x64")
    sys.path[:0] = [str(HERE), str(ROOT)]
    from _grader.common import Fail, Solution, one_line

    try:
        try:
            spec = importlib.util.spec_from_file_location("solution", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, an error at import time ...
            raise Fail(f"cannot import {os.path.basename(path)}: {type(e).__name__}: {one_line(e, 300)}") from None
        passed = importlib.import_module(f"_grader.{lab}").check(Solution(module, path))
    except Fail as e:
        print(f"{token} FAIL {lab}: {e}", flush=True)
        return 1
    print(f"{token} PASS {lab}: {passed}", flush=True)
    return 0


def _untokened(out, token):
    """The child's output as the student sees it: the verdict's token removed, a look-alike marked."""
    lines = []
    for line in out.splitlines(keepends=True):
        if line.startswith(token + " "):
            lines.append(line[len(token) + 1:])
        elif line.startswith(("PASS", "FAIL")):
            lines.append("(printed by the solution) " + line)
        else:
            lines.append(line)
    return "".join(lines)


def _run(lab, path, limit):
    """The parent: run the child with a time limit; print its lines and the verdict; the exit code."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "notebooks"), os.environ.get("PYTHONPATH")])))
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"]))
    token = secrets.token_hex(16)
    child = subprocess.Popen([sys.executable, __file__, "--child", lab, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        out, err = child.communicate(token + "\n", timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the child and anything it started
        except ProcessLookupError:  # it ended just now
            pass
        out, _ = child.communicate()
        print(_untokened(out, token), end="")
        print(f"FAIL {lab}: TIMEOUT: the grade ran past the lab's time limit of {limit:g} s and was stopped "
              f"(an endless loop, or far too slow?)", flush=True)
        return 3
    verdict = [line for line in out.splitlines() if line.startswith((f"{token} PASS {lab}", f"{token} FAIL {lab}"))]
    print(_untokened(out, token), end="")
    if child.returncode in (0, 1) and verdict:
        return 0 if verdict[-1].startswith(f"{token} PASS") and child.returncode == 0 else 1
    last = (err.strip().splitlines() or ["(no output)"])[-1]
    print(f"FAIL {lab}: the grading process died without a verdict (exit code {child.returncode}): {last[:300]}",
          flush=True)
    return 4


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lab", help="lab01 ... lab05")
    parser.add_argument("solution", help="your solution file (start from notebooks/labs/labNN_*.py)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds (default: the lab's own)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lab = _lab_name(args.lab)
    if lab is None:
        print(f"FAIL: no lab {args.lab!r}; the labs are {', '.join(LABS)}", flush=True)
        return 2
    if args.child:
        return _child(lab, args.solution)
    path = Path(args.solution)
    if not path.is_file():
        print(f"FAIL {lab}: no file {args.solution!r} (start from notebooks/labs/{LABS[lab][0]})", flush=True)
        return 2
    return _run(lab, path.resolve(), LABS[lab][1] if args.time_limit is None else args.time_limit)


if __name__ == "__main__":
    sys.exit(main())
