"""Checks on a TPU beside ``benchmarks.bench_tpu``: the default call's numbers against XLA, and the XLA hop's
causal skipping.

    python -m benchmarks.tpu_checks              # a TPU (about a minute)
    python -m benchmarks.tpu_checks --dry-run    # CPU, tiny shapes (tests this script)

1. **numerics**: ``ring_attention(q, k, v, mesh=make_mesh(1), ...)`` with no ``impl`` (the Pallas TPU
   kernel) against ``impl="xla"`` computed in float32 at ``jax.default_matmul_precision("highest")``,
   forward and gradients, next to ``jax.nn.dot_product_attention`` (XLA) in the same input dtype against
   the same reference, for float32 and bfloat16 and four configurations (causal + GQA; window + segment
   ids; soft-cap + sinks; plain), and for float32 ours at "highest" too (``err_highest``: the kernel's own
   error). A row passes when ours is within 2x jax.nn's own error. Every row's programs are compiled up
   front in parallel threads (one after another they took about 110 s a row on a v5e's host).
2. **xla hop**: ``ring_attention(impl="xla")`` forward+backward time, causal over non-causal (the hop
   skips empty tiles: the issue's bar is <= 0.6).
3. **overhead** (``--checks overhead``, a TPU only): the default call's forward+backward time as shipped
   and with the per-tile nan/inf key flags (``pallas_tpu._bad_tiles``, the reduction over K and V behind
   them) made all zero (a diagnostic of the ring's own passes).
4. **variants** (``--checks variants``): the default call's forward+backward time with each form of the
   fused backward's dS K (``pallas_tpu.DQ_FORM``), with the per-tile non-finite test of K made the
   identity (a diagnostic, wrong for a bad key: what that test costs), and with partial tiles whole or
   split 4 x 4 instead of 2 x 2 (``pallas_tpu.SPLIT``), with base-2 logits (``pallas_tpu.EXP2``), and with
   dS zeroed where P is 0 on full tiles too (``FULL_TILE_WHERE``, the form shipped until the chip timed it),
   and with the tiles unchunked or in other chunks (``FWD_ROW_CHUNK``, ``BWD_KEY_CHUNK``), each compiled
   ahead with its setting in place and timed interleaved; 8 heads, ``--variant-seqs``, ``--variant-causal``,
   ``--variants`` (names). ``--variant-path fused`` times the fused ring's kernels instead (on a ring of one,
   at the tiles ``ring_attention`` gives them on a larger ring, as ``bench_tpu``'s "fused" column), which
   read the same settings.

One JSON object per check to stdout, a line each to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

from .bench_tpu import fused_on_one_chip
from .timing import time_interleaved

NAMES = ("o", "dq", "dk", "dv")
CONFIGS = {"causal_gqa": dict(causal=True, kv_heads=2), "window_segments": dict(window=(384, 0), segments=True),
           "softcap_sinks": dict(causal=True, logit_softcap=30.0, sinks=True), "plain": dict()}


def numerics_programs(seq, heads, dim, dtype, name):
    """``(meta, {kind: lowered})`` of one numerics row: the float32 "highest" XLA ring (``ref``), ours in
    ``dtype`` (and, for float32, ours at "highest"), jax.nn where it applies. Each program takes no
    arguments (its inputs are constants) and returns [o, dq, dk, dv] in float32. Lowered here, in the
    calling thread (the matmul precision is read when a program is traced); compiled by the caller."""
    import jax
    import jax.numpy as jnp
    import ringattn_fast as rf

    opts = dict(CONFIGS[name])
    hk, seg, sinks = opts.pop("kv_heads", heads), opts.pop("segments", False), opts.pop("sinks", False)
    keys = jax.random.split(jax.random.key(seq + heads), 5)
    q, do = (jax.random.normal(k, (1, seq, heads, dim), jnp.float32) for k in keys[:2])
    k, v = (jax.random.normal(k, (1, seq, hk, dim), jnp.float32) for k in keys[2:4])
    if seg:
        opts["segment_ids"] = (jnp.arange(seq)[None] >= seq // 3).astype(jnp.int32)
    if sinks:
        opts["sinks"] = jax.random.normal(keys[4], (heads,), jnp.float32)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def lowered(attn, dt, precision=None):
        def grads():
            cast = lambda x: x.astype(dt)  # noqa: E731
            o, vjp = jax.vjp(attn, cast(q), cast(k), cast(v))
            return [x.astype(jnp.float32) for x in (o,) + vjp(cast(do))]
        with jax.default_matmul_precision(precision):
            return jax.jit(grads).lower()

    ring = partial(rf.ring_attention, mesh=mesh, **opts)
    out = {"ref": lowered(partial(ring, impl="xla"), jnp.float32, "highest"), "ours": lowered(ring, jnp.dtype(dtype))}
    if dtype == "float32":  # the kernel itself is exact: at "highest" its errors are float32 rounding
        out["ours_highest"] = lowered(ring, jnp.float32, "highest")
    if not opts.get("logit_softcap") and not sinks and not seg and opts.get("window") is None:
        out["jax_nn"] = lowered(partial(jax.nn.dot_product_attention, is_causal=bool(opts.get("causal")),
                                        implementation="xla"), jnp.dtype(dtype))
    return dict(check="numerics", config=name, seq=seq, heads=heads, kv_heads=hk, dim=dim, dtype=dtype), out


def numerics_row(meta, compiled):
    """Errors of ours and of jax.nn (same dtype) against the float32 "highest" XLA ring (a JSON-able dict),
    from `numerics_programs`' programs compiled. A row passes when ours is within 2x jax.nn's own error
    (else 3e-2 bfloat16, 5e-3 float32), and 1e-5 always."""
    import jax.numpy as jnp

    got = {kind: fn() for kind, fn in compiled.items()}
    errors = lambda kind: {n: float(jnp.max(jnp.abs(a - b))) for n, a, b in zip(NAMES, got[kind], got["ref"])}  # noqa: E731
    row = dict(meta, err=errors("ours"))
    if "ours_highest" in got:
        row["err_highest"] = errors("ours_highest")
    if "jax_nn" in got:
        row["jax_nn_err"] = errors("jax_nn")
    tol = {n: 2 * row["jax_nn_err"][n] if "jax_nn_err" in row else (3e-2 if meta["dtype"] == "bfloat16" else 5e-3)
           for n in NAMES}
    row["ok"] = all(row["err"][n] <= max(tol[n], 1e-5) for n in NAMES)
    return row


def numerics_jobs(seq, heads, dim, threads):
    """Every numerics row's programs lowered, then compiled in ``threads`` parallel threads (compiling
    dominates: about 110 s a row one after another on the chip's host); returns a job per row."""
    import concurrent.futures
    start = time.perf_counter()
    rows = [numerics_programs(seq, heads, dim, dt, name) for dt in ("float32", "bfloat16") for name in CONFIGS]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [{kind: pool.submit(lowered.compile) for kind, lowered in programs.items()} for _, programs in rows]
        compiled = [{kind: f.result() for kind, f in row.items()} for row in futures]  # every row submitted first
    seconds = time.perf_counter() - start
    return [partial(lambda meta, c: dict(numerics_row(meta, c), compile_seconds=seconds), meta, c)
            for (meta, _), c in zip(rows, compiled)]


