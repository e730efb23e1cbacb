"""Child side: import the student's file under the guard, run the parent's tasks, write the results.

Started by ``grade.py`` as ``python grade.py --child LAB WORKDIR SOLUTION`` with JAX already set up
(8 CPU devices, x64 as the lab needs). Reads ``WORKDIR/tasks.json`` and ``tNN.in.npz``; for each task
calls the lab's handler ``CHILD[kind](solution, arrays, params)``, which returns a dict of arrays
(written as ``tNN.out.npz``) or bytes (a ``jax.export`` artifact, ``tNN.out.bin``). The first error
(the solution does not import, lacks a function, raises, calls the library's answer) is written to
``error.json`` and ends the run. The child decides nothing: the parent checks every result.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback

import numpy as np

from .common import Fail, one_line
from .guard import ForbiddenCall, Guard

HERE = os.path.dirname(os.path.abspath(__file__))


def _where(exc, solution_path):
    """``file:line`` of the innermost frame of the student's file in ``exc``'s traceback, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(solution_path)]
    return f" at {os.path.basename(solution_path)}:{frames[-1].lineno}" if frames else ""


class Solution:
    """The student's module, its path and the guard; ``call`` turns any exception into a Fail."""

    def __init__(self, module, path, guard):
        self.module, self.path, self.guard = module, path, guard

    def function(self, name, signature):
        """The student's function ``name`` (Fail naming the signature the grader calls if missing)."""
        fn = getattr(self.module, name, None)
        if not callable(fn):
            raise Fail(f"{os.path.basename(self.path)} has no function {name!r}: the grader calls {signature}")
        return fn

    def call(self, name, fn, *args, example=None, **kwargs):
        """``fn(*args, **kwargs)``; an exception it raises becomes ``Fail('<name> raised ...')``."""
        try:
            out = fn(*args, **kwargs)
        except Fail:
            raise
        except Exception as e:  # noqa: BLE001 - any error of the student's code is a verdict
            self.check_guard()
            on = "" if example is None else f" on example {example}"
            raise Fail(f"{name} raised {type(e).__name__}: {one_line(e, 200)}{_where(e, self.path)}{on}") from None
        self.check_guard()
        return out

    def check_guard(self):
        if self.guard.violation is not None:
            raise Fail(self.guard.violation)


def as_arrays(name, out, names):
    """The student's return value as a dict of numpy arrays named ``names`` (a tuple of that length,
    or one array when ``names`` has one entry); a Fail saying what came back otherwise."""
    if len(names) == 1:
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise Fail(f"{name} returned {type(out).__name__}; expected a tuple ({', '.join(names)})")
    arrays = {}
    for key, x in zip(names, out):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise Fail(f"{name}'s {key} is a {type(x).__name__}, not an array")
        x = np.asarray(x)
        if x.dtype == object:
            raise Fail(f"{name}'s {key} is an object array, not numbers")
        arrays[key] = x
    return arrays


def export(fn, avals):
    """``jax.export`` of ``fn`` (already jitted) on abstract inputs ``[(shape, dtype), ...]``: bytes."""
    import jax

    specs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in avals]
    return bytes(jax.export.export(fn)(*specs).serialize())


def main(lab, workdir, path):
    with open(os.path.join(workdir, "tasks.json")) as f:
        tasks = json.load(f)
    grader = importlib.import_module(f"_grader.{lab}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository (or handout) root
    trusted = [HERE] + [os.path.join(root, p) for p in ("ringattn_ref", "ringattn_fast",
                                                         os.path.join("notebooks", "ringattn_course"))]
    trusted += [os.path.dirname(m.__file__) for m in map(sys.modules.get, ("ringattn_ref", "ringattn_fast"))
                if m is not None and getattr(m, "__file__", None)]
    guard = Guard(path, grader.ALLOWED, trusted).install()
    current = None
    try:
        try:
            spec = importlib.util.spec_from_file_location("solution", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except ForbiddenCall:
            raise Fail(guard.violation) from None
        except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, an error at import time ...
            if guard.violation is not None:
                raise Fail(guard.violation) from None
            raise Fail(f"cannot import {os.path.basename(path)}: {type(e).__name__}: {one_line(e, 300)}") from None
        sol = Solution(module, path, guard)
        for name, signature in grader.FUNCTIONS.items():
            sol.function(name, signature)
        for task in tasks:
            current = task["id"]
            with np.load(os.path.join(workdir, f"{current}.in.npz"), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            out = grader.CHILD[task["kind"]](sol, arrays, task["params"])
            sol.check_guard()
            if isinstance(out, bytes):
                with open(os.path.join(workdir, f"{current}.out.bin"), "wb") as f:
                    f.write(out)
            else:
                np.savez(os.path.join(workdir, f"{current}.out.npz"), **out)
    except Fail as e:
        with open(os.path.join(workdir, "error.json"), "w") as f:
            json.dump({"task": current, "message": str(e)}, f)
        return 1
    return 0
