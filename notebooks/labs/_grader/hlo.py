"""Parent side: the collectives of a compiled program, read from its HLO text (``compiled.as_text()``).

The text is one computation after another (``ENTRY`` the program, loop bodies, branches); each line
``%name = SHAPE opcode(%operand, ...), attributes``. For every collective we take what it moves from
its **operands** (each operand's shape where it is defined: a parameter or an instruction), not from
a field of the result, and how often it runs: the product of the known trip counts of the ``while``
loops around it (XLA records ``known_trip_count`` for a ``fori_loop`` with static bounds). A
collective inside a loop whose trip count XLA does not know has ``runs = None``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

COLLECTIVES = ("collective-permute", "collective-permute-start", "all-gather", "all-gather-start", "all-to-all",
               "all-reduce", "all-reduce-start", "reduce-scatter", "collective-broadcast", "ragged-all-to-all")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
            "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_OPCODE = re.compile(r"(?:^|[\s)}])([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclass(frozen=True)
class Collective:
    """One collective op: its opcode, the bytes of its operands (one execution), the dtypes and shapes
    it moves, its ``(source, target)`` pairs (permutes) and how often it runs (None: unknown)."""
    opcode: str
    nbytes: int
    arrays: tuple
    pairs: tuple
    runs: int | None

    @property
    def total(self):
        return None if self.runs is None else self.nbytes * self.runs


def _arrays(shape_text):
    """``[(dtype, shape tuple), ...]`` of an HLO shape: ``f64[2,3]{1,0}`` or a tuple of them."""
    return [(dt, tuple(int(n) for n in dims.split(",") if n)) for dt, dims in _ARRAY.findall(shape_text)
            if dt in ITEMSIZE]


def _nbytes(arrays):
    total = 0
    for dt, shape in arrays:
        n = ITEMSIZE[dt]
        for d in shape:
            n *= d
        total += n
    return total


def _operand_names(rest, opcode_end):
    """Names inside the parentheses that follow the opcode (matching parentheses)."""
    depth, i = 1, opcode_end
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return re.findall(r"%([\w.\-]+)", rest[opcode_end:i - 1]), rest[i:]


def parse(hlo_text):
    """``(entry name, {computation: [(name, shape text, opcode, operand names, attributes)]})``."""
    comps, current, entry = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            head = _HEADER.match(line)
            if head and not line.startswith(" "):
                current = comps.setdefault(head.group(2), [])
                entry = head.group(2) if head.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group(2)
        op = _OPCODE.search(rest)
        if not op:
            continue
        operands, attrs = _operand_names(rest, op.end())
        current.append((m.group(1), rest[:op.start(1)], op.group(1), operands, attrs))
    return entry, comps


def collectives(hlo_text):
    """Every collective of the compiled program, with how often it runs (see the module docstring)."""
    entry, comps = parse(hlo_text)
    runs = {entry: 1}
    order = [entry]
    while order:  # the call graph from ENTRY: loop bodies multiply by their trip count
        comp = order.pop()
        for _, _, opcode, _, attrs in comps.get(comp, ()):
            trips = _TRIPS.search(attrs)
            called = [(kind, name) for kind, name in _CALLS.findall(attrs)]
            for branches in _BRANCHES.findall(attrs):
                called += [("branch", b.strip().lstrip("%")) for b in branches.split(",") if b.strip()]
            for kind, name in called:
                if name not in comps:
                    continue
                factor = (int(trips.group(1)) if trips else None) if opcode == "while" and kind == "body" else 1
                here = runs[comp]
                runs[name] = None if here is None or factor is None else here * factor
                order.append(name)
    found = []
    for comp, instrs in comps.items():
        if comp not in runs:
            continue
        shapes = {name: shape for name, shape, _, _, _ in instrs}
        for name, shape, opcode, operands, attrs in instrs:
            if opcode not in COLLECTIVES:
                continue
            arrays = [a for o in operands for a in _arrays(shapes.get(o, ""))]
            pairs = _PAIRS.search(attrs)
            pairs = tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))) \
                if pairs else ()
            found.append(Collective(opcode.removesuffix("-start"), _nbytes(arrays), tuple(arrays), pairs, runs[comp]))
    return found


def constants(hlo_text, min_elements):
    """Shapes of the array constants with at least ``min_elements`` elements (a table in the program)."""
    _, comps = parse(hlo_text)
    out = []
    for instrs in comps.values():
        for _, shape, opcode, _, _ in instrs:
            if opcode == "constant":
                for dt, dims in _arrays(shape):
                    n = 1
                    for d in dims:
                        n *= d
                    if n >= min_elements:
                        out.append((dt, dims))
    return out
