"""TPU benchmark: ours on a ring of one chip vs Pallas splash attention vs ``jax.nn`` (XLA), in one run.

    python -m benchmarks.bench_tpu                               # a TPU: S 8K-32K, causal and not, 8 and 32/8 heads
    python -m benchmarks.bench_tpu --block-q 1024 --block-kv 1024    # ours at these tiles too
    python -m benchmarks.bench_tpu --dry-run                     # no TPU: tiny shapes, kernels interpreted (CI)

(from the repository root). Every row is one (seq, heads, causal) problem, batch 1, d = 128, bfloat16
(``--dtype``, ``--dim``), heads ``8`` (8 query and 8 kv heads) and ``32/8`` (grouped-query), on one chip:

- **ours**: the public ``ring_attention(q, k, v, mesh=make_mesh(1), causal=...)`` with no ``impl`` (a
  ring of one: the per-hop Pallas TPU kernel at its default tiles, ``kernels/pallas_tpu.py``), and with
  ``--block-q/--block-kv`` the same call with ``impl="pallas_tpu"`` at those tiles;
- **native**: the same call on ``[b, s, h * d]`` arrays, reshaped to ``[b, s, h, d]`` and back inside the
  program: the kernels' own layout, as splash gets its own (on a TPU ``[b, s, h, d]`` is tiled over (h, d),
  so from it every operand and gradient is a relayout copy, up to 4 % of an 8K-token forward+backward;
  from ``[b, s, h * d]``, the layout of a projection's output, XLA folds the reshapes away);
- **fused**: the fused ring's kernel itself (``fused_ring_attention_shard`` in a ``shard_map`` of one
  device, at the tiles ``ring_attention`` gives it on a larger ring, ``pallas_tpu_fused.default_blocks``;
  ``ring_attention`` runs a ring of one as one hop instead);
- **splash**: ``splash_attention_kernel.make_splash_mha_single_device`` (vmapped over the batch) in its own
  layout, ``[heads, seq, dim]`` with q pre-scaled, prepared outside the timed call; each of
  ``--splash-blocks`` (every block size of ``BlockSizes`` set to it) and, at the largest, its fused
  dK/dV/dQ backward; the fastest is its column ("best blocks in the same run");
- **xla**: ``jax.nn.dot_product_attention(..., implementation="xla")`` where it fits (else the row says why).

Times: median of ``--repeats`` calls after a warm-up, interleaved (``benchmarks.timing``), of the forward
(o) and of the forward+backward (``jax.vjp``: o, dq, dk, dv); TFLOP/s as FlashAttention-2 counts them
(forward ``4 b h s^2 d``, halved when causal; forward+backward 3.5x). Memory: ``temp_size_in_bytes`` of
the compiled forward+backward (``memory_analysis()``) of ours and of splash called on ``[b, s, h, d]``
arrays as ours is (its transposes and the pre-scaling in the program: what a caller with our layout
pays; its own-layout figure is in the JSON). The error column: max |o - o_splash| and |dq - dq_splash|
(float32) over the bfloat16 outputs. "vs bshd": ours over splash's best *timed* from ``[b, s, h, d]`` (its
transposes and q's scaling in the timed program: what a caller of our layout runs). A table goes to stderr, one JSON object per row to stdout.
Exits 0, or 2 without a TPU (and no ``--dry-run``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

from .bench_gpu import _ints, _one_line, attention_flops
from .flags import dtype_flag
from .timing import time_interleaved

KINDS = ("ours", "native", "tiles", "fused", "splash", "xla")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, kernels interpreted (no TPU)")
    p.add_argument("--seqs", type=_ints, help="comma list of sequence lengths (default 8192,16384,32768)")
    p.add_argument("--heads", help="comma list of H or H/Hkv (default 8,32/8)")
    p.add_argument("--dim", type=int, help="head dim (default 128)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", type=dtype_flag(["bfloat16", "float32"]))
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--block-q", type=int, help="ours also with impl='pallas_tpu' at these tiles")
    p.add_argument("--block-kv", type=int, help="(default: as --block-q)")
    p.add_argument("--splash-blocks", type=_ints, help="splash block sizes to try (default 512,1024)")
    p.add_argument("--no-fused", action="store_true", help="skip the fused kernel column")
    p.add_argument("--no-xla", action="store_true", help="skip the jax.nn column")
    p.add_argument("--repeats", type=int, help="timed calls, median kept (default 5; dry run 1)")
    p.add_argument("--interleave", action="store_true",
                   help="also time every kind's fwd+bwd interleaved with the others' (ratios free of drift between kinds)")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the rows left after this many seconds")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.seqs = args.seqs or ([256] if dry else [8192, 16384, 32768])
    args.heads = [_heads(x, p) for x in (args.heads or ("2,4/2" if dry else "8,32/8")).split(",")]
    args.dim = args.dim or 128
    args.splash_blocks = args.splash_blocks or ([128] if dry else [512, 1024])
    args.repeats = (1 if dry else 5) if args.repeats is None else args.repeats
    if args.block_kv and not args.block_q:
        p.error("--block-kv needs --block-q")
    args.block_kv = args.block_kv or args.block_q
    for name in ("dim", "block_q", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def _heads(text, parser):
    h, _, hk = text.partition("/")
    try:
        h, hk = int(h), int(hk or h)
    except ValueError:
        parser.error(f"--heads: expected H or H/Hkv; got {text!r}")
    if h < 1 or hk < 1 or h % hk:
        parser.error(f"--heads: H must be a positive multiple of Hkv; got {text!r}")
    return h, hk


def _fwd_bwd(attn):
    """(forward, forward+backward) jitted from ``attn(q, k, v) -> o``; both take (q, k, v, do)."""
    import jax

    def both(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o,) + vjp(do)
    return jax.jit(lambda q, k, v, do: attn(q, k, v)), jax.jit(both)


def splash_kernel(seq, heads, *, causal, block=1024, fused_bwd=True, interpret=False):
    """Splash attention as the TPU scripts run it: ``make_splash_mha_single_device`` vmapped over the batch,
    on its own ``[b, h, s, d]`` layout (q pre-scaled), a causal or full mask on every head, every block
    ``min(block, seq)``, with its fused backward or with dQ blocks of that side."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    b = min(block, seq)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=None if fused_bwd else b,
                          block_kv_dq=None if fused_bwd else b, use_fused_bwd_kernel=fused_bwd)
    mask = sm.MultiHeadMask([(sm.CausalMask if causal else sm.FullMask)((seq, seq))] * heads)
    return jax.vmap(sk.make_splash_mha_single_device(mask=mask, block_sizes=sizes, interpret=interpret))


