"""Does the compiled ring hide its transfers? Read from the scheduled HLO of a compile for a TPU slice no one here has.

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m benchmarks.overlap [--targets v5e,v6e,v5p] [--impls pallas_tpu,xla]

(libtpu beside the venv: ``scripts/setup-libtpu``). Ring Attention's point (arXiv:2310.01889, section 3) is
that each hop's K/V transfer flies while the hop computes. Whether it does is the compiler's choice: XLA
splits a ``collective-permute`` into ``-start`` / ``-done`` and schedules work between them, or not. The
compiled program's text (``compiled.as_text()``) lists every computation's instructions *in their schedule
order*, so for each ``collective-permute-start`` we look at what runs before its ``-done``: a transfer is
**hidden** when some compute is scheduled between them -- a Mosaic kernel (``custom-call`` to
``tpu_custom_call``), a ``dot`` / ``convolution``, or a ``fusion`` / ``call`` / ``conditional`` / ``while``
whose computations run one -- and **exposed** otherwise. A plain ``collective-permute`` (not split) is
synchronous: exposed too.

This is the static schedule, not a measurement: a hidden transfer may still outlast its compute (a 4K-token
bfloat16 K/V shard of 8 kv heads is 16 MiB at v5e's ~45 GB/s per ICI link, 0.4 ms, against a hop of ~2 ms
forward), but an exposed one is certain to cost its full time.

:func:`transfers` parses, :func:`check` compiles one case and parses it; ``main`` compiles the table
(target x impl x forward / forward+backward) plus a CONTROL ring whose transfer a data dependency forces to
finish before the kernel, which must come out exposed. One JSON object per row to stdout, a table to stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import NamedTuple

# target: (topology, chip_config_name, chips_per_host_bounds): 8 chips each
TARGETS = {"v5e": ("v5e:2x4", "default", (2, 4, 1)), "v6e": ("v6e:2x4", "default", (2, 4, 1)),
           "v5p": ("v5p:2x2x2", "megacore", (2, 2, 2))}
COMPUTE_OPS = ("dot", "convolution")
CALLERS = ("fusion", "call", "conditional", "while", "async-start")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


class Instr(NamedTuple):
    name: str
    op: str
    rest: str  # operands and attributes

    @property
    def backward(self):
        """Whether JAX traced it for a backward pass (its ``op_name`` under ``transpose(...)``)."""
        return "transpose(" in (re.search(r'op_name="([^"]*)"', self.rest) or [None, ""])[1]


class Transfer(NamedTuple):
    """One K/V (or dK/dV) move in computation ``comp``: ``hidden`` iff compute runs between start and done;
    ``between``: the names of that compute."""
    comp: str
    start: str
    hidden: bool
    synchronous: bool
    between: tuple
    backward: bool = False


def computations(hlo):
    """``{name: [Instr]}`` in schedule order, from a compiled module's text."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            cur = comps.setdefault(header.group(1), [])
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line) if cur is not None else None
        if m:
            cur.append(Instr(m.group(1), m.group(3), m.group(4)))
    return comps


def _called(instr):
    names = []
    for group in _CALLED.findall(instr.rest):
        names += [n.strip().lstrip("%") for n in group.strip("{}").split(",") if n.strip()]
    return names


def _computes(comps):
    """``{computation: bool}``: whether it runs compute (a kernel, a matmul), directly or through its callees."""
    memo = {}

    def runs(name, seen=()):
        if name not in memo:
            memo[name] = False if name in seen else any(_is_compute(i, lambda c: runs(c, seen + (name,)))
                                                        for i in comps.get(name, ()))
        return memo[name]
    return {name: runs(name) for name in comps}, runs


def _is_compute(instr, runs):
    if instr.op in COMPUTE_OPS:
        return True
    if instr.op == "custom-call":
        return "tpu_custom_call" in instr.rest or "mosaic" in instr.rest.lower()
    return instr.op in CALLERS and any(runs(c) for c in _called(instr))


def transfers(hlo):
    """Every collective-permute of a compiled module: a list of :class:`Transfer`."""
    comps = computations(hlo)
    _, runs = _computes(comps)
    out = []
    for comp, instrs in comps.items():
        for k, ins in enumerate(instrs):
            if ins.op == "collective-permute":
                out.append(Transfer(comp, ins.name, False, True, (), ins.backward))
            elif ins.op == "collective-permute-start":
                done = next((j for j in range(k + 1, len(instrs)) if instrs[j].op == "collective-permute-done"
                             and re.search(rf"%{re.escape(ins.name)}\b", instrs[j].rest)), len(instrs))
                between = tuple(i.name for i in instrs[k + 1:done] if _is_compute(i, runs))
                out.append(Transfer(comp, ins.name, bool(between), False, between, ins.backward))
    return out


def summary(hlo):
    """``{"transfers", "hidden", "synchronous", "exposed": [computation/start names]}`` of a compiled module, and
    ``fwd`` / ``bwd``: ``[transfers, hidden]`` of the forward's and of the backward's (``Instr.backward``)."""
    ts = transfers(hlo)
    split = {d: [sum(t.backward == b for t in ts), sum(t.hidden and t.backward == b for t in ts)]
             for d, b in (("fwd", False), ("bwd", True))}
    return dict(transfers=len(ts), hidden=sum(t.hidden for t in ts), synchronous=sum(t.synchronous for t in ts),
                exposed=[f"{t.comp}/{t.start}" for t in ts if not t.hidden]) | split


