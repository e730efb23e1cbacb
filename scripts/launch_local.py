"""Run one program as N JAX processes on this machine: a local stand-in for a cluster launcher.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        python tests/_multiprocess_worker.py

starts the command twice, as process 0 and process 1 of one JAX job with 2 x 4 = 8 CPU devices, the
way ``srun`` starts one task per GPU on a SLURM cluster or a TPU pod slice runs the same program on
every host (``docs/distributed.md``). Each process gets, in its environment:

  ``JAX_COORDINATOR_ADDRESS``  ``localhost:PORT``, a free port; ``jax.distributed.initialize`` reads it
  ``JAX_NUM_PROCESSES``        N       } the program passes these two itself: JAX does not read them,
  ``JAX_PROCESS_ID``           0..N-1  } ``initialize(num_processes=..., process_id=...)``
  ``LAUNCH_LOCAL_EXIT_FILE``   a file the program may write its exit code to when it leaves (below)
  ``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=K``, ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``
                               with ``--devices-per-process K``: K simulated CPU devices, and
                               collectives between processes over TCP (gloo). Any
                               ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (the
                               test suite's conftest sets 8) is removed, so K is what each sees.

so the program starts with::

    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))

Process i's stdout and stderr are streamed line by line to ours, prefixed ``[i] ``. A process has
*left* the program when it exits, or when it writes its exit code (an integer, optionally followed by
a space and ``time.time()``, which orders failures better than the file's mtime) to
``LAUNCH_LOCAL_EXIT_FILE``: a JAX process that returns from its program is still alive, held in
JAX's shutdown barrier until every process gets there (``shutdown_timeout_seconds``, 300 s by
default), so only the program can say it has finished. A Python program says it without any change:
the launcher puts ``scripts/launch_local_hook`` first on ``PYTHONPATH``, whose ``sitecustomize``
writes the file when the program ends, and on an uncaught exception or a non-zero ``sys.exit``
prints the traceback and hard-exits, skipping the barrier (its docstring says how). The job
fails fast (every process is stopped: SIGTERM, then SIGKILL after ``KILL_GRACE_S``) when

  * a process leaves with a non-zero code: at once, exit code = that code (128 + N for signal N);
  * a process leaves with 0 and others are still inside the program ``--exit-grace`` seconds
    later (a peer waiting in a collective for it would wait forever): exit code 1;
  * ``--timeout`` seconds have passed: exit code 124 (as ``timeout(1)``).

and the launcher names the process and prints the last lines of its stderr. Processes that leave
with 0 within the grace of each other (the normal end of a job) exit 0.

A script, not ``ringattn_fast.distributed``: it knows nothing about ring attention, on a real cluster
the cluster's own launcher (``srun``, ``mpirun``, the TPU VM's ``--worker=all``) does this job, and
tools stay outside the library (``benchmarks/`` is the precedent). Standard library only.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

TIMEOUT_EXIT = 124  # what timeout(1) returns
EARLY_EXIT = 1  # a process left with 0 while others were still inside the program
KILL_GRACE_S = 5  # SIGTERM, then SIGKILL after this long (JAX's preemption notifier catches SIGTERM)
EXIT_GRACE_S = 10.0  # default --exit-grace
SETTLE_S = 0.2  # after the first failure is seen, the others of the same moment are waited for this long
TAIL_LINES = 20  # stderr lines kept per process, printed for the one that failed
EXIT_FILE = "LAUNCH_LOCAL_EXIT_FILE"
HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_local_hook")  # its sitecustomize.py


def free_port():
    """A TCP port nobody listens on now (the OS picks it; a race with another program is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_env(base, *, port, n, i, devices, exit_file=None):
    """The environment of process ``i`` of ``n`` (see the module docstring)."""
    env = dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
    if exit_file is not None:  # and the hook that writes it for a Python program that does not
        env[EXIT_FILE] = exit_file
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [HOOK, env.get("PYTHONPATH")]))
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    return env


