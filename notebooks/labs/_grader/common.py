"""What every lab's grader shares: the verdicts, the checks on returned arrays, drawing examples, and
the protocol between the grading parent and the child that runs the student's code.

Threat model (what a solution can do, and why it still cannot pass without solving the lab)
------------------------------------------------------------------------------------------
The student's file runs only in a **child process** (``child.py``); the **parent** (``grade.py``)
never imports it. The parent chooses every input (fixed examples and hypothesis draws), writes them
to a fresh temporary directory as ``.npz`` (no pickles), starts the child, reads the child's results
back as plain arrays (``np.load(allow_pickle=False)``) and decides the verdict itself: the oracle's
answers are computed in the parent and never written anywhere the child can read. So

- replacing the grader's comparison function, or any other function, changes only the child's copy:
  the comparison runs in the parent;
- there is no verdict token to steal: the child never prints the verdict; everything it prints is
  shown to the student prefixed with ``| ``, and the exit status is the parent's;
- a solution that prints ``PASS`` and exits, or kills the child, gets "died without a verdict".

What the child sends back is untrusted data. Arrays are checked for shape, dtype and values against
the oracle in the parent, so a forged array passes only if it is the right answer. **Programs** (the
JAX labs) come back as ``jax.export`` artifacts: serialized StableHLO, shapes only, traced on
abstract inputs (the child never sees the parent's numbers). The parent refuses artifacts with host
callbacks or effects, compiles them itself, **runs them on its own inputs** against the oracle, and
reads every structural fact from that same compiled program (``programs.py``: the collectives, the
bytes each moves counted from its operands' shapes, loop trip counts, ``memory_analysis()``). A
forged program is therefore checked exactly like an honest one: it passes only if it computes the
answer with the structure the lab asks for. A child's error report can only make it fail.

The rule against calling the library's answer is enforced in the child (``guard.py``): an import
hook registers every function of ``ringattn_ref``, ``ringattn_fast`` and ``ringattn_course`` as it
is loaded and ``sys.monitoring`` reports each call; a call whose nearest caller in the student's
file or the library is the student's file must be to a function the lab allows. That holds whatever
name, attribute path, alias, ``functools.partial`` or wrapper the call goes through, and for code the
library calls on the student's behalf (a forbidden function called by an allowed one is the
library's business). The child is the student's process, so a solution *written to defeat* the hook
(removing it from ``sys.meta_path``, freeing the monitoring tool, executing the library's source
itself) could; the parent therefore also refuses, from the source text before anything runs
(``source.py``), a solution that touches that machinery (frames, ``sys.monitoring``,
``sys.modules``, ``importlib``, ``exec``/``eval``, ``gc``, ``ctypes``, ``inspect``, the grader's
modules). What the grader does not defend against: the operating system. The child runs as the same
user as the parent; reading the parent's memory, editing the grader's files on disk for the next run,
or a program that exploits a bug in XLA are outside what a grader in the same account can stop. For
summative grading run each submission in a fresh copy of the handout, in a container or a throwaway
account.

A grader raises :class:`Fail` with ONE line (``grade.py`` prints it as ``FAIL labNN: <line>``):
which function, which property, on which example. Nothing else is printed on failure.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np


class Fail(Exception):
    """The one line that explains a failed grade."""


def one_line(text, limit=400):
    """``text`` on one line, at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def on(example):
    return "" if example is None else f" on example {example!r}"


def check_array(name, got, shape, dtype, example=None):
    """Fail unless ``got`` is an array of ``shape`` and ``dtype``; returns it as a numpy array."""
    if not hasattr(got, "shape") or not hasattr(got, "dtype"):
        raise Fail(f"{name} is a {type(got).__name__}, not an array; expected shape {tuple(shape)} "
                   f"{np.dtype(dtype)}{on(example)}")
    if tuple(got.shape) != tuple(shape):
        raise Fail(f"{name} has the wrong shape {tuple(got.shape)}; expected {tuple(shape)}{on(example)}")
    if dtype is not None and np.dtype(got.dtype) != np.dtype(dtype):
        raise Fail(f"{name} has the wrong dtype {np.dtype(got.dtype)}; expected {np.dtype(dtype)}{on(example)}")
    return np.asarray(got)


