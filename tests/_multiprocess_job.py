"""How the multi-process workers join a JAX job and leave it, so that a failed process ends the job.

    import _multiprocess_job as job
    job.initialize()    # jax.distributed.initialize with the timeouts below, first thing
    ...
    if __name__ == "__main__":
        job.run(main)   # instead of sys.exit(main())

Two layers end a job in which one process has failed (``docs/distributed.md``, "When a process
fails"):

* **JAX itself**, with no launcher watching (SLURM, a TPU pod): a process that stops heartbeating
  (killed, host lost) is declared dead after ``heartbeat_timeout_seconds`` and every process aborts;
  a process that leaves the program (an exception, an early ``sys.exit``) waits at exit in JAX's
  shutdown barrier, and after ``shutdown_timeout_seconds`` without the others every process aborts.
  JAX's defaults are 100 s and 300 s; the workers pass ``HEARTBEAT_S`` and ``SHUTDOWN_S``. The CPU
  collectives (gloo) have their own timeout, 30 minutes, fixed inside XLA.
* **The launcher** (``scripts/launch_local.py``), faster: that waiting process is alive, so from
  outside it looks like one still working. ``run`` tells the launcher it has left: it writes the exit
  code to ``$LAUNCH_LOCAL_EXIT_FILE`` (after the traceback of an exception is printed), and the
  launcher stops the job at once on a non-zero code, ``--exit-grace`` seconds after a 0 if the
  others are still inside the program.
"""
import os
import sys
import time
import traceback

import jax

INIT_S = 120  # every process must have joined by then (a process that never starts fails the job)
HEARTBEAT_S = 30  # a process silent this long is dead: every process aborts
SHUTDOWN_S = 30  # a process that left waits this long at exit for the others, then every process aborts


def initialize(**overrides):
    """``jax.distributed.initialize`` from the launcher's environment, with the timeouts above."""
    kw = dict(initialization_timeout=INIT_S, heartbeat_timeout_seconds=HEARTBEAT_S,
              shutdown_timeout_seconds=SHUTDOWN_S) | overrides
    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]), **kw)


def report(code):
    """Write ``code`` (an int) and the time to ``$LAUNCH_LOCAL_EXIT_FILE`` in one step (the launcher polls
    the file and orders failures by that time: two files' mtimes can tie, on the kernel's coarse clock)."""
    path = os.environ.get("LAUNCH_LOCAL_EXIT_FILE")
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(f"{code} {time.time():.6f}\n")
        os.replace(path + ".tmp", path)  # the launcher never reads half a file


def run(main):
    """``sys.exit(main())``, telling the launcher the exit code first; an exception prints its traceback, exits 1."""
    try:
        status = main()
    except SystemExit as e:
        status = e.code
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt too: every way out is reported
        traceback.print_exc()
        status = 1
    if status is not None and not isinstance(status, int):
        print(status, file=sys.stderr)  # what sys.exit("text") does: print it, exit 1
        status = 1
    sys.stdout.flush(), sys.stderr.flush()  # every line is out before the launcher may stop us
    report(status or 0)
    sys.exit(status)
