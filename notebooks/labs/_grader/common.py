"""What every lab's grader shares: the verdicts, calling the student's code, shape/dtype checks,
and running one property over hypothesis-drawn examples.

A grader raises :class:`Fail` with ONE line (``grade.py`` prints it as ``FAIL labNN: <line>``):
which function, which property, on which drawn example. Everything the student's code does wrong
(raise, return the wrong thing) becomes such a line; nothing else is printed on failure.
"""
from __future__ import annotations

import os
import traceback

import numpy as np


class Fail(Exception):
    """The one line that explains a failed grade."""


def one_line(text, limit=400):
    """``text`` on one line, at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(exc, solution_path):
    """``file:line`` of the innermost frame of the student's file in ``exc``'s traceback, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(solution_path)]
    return f" at {os.path.basename(solution_path)}:{frames[-1].lineno}" if frames else ""


class Solution:
    """The student's module and the path it came from; ``call`` turns any exception into a Fail."""

    def __init__(self, module, path):
        self.module, self.path = module, path

    def function(self, name, signature):
        """The student's function ``name`` (Fail naming the signature the grader calls if missing)."""
        fn = getattr(self.module, name, None)
        if not callable(fn):
            raise Fail(f"{os.path.basename(self.path)} has no function {name!r}: the grader calls {signature}")
        return fn

    def call(self, name, fn, *args, example=None, **kwargs):
        """``fn(*args, **kwargs)``; an exception it raises becomes ``Fail('<name> raised ...')``."""
        try:
            return fn(*args, **kwargs)
        except Fail:
            raise
        except Exception as e:  # noqa: BLE001 - any error of the student's code is a verdict
            on = "" if example is None else f" on example {example!r}"
            raise Fail(f"{name} raised {type(e).__name__}: {one_line(e, 200)}{_where(e, self.path)}{on}") from None


def check_array(name, got, shape, dtype, example=None):
    """Fail unless ``got`` is an array of ``shape`` and ``dtype`` (jax arrays are accepted)."""
    on = "" if example is None else f" on example {example!r}"
    if not hasattr(got, "shape") or not hasattr(got, "dtype"):
        raise Fail(f"{name} is a {type(got).__name__}, not an array; expected shape {shape} {np.dtype(dtype)}{on}")
    if tuple(got.shape) != tuple(shape):
        raise Fail(f"{name} has the wrong shape {tuple(got.shape)}; expected {tuple(shape)}{on}")
    if np.dtype(got.dtype) != np.dtype(dtype):
        raise Fail(f"{name} has the wrong dtype {np.dtype(got.dtype)}; expected {np.dtype(dtype)}{on}")
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


def for_all(strategy, prop, *, examples, shrink=True):
    """Run ``prop(example)`` on ``examples`` hypothesis draws of ``strategy``; re-raise its Fail.

    Deterministic (derandomized, no example database), so a grade is reproducible. With ``shrink``
    hypothesis reduces a failing example to a small one first (cheap for numpy labs; the JAX labs
    switch it off, every new shape costs a compile).
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=phases,
              verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def run(example):
        prop(example)

    try:
        run()
    except Fail:
        raise
    except Exception as e:  # noqa: BLE001 - hypothesis wraps a flaky Fail; unwrap it
        inner = [x for x in getattr(e, "exceptions", ()) if isinstance(x, Fail)]
        if inner:
            raise inner[0] from None
        raise


def for_all_rings(prop, *, examples, min_hosts):
    """``prop(problem)`` on plain ring problems of ``min_hosts``..8 hosts with even shards (drawn as
    zigzag; no segment ids, bias, window or masked rows; the default scale): ``examples - 1`` causal,
    where the layout matters, and one not. No shrinking: every new shape costs a compile."""
    from ringattn_ref.testing import attention_problems

    for causal, n in ((True, examples - 1), (False, 1)):
        problems = attention_problems(min_hosts=min_hosts, max_hosts=8, max_shard=4, layouts=("zigzag",),
                                      causal=causal, segment_ids=False, bias=False, window=False,
                                      masked_rows=False)
        for_all(problems.filter(lambda p: p.scale is None), prop, examples=n, shrink=False)


def forbid(solution, *modules, allow=()):
    """Fail if the solution's module holds a function of ``modules`` (the answer) under any name, or
    the module itself; objects named in ``allow`` (e.g. classes the lab hands over) are fine."""
    for name, obj in vars(solution.module).items():
        owner = getattr(obj, "__module__", None) if callable(obj) else getattr(obj, "__name__", None)
        if owner in modules and getattr(obj, "__name__", None) not in allow:
            raise Fail(f"{os.path.basename(solution.path)} uses {owner} (as {name!r}); that is the answer: "
                       f"write it yourself")


def ok(prop, examples):
    """One progress line: a property that held."""
    print(f"  ok  {prop} ({examples} examples)", flush=True)
