"""``ring_attention`` across 2 JAX processes x 4 CPU devices, started by ``scripts/launch_local.py``.

The slow test runs ``tests/_multiprocess_worker.py`` as processes 0 and 1 of one job (gloo
collectives over localhost) and checks the JSON line each prints: 8 devices, 4 of them local (not
the 8 that conftest's ``XLA_FLAGS`` asks for: the launcher removes that flag), both processes agree,
and the ring's forward and gradients match the float64 oracle. The fault tests run
``tests/_multiprocess_fault_worker.py`` (2 processes x 2 devices, a tiny ring): a process that
raises, or exits 0, after a warm-up ring while its peer waits in the next collective ends the whole
launch within the issue's bound (checked to hang on the launcher before the watchdog), one that
leaves a little late does not, and JAX's shutdown timeout alone ends the job too. The fast tests
check the launcher itself on plain Python programs: a failing process stops the others, a clean
exit while the others run fails the job after ``--exit-grace``, the exit file, and ``--timeout``.
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


FAULT_WORKER = os.path.join(ROOT, "tests", "_multiprocess_fault_worker.py")
BOUND_S = 60  # a failed launch's whole wall time, start-up included (generous: ~10-25 s measured)
FAIL_TO_EXIT_S = 30  # from the fault to the launcher's exit: the bound the launcher promises


def launch(*args, timeout, **extra_env):
    """Run the launcher; past ``timeout`` SIGTERM it (it stops its processes) and fail: it hung."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.update(extra_env)
    proc = subprocess.Popen(LAUNCH + list(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # not kill: the launcher's own processes are in their own sessions
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the launcher had not returned after {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_fault(*worker_args, **extra_env):
    """2 processes x 2 CPU devices of the fault worker: (the run, its wall time in s, the seconds from the
    fault (the worker prints its wall-clock time) to the launcher's exit, or None without a fault)."""
    start = time.monotonic()
    run = launch("--processes", "2", "--devices-per-process", "2", "--", sys.executable, FAULT_WORKER,
                 *worker_args, timeout=90, **extra_env)
    elapsed, ended = time.monotonic() - start, time.time()
    fault = re.search(r"fault at ([0-9.]+)$", run.stdout, re.M)
    to_exit = None if fault is None else ended - float(fault.group(1))
    print(f"{' '.join(worker_args)}: exit code {run.returncode} after {elapsed:.1f} s"
          + ("" if to_exit is None else f", {to_exit:.1f} s from the fault to the launcher's exit"))
    return run, elapsed, to_exit


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
    assert "[launch] process 1 failed with exit code 3" in run.stderr, run.stderr


def test_launcher_prints_the_failed_process_stderr_tail():
    program = "import os, sys; sys.exit('bad input on ' + os.environ['JAX_PROCESS_ID']) " \
              "if os.environ['JAX_PROCESS_ID'] == '0' else __import__('time').sleep(120)"
    run = launch("--processes", "2", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "[0] bad input on 0" in run.stderr.splitlines(), run.stderr  # streamed, prefixed
    assert "[launch]   0| bad input on 0" in run.stderr.splitlines(), run.stderr  # and in the summary


def test_launcher_fails_a_clean_exit_while_others_still_run():
    program = "import os, time; time.sleep(120) if os.environ['JAX_PROCESS_ID'] == '0' else None"
    start = time.monotonic()
    run = launch("--processes", "2", "--exit-grace", "1", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert time.monotonic() - start < 30  # process 0 was stopped after the grace, not waited for
    assert "[launch] process 1 left the program (exit code 0)" in run.stderr, run.stderr


def test_launcher_takes_the_exit_file_and_allows_a_late_finish():
    """The exit file counts as leaving: a non-zero code fails the job while the process is still alive (as one
    held in JAX's shutdown barrier is), and a 0 followed by the others within the grace is a normal end."""
    write = "import os, time; open(os.environ['LAUNCH_LOCAL_EXIT_FILE'], 'w').write('{code}'); time.sleep({hold})"
    run = launch("--processes", "2", "--", sys.executable, "-c", write.format(code=7, hold=120), timeout=60)
    assert run.returncode == 7, run.stdout + run.stderr
    assert "failed with exit code 7" in run.stderr, run.stderr
    late = "import os, time; me = int(os.environ['JAX_PROCESS_ID']); time.sleep(me); " \
           "open(os.environ['LAUNCH_LOCAL_EXIT_FILE'], 'w').write('0'); time.sleep(2 - me)"
    run = launch("--processes", "2", "--exit-grace", "5", "--", sys.executable, "-c", late, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr



def test_launcher_blames_the_failure_written_first_by_the_time_in_the_file():
    """Process 1 fails, then process 0 because of it, both inside one tick of the kernel's coarse clock (the
    files' mtimes tie: CI's run blamed process 0). The time each program writes after its code orders them."""
    write = "import os, time; me = int(os.environ['JAX_PROCESS_ID']); time.sleep(1); " \
            "open(os.environ['LAUNCH_LOCAL_EXIT_FILE'], 'w').write(f'{me + 5} {1000.0 - me}'); time.sleep(120)"
    run = launch("--processes", "2", "--", sys.executable, "-c", write, timeout=60)
    assert run.returncode == 6, run.stdout + run.stderr
    assert "[launch] process 1 failed with exit code 6; also process 0, with 5" in run.stderr, run.stderr


def test_launcher_reads_the_exit_files_of_processes_seen_gone():
    """Process 1 writes its file first but exits 0.1 s after process 0: both exits are seen before either
    file is read (CI: the waiting threads woke in the other order and process 0 was blamed). The files'
    times, not the exits', decide."""
    write = "import os, time; me = int(os.environ['JAX_PROCESS_ID']); time.sleep(1); " \
            "open(os.environ['LAUNCH_LOCAL_EXIT_FILE'], 'w').write(f'{me + 5} {1000.0 - me}'); " \
            "time.sleep(0.1 * me); os._exit(me + 5)"
    run = launch("--processes", "2", "--", sys.executable, "-c", write, timeout=60)
    assert run.returncode == 6, run.stdout + run.stderr
    assert "[launch] process 1 failed with exit code 6; also process 0, with 5" in run.stderr, run.stderr


# A stand-in for JAX's shutdown barrier: an atexit handler that holds the process (as JAX's does while a
# peer is stuck in a collective). The launcher's hook reports the exit before it, and skips it on a failure.
HELD = "import atexit, os, sys, time; atexit.register(time.sleep, 120); me = os.environ['JAX_PROCESS_ID']; "


@pytest.mark.parametrize("leave, code", [("raise RuntimeError('boom on ' + me)", 1), ("sys.exit(3)", 3)])
def test_launcher_hook_ends_a_failing_program_held_at_exit(leave, code):
    program = HELD + f"{leave} if me == '1' else time.sleep(120)"
    start = time.monotonic()
    run = launch("--processes", "2", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == code and time.monotonic() - start < 20, run.stdout + run.stderr
    assert f"[launch] process 1 failed with exit code {code}" in run.stderr, run.stderr
    if code == 1:
        assert "[launch]   1| RuntimeError: boom on 1" in run.stderr.splitlines(), run.stderr


def test_launcher_hook_reports_a_clean_exit_held_at_exit():
    program = HELD + "time.sleep(120) if me == '0' else print('done', flush=True)"
    run = launch("--processes", "2", "--exit-grace", "1", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "[launch] process 1 left the program (exit code 0)" in run.stderr, run.stderr


def test_launcher_hook_keeps_other_sitecustomize(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.OTHER_SITE = 1\n")
    program = "import builtins, sys; sys.exit(0 if getattr(builtins, 'OTHER_SITE', 0) else 5)"
    run = launch("--processes", "1", "--", sys.executable, "-c", program, timeout=60,
                 PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    assert run.returncode == 0, run.stdout + run.stderr


def test_launcher_timeout_stops_every_process():
    run = launch("--processes", "2", "--timeout", "1", "--", sys.executable, "-c", "import time; time.sleep(120)",
                 timeout=60)
    assert run.returncode == 124, run.stdout + run.stderr
    assert "timeout" in run.stderr


def test_launcher_rejects_a_negative_exit_grace():
    run = launch("--processes", "2", "--exit-grace", "-1", "--", sys.executable, "-c", "pass", timeout=60)
    assert run.returncode == 2 and "--exit-grace must be >= 0 seconds; got -1" in run.stderr, run.stderr


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "inf"])
def test_launcher_rejects_a_timeout_that_is_not_a_positive_number(timeout):
    """--timeout -5 was accepted and stopped the job at once as a time-out (issue 31)."""
    run = launch("--processes", "2", "--timeout", timeout, "--", sys.executable, "-c", "pass", timeout=60)
    assert run.returncode == 2 and "--timeout must be a positive number of seconds" in run.stderr, run.stderr


# JAX's own shutdown timeout is set to its default, 300 s, so that only the launcher can end these in the bound.
@pytest.mark.slow
def test_a_process_that_raises_after_a_warm_up_ends_the_launch():
    run, elapsed, to_exit = launch_fault("--fault", "raise", "--rank", "1", "--shutdown-timeout", "300")
    assert run.returncode != 0 and elapsed < BOUND_S and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit,
                                                                                     run.stderr[-3000:])
    assert "[launch] process 1 failed with exit code 1" in run.stderr, run.stderr[-3000:]
    assert "[launch]   1| RuntimeError: process 1: injected failure between the collectives" in run.stderr


# An unmodified program (no exit file of its own, JAX's shutdown timeout at its default 300 s): before the
# launcher's hook, the one that raised sat in JAX's shutdown barrier and the launcher hung (issue 31).
@pytest.mark.slow
@pytest.mark.parametrize("at", ["before", "between", "after"])
def test_an_unmodified_program_that_raises_ends_the_launch(at):
    run, elapsed, to_exit = launch_fault("--fault", "raise", "--at", at, "--no-report", "--shutdown-timeout", "300")
    assert run.returncode == 1 and elapsed < BOUND_S and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit,
                                                                                     run.stderr[-3000:])
    assert "[launch] process 1 failed with exit code 1" in run.stderr, run.stderr[-3000:]
    assert f"[launch]   1| RuntimeError: process 1: injected failure {at} the collectives" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("at", ["before", "between"])
def test_an_unmodified_program_that_exits_0_early_ends_the_launch(at):
    """A clean exit while the peer still has collectives to run (after them all it is a normal end)."""
    run, elapsed, to_exit = launch_fault("--fault", "exit0", "--at", at, "--no-report", "--shutdown-timeout", "300")
    assert run.returncode == 1 and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit, run.stderr[-3000:])
    assert "[launch] process 1 left the program (exit code 0)" in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_a_process_that_exits_0_early_ends_the_launch():
    run, elapsed, to_exit = launch_fault("--fault", "exit0", "--rank", "1", "--shutdown-timeout", "300")
    assert run.returncode != 0 and elapsed < BOUND_S and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit,
                                                                                     run.stderr[-3000:])
    assert "[launch] process 1 left the program (exit code 0)" in run.stderr, run.stderr[-3000:]
    assert "[0] process 0: second ring done" not in run.stdout  # process 0 was stuck in the ring, then stopped


@pytest.mark.slow
def test_a_process_that_dies_ends_the_launch():
    """A hard death (``os._exit(9)``: no traceback, no JAX shutdown, as when a host dies): its exit is seen
    at once."""
    run, elapsed, to_exit = launch_fault("--fault", "kill", "--rank", "1", "--shutdown-timeout", "300")
    assert run.returncode == 9 and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit, run.stderr[-3000:])
    assert "[launch] process 1 failed with exit code 9" in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_a_process_that_finishes_late_is_a_normal_end():
    run, _, _ = launch_fault("--fault", "late", "--rank", "0")  # process 0 leaves LATE_S after process 1
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[launch]" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_jax_shutdown_timeout_alone_ends_the_job():
    """No exit file (an unmodified program): the process that raised waits in JAX's shutdown barrier, which
    after ``shutdown_timeout_seconds`` aborts every process (what ends the job under SLURM or on a TPU pod)."""
    run, elapsed, to_exit = launch_fault("--fault", "raise", "--rank", "1", "--no-report", "--shutdown-timeout", "5",
                                         LAUNCH_LOCAL_HOOK="off")
    assert run.returncode != 0 and elapsed < BOUND_S and to_exit <= FAIL_TO_EXIT_S, (elapsed, to_exit,
                                                                                     run.stderr[-3000:])
    assert "Shutdown barrier has failed" in run.stderr, run.stderr[-3000:]


def test_launcher_hook_speaks_for_the_program_not_for_the_pythons_it_starts():
    """A helper Python process the program runs inherits the environment; its end is not the program's."""
    program = "import os, subprocess, sys, time; me = os.environ['JAX_PROCESS_ID']; " \
              "me == '1' and subprocess.run([sys.executable, '-c', 'pass'], check=True); time.sleep(3)"
    run = launch("--processes", "2", "--exit-grace", "1", "--", sys.executable, "-c", program, timeout=60)
    assert run.returncode == 0 and "[launch]" not in run.stderr, run.stdout + run.stderr
