"""One process of a job in which one process fails after a warm-up ring, for tests/test_multiprocess.py.

    python scripts/launch_local.py --processes 2 --devices-per-process 2 -- \\
        python tests/_multiprocess_fault_worker.py --fault raise --rank 1

Every process joins the job, runs one tiny ``ring_attention`` over the devices of all processes (the
warm-up: every process is past ``initialize`` and its collectives work), then process ``--rank``
does ``--fault``:

  ``raise``  an uncaught exception           ``exit0``  ``sys.exit(0)``: a clean exit, too early
  ``kill``   ``os._exit(9)``: a hard death, as when a host dies (no traceback, no JAX shutdown)
  ``late``   runs the second ring too, then sleeps ``LATE_S`` before leaving: a normal end, exit 0
  ``none``   nothing: the control

and the others run the ring again, whose first ``ppermute`` waits for the peer that is gone.
``--at`` moves the fault: ``before`` the warm-up ring (the others wait in their first collective),
``between`` the two rings (the default, above), or ``after`` both (the others have finished and
leave normally: the job must still fail).
``--no-report`` leaves out the exit file (``tests/_multiprocess_job.py``), as an unmodified program
does; ``--heartbeat-timeout`` and ``--shutdown-timeout`` go to ``jax.distributed.initialize``
(default: the workers' values in ``_multiprocess_job``), to measure what JAX alone does.
"""
import argparse
import os
import sys
import time

import jax

import _multiprocess_job as job

parser = argparse.ArgumentParser()
parser.add_argument("--fault", choices=("raise", "exit0", "kill", "late", "none"), required=True)
parser.add_argument("--at", choices=("before", "between", "after"), default="between",
                    help="when the fault happens: before, between or after the collectives")
parser.add_argument("--rank", type=int, default=1, help="the process that fails")
parser.add_argument("--no-report", action="store_true", help="do not write $LAUNCH_LOCAL_EXIT_FILE")
parser.add_argument("--heartbeat-timeout", type=int, default=job.HEARTBEAT_S)
parser.add_argument("--shutdown-timeout", type=int, default=job.SHUTDOWN_S)
args = parser.parse_args()
job.initialize(heartbeat_timeout_seconds=args.heartbeat_timeout, shutdown_timeout_seconds=args.shutdown_timeout)

import numpy as np  # noqa: E402

import ringattn_fast as rf  # noqa: E402

B, S, H, D = 1, 16, 2, 8  # [batch, seq, heads, dim]: tiny, the job is the point
LATE_S = 3.0  # --fault late: well inside the launcher's default --exit-grace


def fault(me):
    """Do ``--fault`` if this is process ``--rank`` (a fault that returns: ``late``, ``none``)."""
    if me != args.rank or args.fault not in ("raise", "exit0", "kill"):
        return
    print(f"process {me}: fault at {time.time():.3f}", flush=True)  # the test times failure -> launcher exit
    if args.fault == "raise":
        raise RuntimeError(f"process {me}: injected failure {args.at} the collectives")
    if args.fault == "exit0":
        print(f"process {me}: leaving early with exit code 0", flush=True)
        sys.exit(0)
    os._exit(9)  # no atexit, no JAX shutdown: like a host that dies


def main():
    me = jax.process_index()
    mesh = rf.make_mesh()  # every device of every process: the ring crosses processes
    sharding = jax.NamedSharding(mesh, jax.P(None, "sp"))
    x = np.random.default_rng(0).standard_normal((B, S, H, D)).astype(np.float32)
    q = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    ring = jax.jit(lambda q: rf.ring_attention(q, q, q, mesh=mesh, causal=True))
    if args.at == "before":
        fault(me)
    jax.block_until_ready(ring(q))
    print(f"process {me}: warm-up ring done", flush=True)
    if args.at == "between":
        fault(me)
    jax.block_until_ready(ring(q))  # hangs here, waiting for the peer that is gone, unless it is still here
    print(f"process {me}: second ring done", flush=True)
    if args.at == "after":
        fault(me)
    if me == args.rank and args.fault == "late":
        time.sleep(LATE_S)  # leaves the program later than the others: a normal end all the same
    return 0


if __name__ == "__main__":
    sys.exit(main()) if args.no_report else job.run(main)
