"""Benchmark: user mask and score functions against the built-ins and a dense bias, with their block mask.

    python -m benchmarks.bench --mode masks                  # 8 devices, S=8192, h=4, d=64, fp32, tiles 128
    python -m benchmarks.bench --mode masks --seq 4096 --groups documents --repeats 5

Forward+backward of ``ringattn_fast.ring_attention`` (``impl="xla"``, contiguous layout), each row
jitted, run once (the warm-up, which also gives the output), then timed round-robin for ``--repeats``
rounds in one run: the median wall time, and each row's ratio to its base row, the median over rounds
of the two times of the same round (with its range, and the same ratio of this process's CPU seconds,
which a machine shared with other work disturbs less):

- documents: packed documents of static lengths, causal inside each (``variants.documents``), given as
  a positions-only ``mask_fn`` (the ring builds its static block mask: ``ringattn_fast.block_mask``,
  skipping empty hops and tiles, running full tiles without a mask), as the same mask in a dense
  additive bias ``[1, 1, S, S]`` (0 / -inf; the base: every tile computed) and as the built-in
  ``segment_ids`` + ``causal=True`` (for reference);
- keywords: ``mask_fn=variants.causal`` vs ``causal=True``, ``mask_fn=variants.window(L, 0)`` vs
  ``window=(L, 0)``;
- variants: ``logit_softcap`` and ``sinks`` vs plain attention (no mask).

For each ``mask_fn`` row also its block mask (``ringattn_fast.block_mask.tables``, the one the ring
used): the fraction of tiles that are empty (the tile compute skipped), of the ``N * N`` hops that are
empty, and the seconds it took to compute (``BlockMask.seconds``, once per configuration, at trace
time). The expectations of issue 22 are checked on the numbers and said below the table: the
document ``mask_fn`` skips at least 60 % of the tiles and runs at least 2x faster than the bias;
each ``mask_fn`` is within 10 % of its keyword; soft-cap and sinks are within 10 % of plain attention.
One JSON object per line, then a configuration line, the markdown table and the verdicts on stderr.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import NamedTuple

import numpy as np

from . import report
from .flags import dtype_flag
from .timing import Progress, time_interleaved

GROUPS = ("documents", "keywords", "variants")
DOC_WEIGHTS = (6, 2, 4, 1, 5, 8, 3, 3)  # default documents: these 32nds of S (8 unequal documents)
MIN_SKIPPED, MIN_SPEEDUP, CLOSE = 0.60, 2.0, 0.10  # issue 22's expectations


class Case(NamedTuple):
    """One row: ``kw`` goes to ``ring_attention`` as is, ``arrays`` as arguments of the jitted function."""
    group: str
    name: str
    base: str  # the row whose time is the ratio's denominator (itself for a base row)
    kw: dict
    arrays: dict
    expect: str | None  # "faster" (at least MIN_SPEEDUP x the base) / "close" (within CLOSE) / None
    same_mask: bool  # attends the same pairs with the same logits as its base: the outputs must agree


def doc_lengths(args):
    """The documents' lengths: ``--doc-lengths``, or :data:`DOC_WEIGHTS` 32nds of the sequence."""
    if not args.doc_lengths and args.seq % 32:
        raise SystemExit(f"--seq {args.seq}: the default documents are 32nds of it; pass --doc-lengths")
    return report.doc_lengths(args.doc_lengths, args.seq, DOC_WEIGHTS)  # 32nds: exact, none left over


def documents_bias(lengths):
    """The documents' mask (causal inside each) as a dense additive bias: float32 ``[1, 1, S, S]``, 0 / -inf."""
    doc = np.repeat(np.arange(len(lengths)), lengths)  # (S,) document index of each position
    pos = np.arange(doc.size)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # (S, S)
    return np.where(allowed, np.float32(0), np.float32(-np.inf))[None, None]


def cases(args, lengths, variants):
    """The rows of the chosen groups (:class:`Case`), each group's base row first."""
    left = args.window if args.window is not None else args.seq // 8
    groups = {
        "documents": lambda: [
            Case("documents", "bias [1,1,S,S]", "bias [1,1,S,S]", {}, dict(bias=documents_bias(lengths)), None,
                 True),
            Case("documents", "mask_fn=documents", "bias [1,1,S,S]", dict(mask_fn=variants.documents(lengths)), {},
                 "faster", True),
            Case("documents", "segment_ids+causal", "bias [1,1,S,S]", dict(causal=True),
                 dict(segment_ids=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]), None, True)],
        "keywords": lambda: [
            Case("keywords", "causal=True", "causal=True", dict(causal=True), {}, None, True),
            Case("keywords", "mask_fn=causal", "causal=True", dict(mask_fn=variants.causal), {}, "close", True),
            Case("keywords", f"window=({left},0)", f"window=({left},0)", dict(window=(left, 0)), {}, None, True),
            Case("keywords", f"mask_fn=window({left},0)", f"window=({left},0)",
                 dict(mask_fn=variants.window(left, 0)), {}, "close", True)],
        "variants": lambda: [
            Case("variants", "plain", "plain", {}, {}, None, True),
            Case("variants", f"logit_softcap={args.softcap:g}", "plain", dict(logit_softcap=args.softcap), {},
                 "close", False),
            Case("variants", "sinks", "plain", {},
                 dict(sinks=np.random.default_rng(1).standard_normal(args.heads).astype(np.float32)), "close",
                 False)]}
    return [c for g in args.groups.split(",") for c in groups[g]()]