def _written_at(when, path):
    """When an exit file was written: the time the program put after its code, else the file's mtime (which
    can tie between two processes that fail within a tick of the kernel's coarse clock)."""
    try:
        return float(when)
    except ValueError:
        return os.stat(path).st_mtime


class Child:
    """One process: its Popen, the tail of its stderr, and when and with what code it left the program.

    Times are wall-clock (``time.time()``): the moment an exit file was written (the time in it, or its
    mtime: set by the process itself) or the process exited (seen by a thread of its own waiting for it)."""

    def __init__(self, i, proc, exit_file):
        self.i, self.proc, self.exit_file = i, proc, exit_file
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.code = self.left_at = None  # set once it has left; the process's own exit code overrides the file's
        self.exited, self.reported, self.exit_time = False, False, None

    def wait(self):
        """Wait for the exit (in a thread) and note when, closer than a poll would."""
        self.proc.wait()
        self.exit_time = time.time()

    def update(self):
        """Note an exit file written, or an exit, since the last call. The file is read first, also when the
        exit is seen at the same poll: its time, not our waiting thread's (which may wake late on a busy
        host), orders the failures (CI blamed process 0 when both exits were seen before either file)."""
        if self.code is None and os.path.exists(self.exit_file):
            with open(self.exit_file) as f:
                text = f.read().strip()
            if text:  # empty: being written, read it next time
                code, _, when = text.partition(" ")
                self.code = int(code) % 256 if code.lstrip("-").isdigit() else 1  # what the OS would make of it
                self.reported, self.left_at = True, _written_at(when, self.exit_file)
        if self.exit_time is not None and not self.exited:
            returncode = self.proc.returncode
            if self.code in (None, 0):
                self.code = returncode if returncode >= 0 else 128 - returncode  # signal N: 128 + N, as a shell says
                self.left_at = self.exit_time if self.left_at is None else self.left_at
            self.exited = True

    def order(self):
        """Who failed first. A process that wrote its exit file left before a peer that wrote its own because
        of it (a collective fails when the process at its other end is gone): the files' times, written by
        the processes, keep that order. A hard death (no file) is timed by our waiting thread, which may
        wake late: it counts as ``SETTLE_S`` earlier, so a peer that failed because of it is not blamed."""
        return self.left_at - (SETTLE_S if self.exited and not self.reported else 0), self.i


def stream(pipe, out, prefix, lock, tail=None):
    """Copy a process's output to ``out`` line by line, each prefixed (a thread per pipe); keep a tail."""
    for line in iter(pipe.readline, b""):
        line = line if line.endswith(b"\n") else line + b"\n"
        if tail is not None:
            tail.append(line.decode(errors="replace").rstrip("\n"))
        with lock:
            out.write(prefix + line)
            out.flush()


