"""Checks on a TPU beside ``benchmarks.bench_tpu``: the default call's numbers against XLA, and the XLA hop's
causal skipping.

    python -m benchmarks.tpu_checks              # a TPU (about a minute)
    python -m benchmarks.tpu_checks --dry-run    # CPU, tiny shapes (tests this script)

1. **numerics**: ``ring_attention(q, k, v, mesh=make_mesh(1), ...)`` with no ``impl`` (the Pallas TPU
   kernel) against ``impl="xla"`` computed in float32 at ``jax.default_matmul_precision("highest")``,
   forward and gradients, next to ``jax.nn.dot_product_attention`` (XLA) in the same input dtype against
   the same reference, for float32 and bfloat16 and four configurations (causal + GQA; window + segment
   ids; soft-cap + sinks; plain). A row passes when ours is within 2x jax.nn's own error (and 1e-5 for
   float32 under "highest").
2. **xla hop**: ``ring_attention(impl="xla")`` forward+backward time, causal over non-causal (the hop
   skips empty tiles: the issue's bar is <= 0.6).

One JSON object per check to stdout, a line each to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial

from .timing import time_interleaved

NAMES = ("o", "dq", "dk", "dv")
CONFIGS = {"causal_gqa": dict(causal=True, kv_heads=2), "window_segments": dict(window=(384, 0), segments=True),
           "softcap_sinks": dict(causal=True, logit_softcap=30.0, sinks=True), "plain": dict()}


def numerics(seq, heads, dim, dtype, name):
    """Errors of ours and of jax.nn (same dtype) against the float32 "highest" XLA ring (a JSON-able dict)."""
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

    def grads(attn, dt):
        cast = lambda x: x.astype(dt)  # noqa: E731
        o, vjp = jax.vjp(attn, cast(q), cast(k), cast(v))
        return [x.astype(jnp.float32) for x in (o,) + vjp(cast(do))]

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda: grads(partial(rf.ring_attention, mesh=mesh, impl="xla", **opts), jnp.float32))()
    ours = jax.jit(lambda: grads(partial(rf.ring_attention, mesh=mesh, **opts), jnp.dtype(dtype)))()
    err = {n: float(jnp.max(jnp.abs(a - b))) for n, a, b in zip(NAMES, ours, ref)}
    row = dict(check="numerics", config=name, seq=seq, heads=heads, kv_heads=hk, dim=dim, dtype=dtype, err=err)
    if not opts.get("logit_softcap") and not sinks and not seg and opts.get("window") is None:
        nn = jax.jit(lambda: grads(partial(jax.nn.dot_product_attention, is_causal=bool(opts.get("causal")),
                                           implementation="xla"), jnp.dtype(dtype)))()
        row["jax_nn_err"] = {n: float(jnp.max(jnp.abs(a - b))) for n, a, b in zip(NAMES, nn, ref)}
    tol = {n: 2 * row["jax_nn_err"][n] if "jax_nn_err" in row else (3e-2 if dtype == "bfloat16" else 5e-3)
           for n in NAMES}
    row["ok"] = all(err[n] <= max(tol[n], 1e-5) for n in NAMES)
    return row


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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_checks", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--xla-seqs", default=None, help="comma list (default 16384,32768)")
    args = p.parse_args(argv)
    import jax
    if not args.dry_run and jax.default_backend() != "tpu":
        print("tpu_checks: no TPU; use --dry-run", file=sys.stderr)
        return 2
    seq, heads, dim = (256, 4, 128) if args.dry_run else (2048, 8, 128)
    rows = [numerics(seq, heads, dim, dt, name) for dt in ("float32", "bfloat16") for name in CONFIGS]
    xla_seqs = [int(s) for s in (args.xla_seqs or ("512" if args.dry_run else "16384,32768")).split(",")]
    rows += [xla_hop(s, 8 if not args.dry_run else 2, dim, 1 if args.dry_run else 3) for s in xla_seqs]
    for row in rows:
        print(json.dumps(row), flush=True)
        print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