def fused_on_one_chip(mesh, causal, q_shape, k_shape, dtype, interpret=None):
    """The fused ring's kernels on a ring of one, differentiable, ``(q, k, v) -> o``: ``fused_ring_attention_shard``
    in a ``shard_map`` over ``mesh`` (one device), at the tiles ``ring_attention`` gives it on a larger ring
    (``pallas_tpu_fused.default_blocks``; None when interpreted); ``ring_attention`` runs a ring of one as one
    hop of the per-hop kernel instead. ``check_vma`` is off: interpreted, the positions made inside would fail it."""
    import jax
    import jax.numpy as jnp
    from ringattn_fast.kernels import pallas_tpu_fused
    from ringattn_fast.schedule import HopConfig, KVShard, QShard
    tiles = pallas_tpu_fused.default_blocks(q_shape, k_shape, dtype, mesh.devices.flat[0], n=1) or (None, None)

    def fused(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32)[None], q.shape[:2])
        return pallas_tpu_fused.fused_ring_attention_shard(
            QShard(q, pos), KVShard(k, v, pos), HopConfig(causal=causal, block_q=tiles[0], block_kv=tiles[1]),
            axis_name="sp", interpret=interpret)
    spec = jax.P(None, "sp")
    return jax.shard_map(fused, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


def functions(args, seq, h, hk, causal):
    """{kind: (fwd, fwd_bwd, temp_of)} of one row; every function takes (q, k, v, do) in [b, s, h, d]."""
    import jax
    import jax.numpy as jnp

    import ringattn_fast as rf

    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    ours = dict(impl="pallas_tpu") if args.dry_run else {}  # on a CPU "auto" would pick the XLA hop
    out = {"ours": _fwd_bwd(partial(rf.ring_attention, mesh=mesh, causal=causal, **ours))}

    def native(q, k, v):  # [b, s, h * d] in and out
        heads = lambda x: x.reshape(x.shape[:2] + (-1, args.dim))  # noqa: E731
        o = rf.ring_attention(heads(q), heads(k), heads(v), mesh=mesh, causal=causal, **ours)
        return o.reshape(o.shape[:2] + (-1,))
    out["native"] = _fwd_bwd(native)
    if args.block_q:
        out["tiles"] = _fwd_bwd(partial(rf.ring_attention, mesh=mesh, causal=causal, impl="pallas_tpu",
                                        block_q=args.block_q, block_kv=args.block_kv))
    if not args.no_fused:
        out["fused"] = _fwd_bwd(fused_on_one_chip(mesh, causal, (1, seq, h, args.dim), (1, seq, hk, args.dim),
                                                  jnp.dtype(args.dtype)))
    scale = args.dim ** -0.5
    for blk in args.splash_blocks:
        for fused_bwd in (False, True) if blk == max(args.splash_blocks) and not args.dry_run else (False,):
            b = min(blk, seq)
            kernel = splash_kernel(seq, h, causal=causal, block=blk, fused_bwd=fused_bwd,
                                   interpret=args.dry_run)  # [b, h, s, d]
            t = lambda x: x.swapaxes(1, 2)  # noqa: E731
            native = _fwd_bwd(kernel)
            bshd = _fwd_bwd(lambda q, k, v, kernel=kernel: t(kernel(t(q * scale), t(k), t(v))))
            out[f"splash{b}{'f' if fused_bwd else ''}"] = native + bshd
    if not args.no_xla:
        out["xla"] = _fwd_bwd(partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla"))
    return out


def temp_mib(fn, data):
    """``temp_size_in_bytes`` of ``fn`` compiled for ``data``, in MiB."""
    return fn.lower(*data).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


def run_row(args, seq, h, hk, causal):
    """One row: TFLOP/s, temp MiB and errors of every kind; a JSON-able dict."""
    import jax
    import jax.numpy as jnp

    dtype, d = jnp.dtype(args.dtype), args.dim
    keys = jax.random.split(jax.random.key(seq + 7 * h + causal), 4)
    q, k, v, do = (jax.random.normal(key, (1, seq, n, d), jnp.float32).astype(dtype)
                   for key, n in zip(keys, (h, hk, hk, h)))
    flops_fwd, flops_fb = attention_flops(1, h, seq, d, causal)
    row = dict(seq=seq, heads=h, kv_heads=hk, dim=d, dtype=args.dtype, causal=causal, device=jax.devices()[0].device_kind,
               tflops={}, ms={}, temp_mib={}, errors={})
    fns = functions(args, seq, h, hk, causal)
    native = lambda x: x.swapaxes(1, 2)  # noqa: E731
    flat = lambda x: x.reshape(x.shape[:2] + (-1,))  # noqa: E731
    inputs, calls = {}, {}
    for kind, (fwd, fb, *bshd) in fns.items():
        data = ((native(q * d ** -0.5), native(k), native(v), native(do)) if kind.startswith("splash") else
                tuple(flat(x) for x in (q, k, v, do)) if kind == "native" else (q, k, v, do))
        try:
            outs = jax.block_until_ready(fb(*data))
            t_fwd, t_fb = time_interleaved([partial(fwd, *data), partial(fb, *data)], args.repeats, 1)
        except Exception as e:  # out of memory (xla), a shape a kernel refuses: say so, go on
            row["errors"][kind] = _one_line(e)
            continue
        if kind.startswith("splash"):  # back to [b, s, h, d]; its dq is of the pre-scaled q
            outs = (native(outs[0]), native(outs[1]) * d ** -0.5) + tuple(native(x) for x in outs[2:])
        if kind == "native":
            outs = tuple(x.reshape(x.shape[:2] + (-1, d)) for x in outs)
        inputs[kind], calls[kind] = outs, partial(fb, *data)
        row["ms"][kind] = (1e3 * t_fwd, 1e3 * t_fb)
        row["tflops"][kind] = (flops_fwd / t_fwd / 1e12, flops_fb / t_fb / 1e12)
        row["temp_mib"][kind] = temp_mib(fb, data)
        if bshd:  # the same splash call from [b, s, h, d]: its transposes and q's scaling timed too
            b_fwd, b_fb = bshd
            jax.block_until_ready(b_fb(q, k, v, do))
            t_bfwd, t_bfb = time_interleaved([partial(b_fwd, q, k, v, do), partial(b_fb, q, k, v, do)], args.repeats, 1)
            row["ms"][kind + "_bshd"] = (1e3 * t_bfwd, 1e3 * t_bfb)
            calls[kind + "_bshd"] = partial(b_fb, q, k, v, do)
            row["tflops"][kind + "_bshd"] = (flops_fwd / t_bfwd / 1e12, flops_fb / t_bfb / 1e12)
            row["temp_mib"][kind + "_bshd"] = temp_mib(b_fb, (q, k, v, do))
    splash = [kind for kind in row["tflops"] if kind.startswith("splash") and not kind.endswith("_bshd")]
    if splash:
        best = max(splash, key=lambda kind: row["tflops"][kind][1])
        row["splash_best"] = best
        for kind in ("ours", "native", "tiles", "fused"):
            if kind in row["tflops"]:
                row[f"ratio_{kind}"] = row["tflops"][kind][1] / row["tflops"][best][1]
                ref = inputs[best]
                row["max_err"] = row.get("max_err", {}) | {kind: [float(jnp.max(jnp.abs(
                    a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(inputs[kind][:2], ref[:2])]}
        bshd = [kind for kind in row["tflops"] if kind.endswith("_bshd")]
        if bshd and "ours" in row["tflops"]:  # against splash as a caller of our layout runs it
            best_bshd = max(bshd, key=lambda kind: row["tflops"][kind][1])
            row["splash_best_bshd"] = best_bshd
            row["ratio_ours_bshd"] = row["tflops"]["ours"][1] / row["tflops"][best_bshd][1]
        row["mem_ratio"] = row["temp_mib"].get("ours", 0) / max(row["temp_mib"].get(best + "_bshd", 0), 1e-9)
    if args.interleave and calls:
        interleaved(row, calls, args.repeats)
    return row


def interleaved(row, calls, repeats):
    """``--interleave``: every kind's fwd+bwd timed in one interleaved loop (``benchmarks.timing``), so a drift
    of the chip between kinds cannot move their ratios: ``ms_interleaved`` and, against the fastest splash of
    that loop, ``ratio_interleaved`` (ours, native, fused; ``ours_bshd``: ours over splash from [b, s, h, d])."""
    names = list(calls)
    times = dict(zip(names, (1e3 * t for t in time_interleaved([calls[n] for n in names], repeats, 1))))
    row["ms_interleaved"] = times
    fastest = lambda kinds: min(kinds, key=times.get) if kinds else None  # noqa: E731
    own = fastest([n for n in names if n.startswith("splash") and not n.endswith("_bshd")])
    bshd = fastest([n for n in names if n.startswith("splash") and n.endswith("_bshd")])
    ratios = {kind: times[own] / times[kind] for kind in ("ours", "native", "tiles", "fused") if own and kind in times}
    if bshd and "ours" in times:
        ratios["ours_bshd"] = times[bshd] / times["ours"]
    row["ratio_interleaved"] = ratios


HEADER = (f"{'seq':>6} {'heads':>5} {'causal':>6} | {'ours':>6} {'native':>6} {'tiles':>6} {'fused':>6} {'splash':>6} "
          f"{'xla':>6} | {'ours/spl':>8} {'nat/spl':>7} {'tiles/spl':>9} {'vs bshd':>7} | {'MiB ours':>8} {'splash':>7} "
          f"{'ratio':>5} | splash best")


def format_row(row):
    """One line: fwd+bwd TFLOP/s of each kind, ours / splash, temp MiB ours / splash (its [b, s, h, d] call)."""
    head = f"{row['seq']:>6} {str(row['heads']) + '/' + str(row['kv_heads']):>5} {str(row['causal']):>6} | "
    if "skipped" in row or "error" in row:
        return head + row.get("skipped", f"FAILED: {row.get('error')}")
    tf = lambda kind: f"{row['tflops'][kind][1]:6.1f}" if kind in row["tflops"] else f"{'-':>6}"  # noqa: E731
    best = row.get("splash_best")
    ratio = lambda kind: f"{row[f'ratio_{kind}']:.2f}" if f"ratio_{kind}" in row else "-"  # noqa: E731
    mem = row["temp_mib"]
    return (f"{head}{tf('ours')} {tf('native')} {tf('tiles')} {tf('fused')} {tf(best) if best else f'{chr(45):>6}'} "
            f"{tf('xla')} | {ratio('ours'):>8} {ratio('native'):>7} {ratio('tiles'):>9} {ratio('ours_bshd'):>7} | "
            f"{mem.get('ours', 0):8.0f} "
            f"{mem.get(f'{best}_bshd', 0) if best else 0:7.0f} {row.get('mem_ratio', 0):5.2f} | {best}")


def main(argv=None):
    """Run the benchmark; 0, or 2 without a TPU and no --dry-run."""
    args = parse_args(argv)
    import jax
    if not args.dry_run and jax.default_backend() != "tpu":
        print(f"bench_tpu: no TPU (JAX backend is {jax.default_backend()!r}). Use --dry-run to test this script "
              f"on CPU (kernels interpreted).", file=sys.stderr)
        return 2
    err = sys.stderr
    print(f"# ring_attention on one {jax.devices()[0].device_kind} vs splash attention vs jax.nn; {args.dtype}, "
          f"d={args.dim}, batch 1; fwd+bwd TFLOP/s (FA-2 count), median of {args.repeats}; temp MiB of the "
          f"compiled fwd+bwd (splash called on [b, s, h, d]); jax {jax.__version__}"
          f"{' [dry run]' if args.dry_run else ''}", file=err)
    print(HEADER, file=err)
    start, rows = time.perf_counter(), []
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for seq in args.seqs:
        for h, hk in args.heads:
            for causal in causals:
                row = dict(seq=seq, heads=h, kv_heads=hk, causal=causal)
                if time.perf_counter() - start > args.budget_s:
                    row["skipped"] = f"skipped: time budget of {args.budget_s:.0f} s spent"
                else:
                    try:
                        row = run_row(args, seq, h, hk, causal)
                    except Exception as e:  # report it, go on
                        row["error"] = _one_line(e)
                rows.append(row)
                print(format_row(row), file=err, flush=True)
                print(json.dumps(row), flush=True)
    done = [r for r in rows if "ratio_ours" in r]
    summary = dict(summary=True, rows=len(rows), measured=len(done), seconds=time.perf_counter() - start,
                   min_ratio_ours=min((r["ratio_ours"] for r in done), default=None),
                   min_ratio_native=min((r["ratio_native"] for r in done if "ratio_native" in r), default=None),
                   max_mem_ratio=max((r["mem_ratio"] for r in done), default=None))
    print(json.dumps(summary), flush=True)
    print(f"# {len(done)}/{len(rows)} rows; min ours/splash fwd+bwd = {summary['min_ratio_ours']} (own layouts: "
          f"{summary['min_ratio_native']}); max temp "
          f"ratio = {summary['max_mem_ratio']}; {summary['seconds']:.0f} s", file=err)
    for r in rows:
        if "ratio_interleaved" in r:
            print(f"# interleaved {r['seq']} {r['heads']}/{r['kv_heads']} causal={r['causal']}: "
                  + " ".join(f"{k}={v:.3f}" for k, v in r["ratio_interleaved"].items()), file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