def stop(procs):
    """SIGTERM to every process still running (its whole group: it may have children), then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            try:
                os.killpg(p.pid, sig)  # the group of a process we started (start_new_session=True)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = [p for p in running if p.poll() is None]
        if not running:
            return


def watch(children, *, timeout, exit_grace):
    """Poll until every process exits 0 (``(0, None, '')``) or the job fails: ``(code, failed child, why)``."""
    start = time.monotonic()
    while True:
        now = time.time()
        for c in children:
            c.update()
        if all(c.exited for c in children) and all(c.code == 0 for c in children):
            return 0, None, ""
        failed = [c for c in children if c.code not in (None, 0)]
        if failed:
            time.sleep(SETTLE_S)  # a peer that failed because of this one may be seen first: let both be seen
            for c in children:
                c.update()
            failed = [c for c in children if c.code not in (None, 0)]
            first, *others = sorted(failed, key=Child.order)
            also = "".join(f"; also process {c.i}, with {c.code}" for c in others)
            return first.code, first, f"process {first.i} failed with exit code {first.code}{also}"
        clean, inside = [c for c in children if c.code == 0], [c.i for c in children if c.code is None]
        first = min(clean, key=Child.order) if clean else None
        if inside and first is not None and now - first.left_at > exit_grace:
            return EARLY_EXIT, first, (f"process {first.i} left the program (exit code 0) {now - first.left_at:.0f} s "
                                       f"ago while process(es) {inside} are still inside it (--exit-grace "
                                       f"{exit_grace:g} s): a peer waiting for it in a collective would hang")
        if timeout is not None and time.monotonic() - start > timeout:
            return TIMEOUT_EXIT, None, f"timeout after {timeout:g} s"
        time.sleep(0.05)


def say(text):
    """A line of the launcher's own on stderr, prefixed ``[launch] `` (the processes' lines have ``[i] ``)."""
    sys.stderr.write(f"[launch] {text}\n")
    sys.stderr.flush()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through launch's finally: the processes are stopped


def launch(command, *, processes, devices_per_process=None, timeout=None, exit_grace=EXIT_GRACE_S, env=None):
    """Run ``command`` (a list) as ``processes`` JAX processes; return the exit code (module docstring)."""
    port, lock = free_port(), threading.Lock()
    base = os.environ if env is None else env
    children, threads, code, failed, why = [], [], 0, None, ""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a job scheduler's cancel stops the processes too
    with tempfile.TemporaryDirectory(prefix="launch_local-") as exits:
        try:
            for i in range(processes):
                exit_file = os.path.join(exits, f"exit.{i}")
                proc = subprocess.Popen(command, env=process_env(base, port=port, n=processes, i=i,
                                                                 devices=devices_per_process, exit_file=exit_file),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
                children.append(Child(i, proc, exit_file))
                prefix = f"[{i}] ".encode()
                threads += [threading.Thread(target=stream, args=(proc.stdout, sys.stdout.buffer, prefix, lock),
                                             daemon=True),
                            threading.Thread(target=stream, args=(proc.stderr, sys.stderr.buffer, prefix, lock,
                                                                  children[-1].tail), daemon=True)]
                threads[-2].start(), threads[-1].start()
                threading.Thread(target=children[-1].wait, daemon=True).start()
            code, failed, why = watch(children, timeout=timeout, exit_grace=exit_grace)
            if code:
                with lock:
                    say(f"{why}; stopping every process")
        except KeyboardInterrupt:
            code = 130  # the shell's code for Ctrl-C
        except SystemExit as e:
            code = e.code
        finally:
            stop([c.proc for c in children])
            for t in threads:
                t.join(timeout=KILL_GRACE_S)  # its last lines are out before the summary
    if failed is not None:
        say(f"the last stderr lines of process {failed.i}:" if failed.tail else
            f"process {failed.i} wrote nothing to stderr")
        for line in failed.tail:
            say(f"  {failed.i}| {line}")
    return code


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --processes N [--devices-per-process K] [--timeout S] "
                                           "[--exit-grace S] -- COMMAND ...")
    parser.add_argument("--processes", "-n", type=int, required=True, help="number of JAX processes to start")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="simulated CPU devices per process (sets JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES, gloo "
                             "collectives); without it the platform is left as the environment has it")
    parser.add_argument("--timeout", type=float, default=None, help="stop every process after this many seconds")
    parser.add_argument("--exit-grace", type=float, default=EXIT_GRACE_S,
                        help="seconds the others have to leave the program after the first leaves with exit code 0 "
                             f"(default {EXIT_GRACE_S:g}); then the job fails")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each process runs, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python tests/_multiprocess_worker.py")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1; got {args.processes}")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1; got {args.devices_per_process}")
    if args.timeout is not None and not (args.timeout > 0 and math.isfinite(args.timeout)):
        parser.error(f"--timeout must be a positive number of seconds; got {args.timeout:g}")
    if not args.exit_grace >= 0:
        parser.error(f"--exit-grace must be >= 0 seconds; got {args.exit_grace}")
    return launch(command, processes=args.processes, devices_per_process=args.devices_per_process,
                  timeout=args.timeout, exit_grace=args.exit_grace)


if __name__ == "__main__":
    sys.exit(main())
