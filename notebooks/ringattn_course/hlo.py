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

``collective_messages`` reads the other half of the cost: how many bytes each collective's operands
hold (notebooks 07, 10, 11 and 13 check their predictions against it).
"""
from __future__ import annotations

import math
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


# ---- how many bytes each collective moves (notebooks 07, 10, 11, 13) -----------------------------

COLLECTIVE_OPCODES = ("collective-permute", "collective-permute-start", "all-gather", "all-gather-start",
                      "all-reduce", "all-reduce-start", "reduce-scatter", "all-to-all")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
            "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*"                     # %name =
                  r"(\(.*?\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+"            # its type (or a tuple)
                  r"([a-z][a-z0-9\-]*)\(")                                      # opcode(
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def shape_bytes(hlo_type):
    """Bytes of an HLO type such as ``f32[1,32,2,16]{3,2,1,0}`` or a tuple ``(f32[4], s32[1,32])``."""
    total = 0
    for dtype, dims in _ARRAY.findall(hlo_type):
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown HLO element type {dtype!r} in {hlo_type!r}")
        total += ITEMSIZE[dtype] * math.prod(int(x) for x in dims.split(",") if x)
    return total


@dataclass(frozen=True)
class Message:
    """One collective of the compiled program: where it is, its opcode and the bytes of its operands
    (read from the operands' definitions, not from the result: an all-gather's result is N times larger)."""
    computation: str
    name: str
    opcode: str
    nbytes: int


def collective_messages(hlo_text):
    """A :class:`Message` for every collective instruction of ``compiled.as_text()``, in text order."""
    types, found = {}, []
    current = None
    for line in hlo_text.splitlines():
        if (head := _HEADER.match(line)) and not line.startswith(" "):
            current = head.group(1)
            continue
        if not (m := _DEF.match(line)):
            continue
        name, hlo_type, opcode = m.groups()
        types[name] = hlo_type
        if opcode in COLLECTIVE_OPCODES:
            args = line[m.end():].split(")", 1)[0]
            found.append((current, name, opcode, _OPERAND.findall(args)))
    return [Message(comp, name, opcode, sum(shape_bytes(types[o]) for o in operands))
            for comp, name, opcode, operands in found]
