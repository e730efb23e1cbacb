"""Read a compiled program's HLO text: can its ``collective-permute``s overlap the compute? (notebook 07)

``jax.jit(f).lower(...).compile().as_text()`` prints one XLA computation after another; a ``while``
loop's body is one of them. Whether a send can run *while* the hop computes is decided by data
dependences inside the loop body, which the text shows exactly:

- a send that can leave at the top of the step takes its operand straight from the loop carry
  (``parameter`` -> ``get-tuple-element`` -> ``copy``/``bitcast``), not from this step's compute;
- a send that the step's compute does not wait for has its result used only by the loop's ``ROOT``
  tuple (the next iteration), never by a fusion, a ``conditional``, a ``dot`` ...

Both together are what lets a GPU/TPU compiler split the permute into ``collective-permute-start`` /
``-done`` and schedule the hop between them. The CPU compiler keeps it synchronous
(``collective-permute(...)``), so on CPU the text shows that overlap is *possible*, never that it
happens; a profile on the hardware shows that.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PERMUTES = ("collective-permute", "collective-permute-start")
# Opcodes that only move or name data: a value that passes through them is not computed here.
PASSTHROUGH = {"parameter", "get-tuple-element", "copy", "bitcast", "tuple", "constant",
               "collective-permute", "collective-permute-start", "collective-permute-done"}

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![\w\-\[])([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: its name, opcode, the instruction names it reads, whether it is ROOT."""
    name: str
    opcode: str
    operands: tuple
    root: bool


@dataclass(frozen=True)
class PermuteDeps:
    """One collective-permute in a computation, and what it depends on / what waits for it.

    computed_from: non-passthrough instructions its operand is computed from in this computation
    (empty: sent straight from the carry); awaited_by: non-passthrough instructions that use its
    result in this computation (empty: only the next iteration needs it).
    """
    computation: str
    name: str
    opcode: str
    computed_from: tuple
    awaited_by: tuple

    @property
    def can_overlap(self):
        return not self.computed_from and not self.awaited_by


def computations(hlo_text):
    """``{computation name: {instruction name: Instr}}`` parsed from ``compiled.as_text()``."""
    comps, current = {}, None
    for line in hlo_text.splitlines():
        if current is None:
            if (head := _HEADER.match(line)) and not line.startswith(" "):
                current = comps.setdefault(head.group(1), {})
            continue
        if line.startswith("}"):
            current = None
            continue
        if not (m := _INSTR.match(line)) or not (op := _OPCODE.search(m.group(3))):
            continue
        local = tuple(name for name in _OPERAND.findall(m.group(3)[op.end():]))
        current[m.group(2)] = Instr(m.group(2), op.group(1), local, bool(m.group(1)))
    return comps


def _walk(instrs, start, step):
    """Names reachable from ``start`` by ``step(name) -> names``, within one computation."""
    seen, todo = set(), list(step(start))
    while todo:
        name = todo.pop()
        if name in instrs and name not in seen:
            seen.add(name)
            todo.extend(step(name))
    return seen


def permute_deps(hlo_text):
    """A :class:`PermuteDeps` for every collective-permute of the program, in text order."""
    found = []
    for comp, instrs in computations(hlo_text).items():
        users = {}
        for ins in instrs.values():
            for operand in ins.operands:
                users.setdefault(operand, []).append(ins.name)
        for ins in instrs.values():
            if ins.opcode not in PERMUTES:
                continue
            upstream = _walk(instrs, ins.name, lambda n: instrs[n].operands if n in instrs else ())
            downstream = _walk(instrs, ins.name, lambda n: users.get(n, ()))
            computed = tuple(sorted(n for n in upstream if instrs[n].opcode not in PASSTHROUGH))
            awaited = tuple(sorted(n for n in downstream if instrs[n].opcode not in PASSTHROUGH))
            found.append(PermuteDeps(comp, ins.name, ins.opcode, computed, awaited))
    return found


def while_bodies(hlo_text):
    """Names of the computations that are the body of a ``while`` loop."""
    return set(re.findall(r"\bbody=%?([\w.\-]+)", hlo_text))


def loop_permutes(hlo_text):
    """The :class:`PermuteDeps` of the permutes inside ``while`` bodies: the ring's per-step sends."""
    bodies = while_bodies(hlo_text)
    return [d for d in permute_deps(hlo_text) if d.computation in bodies]
