"""Parent side: a program the child exported, compiled and run here, and what it is made of.

The child traces the student's function on abstract inputs and sends ``jax.export``'s serialized
StableHLO. Here :class:`Program` deserializes it, refuses what could run Python or talk to the host
(custom calls other than the sharding markers, effects), compiles it for the parent's own devices and
runs it on the parent's inputs. Every structural check reads this same compiled program: its
collectives (``hlo.collectives``: operands' bytes, trip counts) and its per-device memory
(``memory_analysis().temp_size_in_bytes``). See the threat model in ``common.py``.
"""
from __future__ import annotations

import re

import numpy as np

from . import hlo
from .common import Fail, one_line

# custom calls jax emits for shard_map / sharding annotations, and XLA CPU's own kernels; anything else
# (a host callback: jax.pure_callback, io_callback, debug.print) is refused
SAFE_CUSTOM_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.GlobalToLocalShape",
                     "xla.sdy.LocalToGlobalShape", "xla.sdy.FuncResultSharding", "xla.sdy.ShardingGroup",
                     "annotate_device_placement", "MoveToHost", "MoveToDevice", "mhlo.sharding",
                     "lapack_sgetrf_ffi", "lapack_dgetrf_ffi"}
_CUSTOM = re.compile(r"stablehlo\.custom_call\s+@([\w.\-]+)|call_target_name\s*=\s*\"([\w.\-]+)\"")


class Program:
    """A compiled exported program. ``name``: whose (for messages); ``devices``: how many it must use."""

    def __init__(self, blob, name, devices, example):
        import jax

        self.name, self.example = name, example
        try:
            exp = jax.export.deserialize(bytearray(blob))
        except Exception as e:  # noqa: BLE001 - anything the child wrote
            raise Fail(f"the program the child exported for {name} does not deserialize: {one_line(e, 200)}") from None
        if exp.nr_devices != devices or tuple(exp.platforms) != ("cpu",):
            raise Fail(f"property 'the program runs on the {devices} devices of the mesh' failed: {name}'s program "
                       f"uses {exp.nr_devices} device(s) on {exp.platforms} (is it attention on one device?)"
                       f"{self._on()}")
        if exp.ordered_effects or exp.unordered_effects:
            raise Fail(f"{name}'s program has side effects ({exp.ordered_effects + exp.unordered_effects}): no "
                       f"callbacks or prints to the host{self._on()}")
        self.stablehlo = exp.mlir_module()
        bad = sorted({a or b for a, b in _CUSTOM.findall(self.stablehlo)} - SAFE_CUSTOM_CALLS)
        if bad:
            raise Fail(f"{name}'s program calls out to {bad} (a host callback?): the grader runs only XLA "
                       f"programs{self._on()}")
        self.exp, self.in_avals = exp, exp.in_avals
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("grader",),
                                 axis_types=(jax.sharding.AxisType.Auto,))
        self.mesh = mesh
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
        with jax.set_mesh(mesh):
            self.compiled = jax.jit(exp.call).lower(*specs).compile()
        self.hlo = self.compiled.as_text()
        self.collectives = hlo.collectives(self.hlo)
        self.temp_bytes = int(self.compiled.memory_analysis().temp_size_in_bytes)

    def _on(self):
        return "" if self.example is None else f" on example {self.example!r}"

    def __call__(self, *args):
        import jax

        for a, aval in zip(args, self.in_avals):
            if tuple(np.shape(a)) != tuple(aval.shape) or np.dtype(np.asarray(a).dtype) != np.dtype(aval.dtype):
                raise Fail(f"{self.name}'s program takes {aval.str_short()}, the grader has "
                           f"{np.asarray(a).dtype}{list(np.shape(a))}{self._on()}")
        with jax.set_mesh(self.mesh):
            out = self.compiled(*args)
        return [np.asarray(x) for x in jax.tree.leaves(out)]

    def uses_shard_map(self):
        return "manual_computation" in self.stablehlo or "SPMDFullToShardShape" in self.stablehlo

    def count(self, *opcodes):
        return [c for c in self.collectives if c.opcode in opcodes]


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")
_REGION_ARG = re.compile(r"%arg\d+: (tensor<[^>]*>)")
_FUNC = re.compile(r"\s*func\.func\b[^@]*@([\w.$\-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$\-]+)")


def _block(lines, i):
    """The lines of the block opened by line ``i`` (which ends with ``{``), up to its closing brace."""
    depth, body = 1, []
    for line in lines[i + 1:]:
        depth += line.count("{") - line.count("}")
        if depth <= 0:
            break
        body.append(line.split(" loc(", 1)[0])
    return body