def block_mask_of(case, args, rf_block_mask):
    """The ring's own :class:`ringattn_ref.block_mask.BlockMask` of a ``mask_fn`` row (cached by the ring
    at trace time: ``tables`` of the same spec), or None."""
    if "mask_fn" not in case.kw:
        return None
    spec = rf_block_mask.spec_for(mask_fn=case.kw["mask_fn"], layout="contiguous", n=args.devices, t=args.seq,
                                  s=args.seq, q_offset=0, block_q=args.block, block_kv=args.block, heads=args.heads,
                                  causal=case.kw.get("causal", False), window=None, whole_kv=False)
    return rf_block_mask.tables(spec)


def verdicts(rows):
    """``(text, held)`` for each expectation the rows can check."""
    out = []
    for r in rows:
        if r.get("skipped_tiles") is not None and r["group"] == "documents":
            out.append((f"documents: the block mask skips >= {MIN_SKIPPED:.0%} of the tiles: "
                        f"{r['skipped_tiles']:.1%} (empty hops {r['empty_hops']:.1%})",
                        r["skipped_tiles"] >= MIN_SKIPPED))
        if r["expect"] == "faster":
            out.append((f"{r['name']} >= {MIN_SPEEDUP:g}x faster than {r['base']}: {1 / r['ratio']:.2f}x "
                        f"(cpu {1 / r['cpu_ratio']:.2f}x)", 1 / r["ratio"] >= MIN_SPEEDUP))
        elif r["expect"] == "close":
            out.append((f"{r['name']} within {CLOSE:.0%} of {r['base']}: {r['ratio']:.2f}x "
                        f"(cpu {r['cpu_ratio']:.2f}x)", abs(r["ratio"] - 1) <= CLOSE))
    return out


