"""Loaded into every Python process ``scripts/launch_local.py`` starts: tells the launcher when it leaves.

The launcher puts this folder first on ``PYTHONPATH``; Python imports ``sitecustomize`` at start-up
(``site``), before the program. Why: a JAX process that leaves the program is not gone. JAX's
``atexit`` handler (registered when ``jax`` is imported) waits in the distributed shutdown barrier
for every other process, up to ``shutdown_timeout_seconds`` (300 s by default), and a peer blocked
in a collective for it never gets there: from outside, the leaver looks like a process still working,
and the job hangs. So, in a program that does nothing special:

* an **uncaught exception** prints its traceback as usual (the previous ``sys.excepthook``), writes
  1 to ``$LAUNCH_LOCAL_EXIT_FILE`` and hard-exits with 1 (``os._exit``): no shutdown barrier, so the
  launcher sees the exit at once and stops the job;
* a **non-zero** ``sys.exit(n)`` does the same with ``n`` (``n`` is remembered by wrapping
  ``sys.exit``; a bare ``raise SystemExit(n)`` is not seen and counts as a normal end below);
* a **normal end** (return, ``sys.exit(0)``) writes 0 to the exit file and goes on into JAX's
  shutdown as usual: the launcher then gives the others ``--exit-grace`` seconds to leave too.

This runs before ``atexit`` handlers (``threading``'s exit callbacks run first in
``Py_FinalizeEx``), so before JAX's barrier. A program that already wrote the exit file (the
tests' ``_multiprocess_job.run``) keeps its code. Not loaded by ``python -I`` / ``-E`` / ``-S``,
nor with ``LAUNCH_LOCAL_HOOK=off`` in the environment (to see what JAX alone does); non-Python
commands get only the launcher's exit watching. A shell or ``timeout`` in front of Python is fine:
the first Python process of the command reports, and the Python processes it starts do not. Any
other ``sitecustomize`` on the path still runs (imported after this one).
"""
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import traceback

# Only the first Python process of the launched command speaks for it: one it starts (a helper script, a
# multiprocessing spawn) inherits the environment, and its end must not read as the program's.
_FILE = os.environ.get("LAUNCH_LOCAL_EXIT_FILE")
if os.environ.get("LAUNCH_LOCAL_HOOK") == "off" or os.environ.get("LAUNCH_LOCAL_HOOKED"):
    _FILE = None
else:
    os.environ["LAUNCH_LOCAL_HOOKED"] = str(os.getpid())
_PID = os.getpid()  # a fork inherits the hooks below; they act in this process only
_requested = [0]  # the last code given to sys.exit


def _report(code):
    """Write ``code`` to the exit file in one step, unless the program wrote one itself."""
    if _FILE and not os.path.exists(_FILE):
        with open(_FILE + ".tmp", "w") as f:
            f.write(f"{code} {time.time():.6f}\n")  # the time orders failures (file mtimes tie)
        os.replace(_FILE + ".tmp", _FILE)


def _leave_now(code):
    """Flush, report ``code``, exit without Python's shutdown (and so without JAX's barrier)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep us from leaving
            pass
    _report(code)
    os._exit(code)


def _excepthook(kind, value, tb, _previous=sys.excepthook):
    try:
        _previous(kind, value, tb)
    except Exception:  # noqa: BLE001 - the traceback is printed one way or the other
        traceback.print_exception(kind, value, tb)
    if os.getpid() == _PID:
        _leave_now(1)


def _exit(status=None, _previous=sys.exit):
    if threading.current_thread() is threading.main_thread():  # elsewhere it ends only that thread
        _requested[0] = status
    _previous(status)


def _at_exit():
    if os.getpid() != _PID:
        return
    status = _requested[0]
    if status is None or status == 0:
        _report(0)
        return  # a normal end: into JAX's shutdown barrier with the others
    if not isinstance(status, int):  # sys.exit("text"): Python prints it and exits 1
        print(status, file=sys.stderr)
        status = 1
    _leave_now(status % 256)


def _chain():
    """Run the ``sitecustomize`` this one shadows, if there is one further along the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if _FILE:
    sys.excepthook = _excepthook
    sys.exit = _exit
    threading._register_atexit(_at_exit)  # noqa: SLF001 - the one hook that runs before atexit's
_chain()