def check_close(name, got, want, tol, prop, example):
    """Fail unless ``got`` matches ``want`` to ``tol`` (equal -inf entries count as equal; NaN never)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if np.isnan(got).any():
        raise Fail(f"property '{prop}' failed on example {example!r}: {name} holds NaN "
                   f"({int(np.isnan(got).sum())} entries)")
    if not np.array_equal(np.isneginf(got), np.isneginf(want)):
        raise Fail(f"property '{prop}' failed on example {example!r}: the -inf entries of {name} differ "
                   f"from the oracle's ({int(np.isneginf(got).sum())} vs {int(np.isneginf(want).sum())})")
    finite = np.isfinite(want)
    err = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
    if not np.all(np.isfinite(got[finite])) or err > tol:
        raise Fail(f"property '{prop}' failed on example {example!r}: max |{name} - oracle| = {err:.3g} > {tol:g}")


def draw(strategy, n):
    """``n`` examples of a hypothesis ``strategy``, the same on every run (derandomized, no database).

    Drawn up front, in the parent, because the child runs once; no shrinking (the fixed examples of
    each lab are the small readable ones). The first draw is hypothesis's simplest; the others vary.
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings

    out = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out[:n]


def ok(prop, examples):
    """One progress line: a property that held."""
    print(f"  ok  {prop} ({examples} examples)", flush=True)


# ---- the protocol: tasks the parent writes, results the child writes back ----------------------------------

@dataclass
class Task:
    """One thing for the child to do: ``kind`` names a handler of the lab's ``CHILD`` table; ``arrays``
    (numpy, written as .npz) and ``params`` (JSON) are its inputs."""
    id: str
    kind: str
    params: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)


class Tasks:
    """The parent's list of tasks, written into ``workdir`` for the child."""

    def __init__(self):
        self.items = []

    def add(self, kind, arrays=None, **params):
        task = Task(f"t{len(self.items)}", kind, params, dict(arrays or {}))
        self.items.append(task)
        return task

    def write(self, workdir):
        for t in self.items:
            np.savez(os.path.join(workdir, f"{t.id}.in.npz"), **t.arrays)
        with open(os.path.join(workdir, "tasks.json"), "w") as f:
            json.dump([{"id": t.id, "kind": t.kind, "params": t.params} for t in self.items], f)


MAX_RESULT_BYTES = 256 * 2**20  # a result larger than this is not read (a child could fill the disk)


class Results:
    """What the child wrote back: per task an .npz of arrays or a .bin program; or the child's error."""

    def __init__(self, workdir, tasks, child_status):
        self.workdir, self.tasks, self.status = workdir, tasks, child_status
        path = os.path.join(workdir, "error.json")
        self.error = None
        if os.path.isfile(path) and os.path.getsize(path) < 65536:
            try:
                with open(path) as f:
                    err = json.load(f)
                self.error = (str(err.get("task")), one_line(err.get("message", ""), 600))
            except (ValueError, OSError, AttributeError):
                self.error = None

    def _missing(self, task):
        if self.error is not None and self.error[0] in (task.id, "None"):
            raise Fail(self.error[1])
        if self.error is not None:  # the child stopped at an earlier task: report that one
            raise Fail(self.error[1])
        raise Died(self.status)

    def _path(self, task, ext):
        path = os.path.join(self.workdir, f"{task.id}.out.{ext}")
        if not os.path.isfile(path):
            self._missing(task)
        if os.path.getsize(path) > MAX_RESULT_BYTES:
            raise Fail(f"the result of task {task.id} ({task.kind}) is larger than {MAX_RESULT_BYTES >> 20} MiB")
        return path

    def arrays(self, task):
        """The arrays the child returned for ``task`` (a dict name -> numpy array)."""
        path = self._path(task, "npz")
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (ValueError, OSError) as e:
            raise Fail(f"the child's result for task {task.id} ({task.kind}) is not a plain .npz: "
                       f"{one_line(e, 200)}") from None

    def blob(self, task):
        """The bytes the child returned for ``task`` (a serialized program)."""
        with open(self._path(task, "bin"), "rb") as f:
            return f.read()


class Died(Exception):
    """The child ended without results or an error report (crashed, killed, or left early)."""
