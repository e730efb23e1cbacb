"""The compiled schedule of a real 8-chip TPU v5e program, read without a TPU (notebook 06).

``benchmarks/overlap.py`` compiles ``ring_attention`` forward + backward for an 8-chip v5e slice with libtpu's
compile-only topology (no chip needed, but libtpu installed) and keeps, from the scheduled HLO, what a reader of
the schedule needs: per computation that holds a transfer (the forward ring's loop body, the backward's, and the
entry computation with the loops' calls and the steps peeled off them), its kernels, loops and transfer starts
and dones in the order XLA placed them, each transfer with the array it sends and whether compute runs while it
flies (``benchmarks.overlap.schedule``). Two such schedules are saved beside this module
(``schedule_v5e_*.json``, installed with the package), so the notebook draws them on any laptop:

- ``"before"``: the backward of main until issue 45, which issued the dK/dV send after the hop's kernel; XLA
  then sent K/V with it, after the kernel too: no backward transfer flies while a kernel runs;
- ``"after"``: the "delayed accumulators" backward (branch ``issue45``): every send is issued at the top of a
  step and needs nothing the step computes, so every one flies under a kernel.

Regenerate one from a checkout with libtpu beside the venv (``scripts/setup-libtpu``)::

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m benchmarks.overlap --targets v5e --impls pallas_tpu \\
        --causal no --save-schedule notebooks/ringattn_course/schedule_v5e_after.json --label "after: ..."

:func:`compile_current` does the same in memory for the checkout's own ``ringattn_fast`` (notebook 06 calls it
when ``RINGATTN_COMPILE_SCHEDULE=1``). A schedule is a dict; its ``"computations"`` a list of ``{"name",
"role", "events"}``; an event a dict with ``"kind"``: ``"kernel"``, ``"loop"``, ``"compute"``, ``"other"``,
``"start"`` (``"id"``, ``"sends"``, ``"bytes"``, ``"backward"``, ``"hidden"``) or ``"done"`` (``"id"``).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from importlib import resources
from pathlib import Path
from typing import NamedTuple

SAVED = {"before": "schedule_v5e_before.json", "after": "schedule_v5e_after.json"}
ROLES = ("forward loop body", "backward loop body", "entry")
COMPUTE = ("kernel", "loop", "compute")  # the events a transfer can hide behind


class Transfer(NamedTuple):
    """One transfer of a computation: the positions of its start and done in ``events``, the start event."""
    role: str
    start: int
    done: int
    event: dict

    @property
    def hidden(self):
        return self.event["hidden"]

    @property
    def backward(self):
        return self.event["backward"]


def load(name):
    """The saved schedule ``name`` (``"before"`` or ``"after"``, :data:`SAVED`) as a dict."""
    if name not in SAVED:
        raise ValueError(f"name must be one of {sorted(SAVED)}, got {name!r}")
    return json.loads(resources.files("ringattn_course").joinpath(SAVED[name]).read_text())


def compile_current(**kwargs):
    """The schedule of this checkout's ``ringattn_fast``, compiled now (``benchmarks.overlap.compiled_schedule``,
    ``kwargs`` passed on: v5e, ``pallas_tpu``, non-causal, 4096 tokens per chip by default). Needs a checkout
    (``benchmarks/`` is not installed) and libtpu (``PYTHONPATH=.venv/libtpu``); about 20 s to a minute."""
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError("compile_current needs libtpu: scripts/setup-libtpu, then PYTHONPATH=.venv/libtpu")
    try:
        from benchmarks import overlap
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "benchmarks" / "overlap.py").is_file():
            raise RuntimeError("compile_current needs a checkout of ringattn (benchmarks/ is not installed)") from None
        sys.path.insert(0, str(root))
        from benchmarks import overlap
    return overlap.compiled_schedule(label="this checkout", **kwargs)


def computation(sched, role):
    """The computation of ``sched`` with ``role`` (one of :data:`ROLES`)."""
    found = [c for c in sched["computations"] if c["role"] == role]
    if not found:
        raise ValueError(f"role must be one of {[c['role'] for c in sched['computations']]}, got {role!r}")
    return found[0]


def transfers(sched, role=None):
    """Every :class:`Transfer` of ``sched`` (of the computation with ``role`` only, if given), in schedule order."""
    out = []
    for comp in sched["computations"]:
        if role is not None and comp["role"] != role:
            continue
        events = comp["events"]
        for i, e in enumerate(events):
            if e["kind"] == "start":
                done = next(j for j in range(i + 1, len(events)) if events[j]["kind"] == "done"
                            and events[j]["id"] == e["id"])
                out.append(Transfer(comp["role"], i, done, e))
    return out


def counts(sched):
    """``{"fwd": [transfers, hidden], "bwd": [...]}`` of ``sched``, counted from its events' flags (as
    ``benchmarks.overlap.summary`` counts them from the HLO)."""
    ts = transfers(sched)
    return {d: [sum(t.backward == b for t in ts), sum(t.hidden and t.backward == b for t in ts)]
            for d, b in (("fwd", False), ("bwd", True))}


def without_flags(events):
    """``events`` with the ``"hidden"`` flags (the answer) taken out of the starts: what the exercise gets."""
    return [{k: v for k, v in e.items() if k != "hidden"} for e in events]