def xla_hop(seq, heads, dim, repeats):
    """Forward+backward ms of ring_attention(impl="xla") on one device, causal and not, and their ratio."""
    import jax
    import jax.numpy as jnp
    import ringattn_fast as rf
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    x = jax.random.normal(jax.random.key(0), (1, seq, heads, dim), jnp.bfloat16)

    def fb(causal):
        attn = partial(rf.ring_attention, mesh=mesh, impl="xla", causal=causal)
        return jax.jit(lambda q: jax.vjp(attn, q, q, q)[1](q))
    fns = [fb(False), fb(True)]
    t_plain, t_causal = time_interleaved([partial(f, x) for f in fns], repeats, 1)
    return dict(check="xla hop", seq=seq, heads=heads, dim=dim, ms_plain=1e3 * t_plain, ms_causal=1e3 * t_causal,
                causal_over_plain=t_causal / t_plain)


def overhead(seq, heads, dim, repeats):
    """Forward+backward ms of the default ``ring_attention`` on one device, as shipped and with
    ``pallas_tpu._bad_tiles`` all zero (a diagnostic: what finding the nan/inf keys costs; the kernels mark
    the flagged tiles in VMEM)."""
    import jax
    import jax.numpy as jnp
    import ringattn_fast as rf
    from ringattn_fast.kernels import pallas_tpu
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    x = jax.random.normal(jax.random.key(0), (1, seq, heads, dim), jnp.bfloat16)
    row = dict(check="overhead", seq=seq, heads=heads, dim=dim)
    for causal in (False, True):
        fns = []
        for identity in (False, True):
            saved = pallas_tpu._bad_tiles
            if identity:
                pallas_tpu._bad_tiles = lambda kv, block_kv: jnp.zeros(kv.k.shape[0] * (kv.k.shape[1] // block_kv),
                                                                       jnp.int32)
            try:  # traced here, with the patch in place
                attn = partial(rf.ring_attention, mesh=mesh, causal=causal)
                jax.clear_caches()
                f = jax.jit(lambda q: jax.vjp(attn, q, q, q)[1](q))
                jax.block_until_ready(f(x))
            finally:
                pallas_tpu._bad_tiles = saved
            fns.append(partial(f, x))
        t_ours, t_unmarked = time_interleaved(fns, repeats, 1)
        row[f"causal={causal}"] = dict(ms=1e3 * t_ours, ms_without_bad_key_flags=1e3 * t_unmarked)
    return row


def mark_bad_variants(seq, heads, dim, repeats):
    """ms of the nan/inf key-marking pass alone (``masks.mark_bad_keys``) against the boolean reduction it
    replaced and a matmul form, on [1, seq, heads, dim] bfloat16 K and V."""
    import jax
    import jax.numpy as jnp
    from ringattn_fast import masks

    def boolean(k, v):  # the earlier form: isfinite reduced as booleans
        bad = ~(jnp.isfinite(k).all(-1, keepdims=True) & jnp.isfinite(v).all(-1, keepdims=True))
        return jnp.where(bad, jnp.nan, k), jnp.where(bad, 0, v)

    def matmul(k, v):  # the zero products summed on the MXU
        ones = jnp.ones((k.shape[-1],), k.dtype)
        z = jnp.einsum("bshd,d->bsh", k * 0 + v * 0, ones, preferred_element_type=jnp.float32)[..., None]
        bad = jnp.isnan(z)
        return jnp.where(bad, jnp.nan, k), jnp.where(bad, 0, v)

    keys = jax.random.split(jax.random.key(1), 2)
    k, v = (jax.random.normal(key, (1, seq, heads, dim), jnp.bfloat16) for key in keys)
    fns = [jax.jit(f) for f in (masks.mark_bad_keys, boolean, matmul)]
    for f in fns:
        jax.block_until_ready(f(k, v))
    times = time_interleaved([partial(f, k, v) for f in fns], repeats, 1)
    return dict(check="mark_bad_keys", seq=seq, heads=heads, dim=dim,
                ms=dict(zip(("shipped", "boolean", "matmul"), (1e3 * t for t in times))))


VARIANTS = {"shipped": {}, "dq_cast": dict(DQ_FORM="cast"), "dq_tn": dict(DQ_FORM="tn"),
            "no_finite_keys": dict(finite_keys=lambda k: k), "whole_tiles": dict(SPLIT=1), "split4": dict(SPLIT=4),
            "exp2": dict(EXP2=True), "full_tile_where": dict(FULL_TILE_WHERE=True),
            "whole_tiles_unchunked": dict(FWD_ROW_CHUNK=0, BWD_KEY_CHUNK=0), "bwd_keys128": dict(BWD_KEY_CHUNK=128),
            "fwd_rows1024": dict(FWD_ROW_CHUNK=1024), "fwd_unchunked": dict(FWD_ROW_CHUNK=0),
            "bwd_unchunked": dict(BWD_KEY_CHUNK=0)}


def variants(seq, heads, dim, causal, repeats, dry_run=False, names=None, path="default"):
    """ms of the default forward+backward (``path="fused"``: the fused ring's, `fused_on_one_chip`) under each
    of :data:`VARIANTS` (``names`` of them, "shipped" always; ``pallas_tpu`` attributes set while the program
    is traced and compiled), and each one's max |difference| from the shipped outputs."""
    import jax
    import jax.numpy as jnp
    import ringattn_fast as rf
    from ringattn_fast.kernels import pallas_tpu
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    x = jax.random.normal(jax.random.key(seq), (1, seq, heads, dim), jnp.bfloat16)
    if path == "fused":
        attn = fused_on_one_chip(mesh, causal, x.shape, x.shape, x.dtype, interpret=True if dry_run else None)
    else:
        attn = partial(rf.ring_attention, mesh=mesh, causal=causal, **(dict(impl="pallas_tpu") if dry_run else {}))
    compiled, outs = {}, {}
    for name, patch in VARIANTS.items():
        if names is not None and name != "shipped" and name not in names:
            continue
        saved = {a: getattr(pallas_tpu, a) for a in patch}
        try:
            for a, value in patch.items():
                setattr(pallas_tpu, a, value)
            jax.clear_caches()  # traced afresh, with the patch in place
            compiled[name] = jax.jit(lambda q: jax.vjp(attn, q, q, q)[1](q)).lower(x).compile()
        finally:
            for a, value in saved.items():
                setattr(pallas_tpu, a, value)
        outs[name] = jax.block_until_ready(compiled[name](x))
    jax.clear_caches()
    times = time_interleaved([partial(compiled[n], x) for n in compiled], repeats, 1)
    diff = {n: max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(outs[n], outs["shipped"])) for n in outs}
    return dict(check="variants", path=path, seq=seq, heads=heads, dim=dim, causal=causal,
                ms={n: 1e3 * t for n, t in zip(compiled, times)}, max_diff=diff)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_checks", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--xla-seqs", default=None, help="comma list (default 16384,32768)")
    p.add_argument("--checks", default="numerics,xla", help="comma list of numerics, xla, overhead, variants")
    p.add_argument("--overhead-seqs", default=None, help="comma list (default 8192,16384)")
    p.add_argument("--variant-seqs", default=None, help="comma list (default 8192,16384)")
    p.add_argument("--variant-causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--variant-path", default="default", choices=["default", "fused"],
                   help="time the default call (the per-hop kernel on one chip) or the fused ring's kernels")
    p.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (default all)")
    args = p.parse_args(argv)
    unknown = sorted(set((args.variants or "").split(",")) - set(VARIANTS) - {""})
    if unknown:  # a renamed variant would otherwise time "shipped" alone
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    checks = set(args.checks.split(","))
    import jax
    if not args.dry_run and jax.default_backend() != "tpu":
        print("tpu_checks: no TPU; use --dry-run", file=sys.stderr)
        return 2
    seq, heads, dim = (256, 4, 128) if args.dry_run else (2048, 8, 128)
    jobs = []
    if "numerics" in checks:
        jobs += numerics_jobs(seq, heads, dim, 1 if args.dry_run else 12)
    if "xla" in checks:
        xla_seqs = [int(s) for s in (args.xla_seqs or ("512" if args.dry_run else "16384,32768")).split(",")]
        jobs += [partial(xla_hop, s, 8 if not args.dry_run else 2, dim, 1 if args.dry_run else 3) for s in xla_seqs]
    if "overhead" in checks and not args.dry_run:  # the Pallas TPU default: a TPU only
        seqs = [int(s) for s in (args.overhead_seqs or "8192,16384").split(",")]
        jobs += [partial(mark_bad_variants, s, 8, dim, 20) for s in seqs]
        jobs += [partial(overhead, s, 8, dim, 5) for s in seqs]
    if "variants" in checks:
        seqs = [int(s) for s in (args.variant_seqs or ("256" if args.dry_run else "8192,16384")).split(",")]
        causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.variant_causal]
        names = None if args.variants is None else set(args.variants.split(","))
        jobs += [partial(variants, s, 2 if args.dry_run else 8, dim, causal, 1 if args.dry_run else 10, args.dry_run,
                         names, args.variant_path) for s in seqs for causal in causals]
    ok = True
    for job in jobs:  # printed as each finishes: a run cut short keeps what it measured
        row = job()
        ok &= row.get("ok", True)
        print(json.dumps(row), flush=True)
        print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
