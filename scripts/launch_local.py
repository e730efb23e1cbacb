"""Run one program as N JAX processes on this machine: a local stand-in for a cluster launcher.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        python tests/_multiprocess_worker.py

starts the command twice, as process 0 and process 1 of one JAX job with 2 x 4 = 8 CPU devices, the
way ``srun`` starts one task per GPU on a SLURM cluster or a TPU pod slice runs the same program on
every host (``docs/distributed.md``). Each process gets, in its environment:

  ``JAX_COORDINATOR_ADDRESS``  ``localhost:PORT``, a free port; ``jax.distributed.initialize`` reads it
  ``JAX_NUM_PROCESSES``        N       } the program passes these two itself: JAX does not read them,
  ``JAX_PROCESS_ID``           0..N-1  } ``initialize(num_processes=..., process_id=...)``
  ``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=K``, ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``
                               with ``--devices-per-process K``: K simulated CPU devices, and
                               collectives between processes over TCP (gloo). Any
                               ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (the
                               test suite's conftest sets 8) is removed, so K is what each sees.

so the program starts with::

    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))

The output of process i is streamed line by line, prefixed ``[i] ``. When one process fails (exits
non-zero), the others are stopped (a process waiting in a collective for a dead peer would otherwise
hang until JAX's heartbeat timeout), and so are all of them after ``--timeout`` seconds. Exit code: 0
when every process exited 0, else the first failure's code (128 + N if it died by signal N), 124 on timeout
(as ``timeout(1)``).

A script, not ``ringattn_fast.distributed``: it knows nothing about ring attention, on a real cluster
the cluster's own launcher (``srun``, ``mpirun``, the TPU VM's ``--worker=all``) does this job, and
tools stay outside the library (``benchmarks/`` is the precedent). Standard library only.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TIMEOUT_EXIT = 124  # what timeout(1) returns
GRACE_S = 5  # SIGTERM, then SIGKILL after this long


def free_port():
    """A TCP port nobody listens on now (the OS picks it; a race with another program is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_env(base, *, port, n, i, devices):
    """The environment of process ``i`` of ``n`` (see the module docstring)."""
    env = dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    return env


def stream(proc, prefix, lock):
    """Copy ``proc``'s output to our stdout, line by line, each prefixed (a thread per process)."""
    for line in iter(proc.stdout.readline, b""):
        with lock:
            sys.stdout.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            sys.stdout.buffer.flush()


def stop(procs):
    """SIGTERM to every process still running (its whole group: it may have children), then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            try:
                os.killpg(p.pid, sig)  # the group of a process we started (start_new_session=True)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = [p for p in running if p.poll() is None]
        if not running:
            return


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through launch's finally: the processes are stopped


def launch(command, *, processes, devices_per_process=None, timeout=None, env=None):
    """Run ``command`` (a list) as ``processes`` JAX processes; return the exit code (module docstring)."""
    port, lock = free_port(), threading.Lock()
    base = os.environ if env is None else env
    procs, threads, code = [], [], 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a job scheduler's cancel stops the processes too
    try:
        for i in range(processes):
            procs.append(subprocess.Popen(command, env=process_env(base, port=port, n=processes, i=i,
                                                                   devices=devices_per_process),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
            threads.append(threading.Thread(target=stream, args=(procs[-1], f"[{i}] ".encode(), lock), daemon=True))
            threads[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while None in [p.poll() for p in procs]:  # a list, not any(): poll every process each time
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                code = procs[failed[0]].returncode
                with lock:
                    print(f"[launch] process {failed[0]} exited with {code}; stopping the others", flush=True)
                break
            if deadline is not None and time.monotonic() > deadline:
                code = TIMEOUT_EXIT
                with lock:
                    print(f"[launch] timeout after {timeout} s; stopping every process", flush=True)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130  # the shell's code for Ctrl-C
    except SystemExit as e:
        code = e.code
    finally:
        stop(procs)
        for t in threads:
            t.join(timeout=GRACE_S)
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return code if code >= 0 else 128 - code  # died by signal N: 128 + N, as a shell reports it


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --processes N [--devices-per-process K] [--timeout S] "
                                           "-- COMMAND ...")
    parser.add_argument("--processes", "-n", type=int, required=True, help="number of JAX processes to start")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices per process (sets JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES, gloo "
                             "collectives); without it the platform is left as the environment has it")
    parser.add_argument("--timeout", type=float, default=None, help="stop every process after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each process runs, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python tests/_multiprocess_worker.py")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1; got {args.processes}")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1; got {args.devices_per_process}")
    return launch(command, processes=args.processes, devices_per_process=args.devices_per_process,
                  timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
