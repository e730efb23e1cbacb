"""Benchmark: the three ways to split attention over the sequence, side by side.

    python -m benchmarks.bench --mode strategies                  # 8 devices, S=8192, h=4, d=64, fp32
    python -m benchmarks.bench --mode strategies --seqs 2048,4096,8192,16384,32768 --out s.jsonl --plot s.png

For ``ring`` (``ring_attention``), ``allgather`` (``allgather_attention``), ``ulysses``
(``ulysses_attention``, skipped when the heads do not split over the devices) and ``hybrid``
(``hybrid_attention`` on a ``ring x ulysses`` mesh of the same devices, ``--ulysses-size``), at each sequence
length: the median wall time of the jitted forward+backward (round-robin, compilation excluded), XLA's
per-device temp bytes (``memory_analysis().temp_size_in_bytes``), the bytes each device sends,
**measured from the compiled program** (:func:`collective_bytes`), and the bytes a simple model
predicts: for the forward alone ``ringattn_ref.strategy_cost`` (the reference side's model of all
three, :func:`reference_model`), for forward+backward :func:`predicted_bytes`; and the max
difference of the output from the ring's. Time, temp memory and bytes sent are also shown relative to
the ring at the same length, measured in the same run. One JSON object per line, a configuration
line and a markdown table on stderr.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from functools import partial

import numpy as np

from . import report
from .flags import dtype_flag
from .timing import Progress, time_interleaved

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
KINDS = ("collective-permute", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(KINDS) + r")\(")


def _arrays(type_text):
    """``(dtype, shape)`` of each array in an HLO result type (one array, or a tuple of them)."""
    return [(t, tuple(int(n) for n in dims.split(",") if n)) for t, dims in _ARRAY.findall(type_text)]


def _nbytes(dtype, shape):
    return ELEMENT_BYTES[dtype] * int(np.prod(shape, dtype=np.int64))


def collective_bytes(hlo_text, n, *, loop_trips=1, by_shape=False):
    """Bytes one device sends, summed over the collectives of a compiled program's text.

    ``compiled.as_text()`` of a ``shard_map`` over an axis of size ``n``. Per collective, from its
    result type: collective-permute sends its operand; all-gather ``(n-1)`` operands (operand = result
    / n); all-to-all and reduce-scatter ``(n-1)/n`` of their input; all-reduce ``2 (n-1)/n``
    (the ring algorithm). A collective inside a while body (the ring's loop) counts ``loop_trips``
    times: its trip count is hidden from XLA (``schedule.ring_loop``), so pass it: ``N - 1``, or
    ``(N - 1, N - 2)`` for a forward+backward program, whose backward loop runs ``N - 2`` times
    (``ring_backward`` peels its first and last steps; a backward op is one JAX named under ``transpose(``).
    ``by_shape``: a dict ``(kind, dtype, shape) -> bytes`` instead of the total (shape: the operand's
    for all-gather and collective-permute, the result's, or its first piece's, otherwise).
    """
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    sent, computation = defaultdict(float), None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header and " = " not in line:
            computation = header.group(1)
            continue
        op = _OP.match(line)
        if not op:
            continue
        arrays, kind = _arrays(op.group(1)), op.group(2)
        dtype, shape = arrays[0]
        total = sum(_nbytes(t, s) for t, s in arrays)
        if kind == "collective-permute":
            nbytes = total
        elif kind == "all-gather":
            dim = int(re.search(r"dimensions=\{(\d+)\}", line).group(1))
            shape = shape[:dim] + (shape[dim] // n,) + shape[dim + 1:]
            nbytes = (n - 1) * total / n
        elif kind in ("all-to-all", "reduce-scatter"):
            nbytes = (n - 1) * total / n * (n if kind == "reduce-scatter" else 1)
        else:
            nbytes = 2 * (n - 1) * total / n
        if computation in bodies:
            fwd_trips, bwd_trips = loop_trips if isinstance(loop_trips, tuple) else (loop_trips, loop_trips)
            nbytes *= bwd_trips if re.search(r'op_name="[^"]*transpose\(', line) else fwd_trips
        sent[(kind, dtype, shape)] += nbytes
    return dict(sent) if by_shape else float(sum(sent.values()))


def predicted_bytes(strategy, *, n, batch, seq, heads, kv_heads, dim, dtype_bytes, acc_bytes=4, ulysses=None):
    """Bytes one device sends in one forward+backward, from the algorithms (K/V, q, o and gradients
    only; positions and segment ids left out).

    ring: K/V ``N - 1`` times forward and backward, dK/dV (float32 accumulators) ``N`` times;
    allgather: K/V gathered once (``N - 1`` shards: with forward and backward in one program XLA
    reuses the forward's gather instead of gathering again, measured) and dK/dV reduce-scattered
    (``N - 1`` float32 shards); ulysses: ``(N-1)/N`` of q, o, dO, dQ and of K, V, dK, dV (kv heads
    repeated ``N / gcd(kv_heads, N)`` times); hybrid (``ulysses`` = U of the ``n`` devices): Ulysses's
    bytes over U, then the ring's over ``R = n / U`` on ``S/R`` tokens of ``heads/U`` heads (kv heads
    repeated ``U / gcd(kv_heads, U)`` times first).
    """
    if strategy == "hybrid":
        u, r = ulysses, n // ulysses
        rep = u // np.gcd(kv_heads, u)
        a2a = predicted_bytes("ulysses", n=u, batch=batch, seq=seq * u // n, heads=heads, kv_heads=kv_heads,
                              dim=dim, dtype_bytes=dtype_bytes, acc_bytes=acc_bytes)
        ring = predicted_bytes("ring", n=r, batch=batch, seq=seq, heads=heads // u, kv_heads=kv_heads * rep // u,
                               dim=dim, dtype_bytes=dtype_bytes, acc_bytes=acc_bytes) if r > 1 else 0
        return a2a + ring
    local = batch * seq // n * dim  # elements per head of one host's shard
    kv = 2 * local * kv_heads * dtype_bytes
    grads = 2 * local * kv_heads * acc_bytes
    if strategy == "ring":
        return 2 * (n - 1) * kv + n * grads
    if strategy == "allgather":
        return (n - 1) * kv + (n - 1) * grads
    r = n // np.gcd(kv_heads, n)
    return (n - 1) / n * (4 * local * heads * dtype_bytes + 2 * r * kv)


def reference_model(strategy, *, n, batch, seq, heads, kv_heads, dim, dtype_bytes, ulysses=None):
    """``(bytes sent, peak bytes)`` per device of one **forward** from ``ringattn_ref``'s cost model of
    the three strategies (``strategy_cost.strategy_costs``), or None where it has none (Ulysses
    with heads not divisible by the devices)."""
    from ringattn_ref.strategy_cost import strategy_costs
    split = dict(ulysses_size=ulysses) if strategy == "hybrid" else {}
    cost = strategy_costs(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=n, hardware="A100 NVLink",
                          batch=batch, dtype_bytes=dtype_bytes, **split)[strategy]
    return (float(cost.bytes_sent), float(cost.peak_bytes)) if cost.feasible else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench --mode strategies",
                                description=__doc__.split("\n")[0], formatter_class=report.HelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = ring size")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--seqs", default="8192", help="sequence lengths in tokens, comma list")
    p.add_argument("--heads", type=int, default=4, help="query heads (Ulysses needs a multiple of --devices)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (omitted: --heads)")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="input dtype",
                   type=dtype_flag(["float32", "bfloat16"]))
    p.add_argument("--causal", default="false", choices=["true", "false"], help="causal mask")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is kept")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of " + ", ".join(STRATEGIES))
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="the hybrid's Ulysses degree U (omitted: the largest divisor of --heads and --devices "
                        "below --devices, so the ring has >= 2 groups)")
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--plot", help="save a figure (time, memory, bytes vs seq) to this image file")
    return p.parse_args(argv)


RATIOS = (("fwd_bwd_s", "fwd+bwd"), ("temp_fwd_bwd_bytes", "temp fwd+bwd"), ("sent_bytes", "sent fwd+bwd"))


def table(rows):
    """A markdown table of the rows (MiB per device; "model": see :func:`reference_model` and
    :func:`predicted_bytes`), with fwd+bwd time, temp memory and bytes sent relative to the ring (or,
    without it, to the first strategy run) at the same length."""
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    ran = [r for r in rows if not r.get("skipped")]
    base = "ring" if any(r["strategy"] == "ring" for r in ran) else ran[0]["strategy"] if ran else "ring"
    cols = ["fwd+bwd s", f"fwd+bwd vs {base}", "temp fwd / fwd+bwd MiB", f"temp fwd+bwd vs {base}",
            "model peak fwd MiB", "sent fwd MiB: measured / model", "sent fwd+bwd MiB: measured / model",
            f"sent fwd+bwd vs {base}", "max diff vs ring"]
    lines = ["| S | strategy | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {report.length_label(r['seq'])} | {r['strategy']} | n/a: {r['skipped']} |"
                         + " |" * (len(cols) - 1))
            continue
        ref = next((b for b in ran if b["strategy"] == base and b["seq"] == r["seq"]), None)
        vs = {key: report.ratio(r[key], ref and ref[key]) for key, _ in RATIOS}
        lines.append(f"| {report.length_label(r['seq'])} | {r['strategy']} | {r['fwd_bwd_s']:.3f} | "
                     f"{vs['fwd_bwd_s']} | "
                     f"{r['temp_fwd_bytes'] / 2**20:.1f} / {r['temp_fwd_bwd_bytes'] / 2**20:.1f} | "
                     f"{vs['temp_fwd_bwd_bytes']} | {r['fwd_predicted_peak_bytes'] / 2**20:.1f} | "
                     f"{mib(r['fwd_sent_bytes'])} / {mib(r['fwd_predicted_bytes'])} | {mib(r['sent_bytes'])} / "
                     f"{mib(r['predicted_bytes'])} | {vs['sent_bytes']} | {r['max_diff_vs_ring']:.1e} |")
    return "\n".join(lines)


def config(args, seqs, kv_heads):
    """The configuration line's items (:func:`report.config_line`)."""
    return dict(mode="strategies", devices=args.devices, batch=args.batch, seq=report.lengths_label(seqs),
                heads=args.heads, kv_heads=kv_heads, dim=args.dim, dtype=args.dtype, causal=args.causal,
                blocks="default", repeats=args.repeats, strategies=args.strategies)


def plot(rows, path):
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name in STRATEGIES:
        rs = [r for r in rows if r["strategy"] == name and not r.get("skipped")]
        if not rs:
            continue
        s = [r["seq"] for r in rs]
        axes[0].plot(s, [r["fwd_bwd_s"] for r in rs], "o-", label=name)
        axes[1].plot(s, [r["temp_fwd_bwd_bytes"] / 2**20 for r in rs], "o-", label=name)
        line, = axes[2].plot(s, [r["sent_bytes"] / 2**20 for r in rs], "o-", label=f"{name} measured")
        axes[2].plot(s, [r["predicted_bytes"] / 2**20 for r in rs], "x--", color=line.get_color(),
                     label=f"{name} model")
    for ax, label in zip(axes, ("fwd+bwd seconds (median)", "temp MiB per device", "MiB sent per device")):
        report.log2_length_axis(ax, [r["seq"] for r in rows], "sequence length (tokens)")
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp

    import ringattn_fast as rf

    names = args.strategies.split(",")
    seqs = [int(s) for s in args.seqs.split(",")]
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    mesh, n, causal = rf.make_mesh(args.devices), args.devices, args.causal == "true"
    u = args.ulysses_size or max([d for d in range(1, n) if n % d == 0 and args.heads % d == 0] or [1])
    mesh2 = jax.make_mesh((n // u, u), ("ring", "ulysses"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fns = {"ring": partial(rf.ring_attention, mesh=mesh), "allgather": partial(rf.allgather_attention, mesh=mesh),
           "ulysses": partial(rf.ulysses_attention, mesh=mesh), "hybrid": partial(rf.hybrid_attention, mesh=mesh2)}
    ring = {"hybrid": n // u}  # the ring's length, if not n
    group = {"hybrid": u}  # the collectives' group size, if not n
    sharded = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    progress = Progress(len(seqs) * (len(names) + 1))
    out = report.open_rows(args.out)
    rows = []
    for seq in seqs:
        rng = np.random.default_rng(0)
        shapes = [(args.batch, seq, h, args.dim) for h in (args.heads, kv_heads, kv_heads, args.heads)]
        q, k, v, do = (jax.device_put(jnp.asarray(rng.standard_normal(s), args.dtype), sharded) for s in shapes)
        jobs, found, outputs = [], {}, {}
        for name in names:
            base = dict(strategy=name, devices=n, batch=args.batch, seq=seq, heads=args.heads, kv_heads=kv_heads,
                        dim=args.dim, dtype=args.dtype, causal=causal)
            if name == "ulysses" and args.heads % n:
                rows.append(dict(base, skipped=f"heads {args.heads} % devices {n} != 0"))
                progress.step(f"S={seq} {name} skipped")
                continue
            if name == "hybrid":
                base["split"] = f"{n // u} ring x {u} ulysses"

            def fwd_bwd(q, k, v, do, fn=fns[name]):
                o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=causal), q, k, v)
                return o, vjp(do)

            shape = dict(n=n, batch=args.batch, seq=seq, heads=args.heads, kv_heads=kv_heads, dim=args.dim,
                         dtype_bytes=jnp.dtype(args.dtype).itemsize, **({"ulysses": u} if name == "hybrid" else {}))
            fwd = jax.jit(lambda q, k, v, fn=fns[name]: fn(q, k, v, causal=causal)).lower(q, k, v).compile()
            compiled = jax.jit(fwd_bwd).lower(q, k, v, do).compile()
            ref_sent, ref_peak = reference_model(name, **shape)
            coll, r = group.get(name, n), ring.get(name, n)
            outputs[name] = np.asarray(compiled(q, k, v, do)[0], np.float64)  # also the warm-up run
            found[name] = dict(base, temp_fwd_bytes=int(fwd.memory_analysis().temp_size_in_bytes),
                               temp_fwd_bwd_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                               fwd_sent_bytes=collective_bytes(fwd.as_text(), coll, loop_trips=r - 1),
                               fwd_predicted_bytes=ref_sent, fwd_predicted_peak_bytes=ref_peak,
                               sent_bytes=collective_bytes(compiled.as_text(), coll, loop_trips=(r - 1, r - 2)),
                               predicted_bytes=float(predicted_bytes(name, **shape)))
            jobs.append(partial(compiled, q, k, v, do))
            progress.step(f"S={seq} {name} compiled")
        medians = time_interleaved(jobs, args.repeats)
        progress.step(f"S={seq} timed ({args.repeats} rounds)")
        ref_o = outputs.get("ring")
        for name, t in zip(found, medians):
            diff = float("nan") if ref_o is None else float(np.abs(outputs[name] - ref_o).max())
            rows.append(dict(found[name], fwd_bwd_s=t, max_diff_vs_ring=diff))
        for r in rows[-len(names):]:
            report.emit(r, out)
    report.finish(rows, out, args, table, plot, config(args, seqs, kv_heads))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