def table(rows):
    """A markdown table of the rows, then the verdicts. ratio: the median over rounds of the row's fwd+bwd
    wall time over its base row's in the same round (range: min-max over rounds); cpu ratio: the same of
    the process's CPU seconds."""
    pct = lambda x: "" if x is None else f"{x:.1%}"  # noqa: E731
    cols = ["fwd+bwd s", "base", "ratio", "ratio range", "cpu ratio", "expected", "skipped tiles", "empty hops",
            "block mask s", "compile s", "max diff vs base"]
    lines = ["| group | row | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in rows:
        expected = {"faster": f"<= {1 / MIN_SPEEDUP:.2f}x", "close": f"{1 - CLOSE:.2f}-{1 + CLOSE:.2f}x",
                    None: ""}[r["expect"]]
        diff = "" if r["max_diff_vs_base"] is None else f"{r['max_diff_vs_base']:.1e}"
        seconds = "" if r["block_mask_s"] is None else f"{r['block_mask_s']:.2f}"
        lines.append(f"| {r['group']} | {r['name']} | {r['fwd_bwd_s']:.3f} | {r['base']} | {r['ratio']:.2f}x | "
                     f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | {r['cpu_ratio']:.2f}x | {expected} | "
                     f"{pct(r['skipped_tiles'])} | {pct(r['empty_hops'])} | {seconds} | {r['compile_s']:.1f} | "
                     f"{diff} |")
    checks = verdicts(rows)
    lines += [""] + [f"expectation {'held' if held else 'FAILED'}: {text}" for text, held in checks]
    lines.append(f"{sum(h for _, h in checks)} of {len(checks)} expectations held (on the wall-time ratio)")
    return "\n".join(lines)


def plot(rows, path):
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1))
    colors = {g: f"C{i}" for i, g in enumerate(GROUPS)}
    ax.barh([f"{r['group']}: {r['name']}" for r in rows], [r["fwd_bwd_s"] for r in rows],
            color=[colors[r["group"]] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("fwd+bwd seconds (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def timed_rounds(jobs, repeats):
    """``(wall, cpu)``, each float ``[jobs, repeats]``: every round times the jobs round-robin once
    (``time_interleaved``) and this process's CPU seconds of each job (``time.process_time``, all threads):
    on a machine shared with other work the CPU seconds move less with the load than the wall time."""
    import jax
    cpu = [[] for _ in jobs]

    def with_cpu(job, seconds):
        def run():
            start = time.process_time()
            result = jax.block_until_ready(job())
            seconds.append(time.process_time() - start)
            return result
        return run

    timed = [with_cpu(job, seconds) for job, seconds in zip(jobs, cpu)]
    wall = [time_interleaved(timed, 1) for _ in range(repeats)]
    return np.array(wall).T, np.array(cpu)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench --mode masks",
                                description=__doc__.split("\n")[0], formatter_class=report.HelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = ring size")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--seq", type=int, default=8192, help="sequence length in tokens (a multiple of devices x block)")
    p.add_argument("--heads", type=int, default=4, help="query heads (= K/V heads)")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="input dtype",
                   type=dtype_flag(["float32", "bfloat16"]))
    p.add_argument("--block", type=int, default=128, help="block_q = block_kv, the tile side")
    p.add_argument("--doc-lengths", default=None,
                   help="the documents' lengths, comma list summing to --seq (omitted: 8 documents of "
                        f"{'/'.join(map(str, DOC_WEIGHTS))} 32nds of --seq)")
    p.add_argument("--window", type=int, default=None, help="L of window=(L, 0) (omitted: seq / 8)")
    p.add_argument("--softcap", type=float, default=30.0, help="logit_softcap of the variants group")
    p.add_argument("--groups", default=",".join(GROUPS), help="comma list of " + ", ".join(GROUPS))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up; the median is kept")
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--plot", help="save a bar chart of the fwd+bwd times to this image file")
    args = p.parse_args(argv)
    bad = [g for g in args.groups.split(",") if g not in GROUPS]
    if bad:
        p.error(f"unknown group {bad[0]!r}; choose from {', '.join(GROUPS)}")
    return args


def config(args, lengths):
    """The configuration line's items (:func:`report.config_line`)."""
    return dict(mode="masks", devices=args.devices, batch=args.batch, seq=report.length_label(args.seq),
                heads=args.heads, dim=args.dim, dtype=args.dtype, impl="xla", layout="contiguous",
                blocks=f"{args.block}x{args.block}", docs="/".join(map(str, lengths)),
                window=args.window if args.window is not None else args.seq // 8, softcap=args.softcap,
                repeats=args.repeats, groups=args.groups)


def main(argv=None):
    args = parse_args(argv)
    lengths = doc_lengths(args)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp

    import ringattn_fast as rf
    from ringattn_fast import block_mask as rf_block_mask
    from ringattn_ref import variants

    mesh = rf.make_mesh(args.devices)
    on = lambda *spec: jax.sharding.NamedSharding(mesh, jax.P(*spec))  # noqa: E731
    shard = {"bias": on(None, None, "sp"), "segment_ids": on(None, "sp"), "sinks": on()}
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v, do = (jax.device_put(jnp.asarray(rng.standard_normal(shape), args.dtype), on(None, "sp"))
                   for _ in range(4))
    common = dict(mesh=mesh, impl="xla", block_q=args.block, block_kv=args.block)
    todo = cases(args, lengths, variants)
    progress = Progress(len(todo) + 1)
    found, jobs, outputs = [], [], {}
    for case in todo:

        def fwd_bwd(q, k, v, do, arrays, kw=case.kw):
            o, vjp = jax.vjp(lambda q, k, v: rf.ring_attention(q, k, v, **common, **kw, **arrays), q, k, v)
            return o, vjp(do)

        arrays = {name: jax.device_put(jnp.asarray(x), shard[name]) for name, x in case.arrays.items()}
        start = time.perf_counter()
        compiled = jax.jit(fwd_bwd).lower(q, k, v, do, arrays).compile()
        compile_s = time.perf_counter() - start
        outputs[case.name] = np.asarray(compiled(q, k, v, do, arrays)[0], np.float64)  # also the warm-up
        bm = block_mask_of(case, args, rf_block_mask)
        found.append(dict(group=case.group, name=case.name, base=case.base, expect=case.expect,
                          devices=args.devices, batch=args.batch, seq=args.seq, heads=args.heads, dim=args.dim,
                          dtype=args.dtype, block=args.block, compile_s=compile_s,
                          skipped_tiles=None if bm is None else bm.skipped_fraction,
                          empty_hops=None if bm is None else bm.empty_hop_fraction,
                          block_mask_s=None if bm is None else bm.seconds,
                          tile_counts=None if bm is None else bm.tile_counts()))
        jobs.append(partial(compiled, q, k, v, do, arrays))
        progress.step(f"{case.name} compiled")
    wall, cpu = timed_rounds(jobs, args.repeats)  # (rows, rounds) seconds
    progress.step(f"timed ({args.repeats} rounds)")
    index = {case.name: i for i, case in enumerate(todo)}
    out = report.open_rows(args.out)
    rows = []
    for i, (case, r) in enumerate(zip(todo, found)):
        b = index[case.base]
        same = case.same_mask and i != b
        diff = float(np.abs(outputs[case.name] - outputs[case.base]).max()) if same else None
        ratios = wall[i] / wall[b]  # per round: the row's time over its base's in the same round
        rows.append(dict(r, fwd_bwd_s=float(np.median(wall[i])), ratio=float(np.median(ratios)),
                         ratio_min=float(ratios.min()), ratio_max=float(ratios.max()),
                         cpu_s=float(np.median(cpu[i])), cpu_ratio=float(np.median(cpu[i] / cpu[b])),
                         wall_rounds=wall[i].tolist(), cpu_rounds=cpu[i].tolist(), max_diff_vs_base=diff))
        report.emit(rows[-1], out)
    report.finish(rows, out, args, table, plot, config(args, lengths))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