def read(program):
    """:func:`summary` of a compiled program's schedule, and its ``temp_mib`` (``memory_analysis()``)."""
    return summary(program.as_text()) | dict(temp_mib=round(program.memory_analysis().temp_size_in_bytes / 2 ** 20, 1))


def mesh_for(target):
    import jax
    import numpy as np
    from jax.experimental import topologies
    topology, config, bounds = TARGETS[target]
    devs = topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=bounds, num_slices=1,
                                        chip_config_name=config).devices
    return jax.sharding.Mesh(np.array(devs), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))


def compiled(fn, mesh, *, tokens, heads=8, kv_heads=8, dim=128, backward=True):
    """``fn(q, k, v)`` (forward; with ``backward`` its ``jax.vjp`` too) compiled for ``mesh``: global
    ``[1, N * tokens, heads, dim]`` bfloat16 sharded over ``sp``."""
    import jax
    import jax.numpy as jnp
    seq = tokens * mesh.devices.size
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((1, seq, kv_heads, dim), jnp.bfloat16, sharding=sharding)

    def f(q, k, v, do):
        if not backward:
            return fn(q, k, v)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o,) + vjp(do)
    return jax.jit(f).trace(q, k, k, q).lower().compile()


def ring_fn(mesh, **kw):
    import ringattn_fast as rf
    return lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, **kw)


def control_fn(mesh):
    """A ring whose transfers cannot hide: each step sends the previous hop's *output* as the next K and V
    and the hop reads what it received, so send, kernel, send, kernel form one chain with nothing to overlap
    (``ring_attention``'s own Pallas hop kernel, ``N - 1`` steps, unrolled)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from ringattn_fast.dispatch import kernels_for
    from ringattn_fast.schedule import HopConfig, KVShard, QShard, send_to_next
    hop_fwd = kernels_for("pallas_tpu").hop_fwd

    def shard(q, k, v):
        n, (b, s) = lax.axis_size("sp"), q.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        qs, x = QShard(q, pos), k
        for _ in range(n - 1):
            x = send_to_next(x, "sp")  # received, then used: exposed
            o_hop, _ = hop_fwd(qs, KVShard(x, x, pos), HopConfig(causal=False, scale=q.shape[-1] ** -0.5))
            x = o_hop.astype(k.dtype)  # the next send waits for this kernel
        return x
    return jax.shard_map(shard, mesh=mesh, in_specs=jax.P(None, "sp"), out_specs=jax.P(None, "sp"),
                         check_vma=False)


def cases(targets, impls, causal=(False, True)):
    """(target, impl, causal, backward) of the table, then the control on the first target."""
    for target in targets:
        for impl in impls:
            for c in causal:
                yield target, impl, c, True
    yield targets[0], "control", False, False


def check(target, impl, causal, backward, *, tokens=4096, layout="contiguous"):
    """One row: compile, parse, ``ok`` (every transfer hidden; the control: some exposed)."""
    mesh = mesh_for(target)
    fn = control_fn(mesh) if impl == "control" else ring_fn(mesh, impl=impl, causal=causal, layout=layout)
    t0 = time.perf_counter()
    program = compiled(fn, mesh, tokens=tokens, backward=backward)
    row = dict(target=target, impl=impl, causal=causal, direction="fwd+bwd" if backward else "fwd",
               compile_s=round(time.perf_counter() - t0, 1)) | read(program)
    all_hidden = row["transfers"] > 0 and row["hidden"] == row["transfers"]
    row["ok"] = (row["transfers"] > 0 and row["hidden"] == 0) if impl == "control" else all_hidden
    return row


def table(rows):
    head = ["target", "impl", "causal", "pass", "transfers", "hidden", "fwd", "bwd", "compile s", "temp MiB"]
    lines = ["".join(f"{h:>11}" for h in head)]
    for r in rows:
        cells = [r["target"], r["impl"], r["causal"], "yes" if r["ok"] else "NO", r["transfers"], r["hidden"],
                 "%d/%d" % tuple(r["fwd"][::-1]), "%d/%d" % tuple(r["bwd"][::-1]), r["compile_s"], r["temp_mib"]]
        lines.append("".join(f"{str(c):>11}" for c in cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="v5e,v6e,v5p", help=f"comma list of {','.join(TARGETS)}")
    p.add_argument("--impls", default="pallas_tpu,xla")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per chip (default 4096)")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--show-exposed", action="store_true")
    args = p.parse_args(argv)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows, t0 = [], time.perf_counter()
    for target, impl, c, bwd in cases(args.targets.split(","), args.impls.split(","), causal):
        row = check(target, impl, c, bwd, tokens=args.tokens, layout=args.layout)
        if not args.show_exposed:
            row["exposed"] = len(row["exposed"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows), file=sys.stderr)
    print(f"{len(rows)} compiles, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