def per_host_arrays(stablehlo):
    """``[(dtype, shape), ...]`` of every array a host holds inside the program's ``shard_map`` bodies: the
    body's arguments (its operands' per-host shards, and any constant the trace hoisted out of the body
    and passed in whole), every value the body computes, and the same for every function the body calls
    (a nested ``jax.jit``), read from the exported StableHLO (what the solution traced, before XLA
    simplifies anything). Shardy's ``sdy.manual_computation`` regions and the older ``shmap_body``
    functions both count."""
    lines = stablehlo.splitlines()
    funcs, regions = {}, []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("{"):
            continue
        func = _FUNC.match(line)
        if func:
            funcs[func.group(1)] = [line.split(" loc(", 1)[0]] + _block(lines, i)
            if func.group(1).startswith("shmap_body"):
                regions.append(func.group(1))
        elif "sdy.manual_computation(" in line:
            header = line.split("manual_axes=", 1)[-1]  # the region's arguments, not the global operands
            regions.append(" ".join(_REGION_ARG.findall(header)).splitlines() + _block(lines, i))
    seen, texts, todo = set(), [], list(regions)
    while todo:
        region = todo.pop()
        if isinstance(region, str):  # a function, by name
            if region in seen or region not in funcs:
                continue
            seen.add(region)
            region = funcs[region]
        texts += region
        todo += [name for text in region for name in _CALL.findall(text)]
    return [(dtype, tuple(int(d) for d in dims.split("x") if d)) for text in texts
            for dims, dtype in _TENSOR.findall(text)]


def ring_direction(pairs, n):
    """'i -> i+1', 'i -> i-1' or None for a collective-permute's pairs on ``n`` devices."""
    pairs = set(pairs)
    if pairs == {(i, (i + 1) % n) for i in range(n)}:
        return "i -> i+1"
    if pairs == {(i, (i - 1) % n) for i in range(n)}:
        return "i -> i-1"
    return None


def require_ring(prog, n, prop, example, *, directions=("i -> i+1",), others=(), counted=True):
    """Fail unless the program is a ring: a shard_map whose collectives are collective-permutes to a
    neighbour in ``directions`` (plus the opcodes in ``others``), each with a known run count if ``counted``.
    Returns ``{direction: [Collective, ...]}``."""
    if not prog.uses_shard_map():
        raise Fail(f"property '{prop}' failed on example {example!r}: the program has no shard_map")
    by_way = {way: [] for way in directions}
    for c in prog.collectives:
        if c.opcode in others:
            continue
        if c.opcode != "collective-permute":
            raise Fail(f"property '{prop}' failed on example {example!r}: the program has an {c.opcode} "
                       f"(moving {c.nbytes} bytes); the lab's ring moves K/V with ppermute only")
        way = ring_direction(c.pairs, n)
        if way not in by_way:
            raise Fail(f"property '{prop}' failed on example {example!r}: a ppermute with pairs {list(c.pairs)}; "
                       f"expected {' or '.join(directions)} on {n} devices")
        if c.runs is None and counted:
            raise Fail(f"property '{prop}' failed on example {example!r}: a ppermute in a loop whose trip count "
                       f"XLA cannot see; use lax.fori_loop with Python int bounds (or a Python loop)")
        by_way[way].append(c)
    if not any(by_way.values()):
        raise Fail(f"property '{prop}' failed on example {example!r}: the program has no ppermute (K/V never "
                   f"travel: is it attention on one device?)")
    return by_way


def require_ppermute_only(prog, prop, example):
    """Fail if the program's StableHLO holds an explicit collective other than a ppermute. Explicit
    collectives exist only inside a ``shard_map`` (the reorder outside it is partitioned by XLA later and
    shows in the compiled HLO, not here), so this tells an all-gather inside the ring from the layout's."""
    found = sorted(set(re.findall(r"stablehlo\.(all_gather|all_to_all|all_reduce|reduce_scatter)\b", prog.stablehlo)))
    if found:
        raise Fail(f"property '{prop}' failed on example {example!r}: the shard_map holds {', '.join(found)}; "
                   f"inside it, K/V may move only by ppermute (lax.ppermute)")


def require_memory(prog, budget, prop, example, what):
    """Fail unless the program's per-device scratch memory is within ``budget`` bytes."""
    if prog.temp_bytes > budget:
        raise Fail(f"property '{prop}' failed on example {example!r}: the compiled program needs "
                   f"{prog.temp_bytes} bytes of scratch memory per device, more than {budget} ({what})")
