"""Tile sweep of the per-hop Pallas TPU kernel on the chip: each kernel on its own, every tile pair.

    python -m benchmarks.tune_tpu                       # a TPU: the default sweep (about 8 minutes on a v5e)
    python -m benchmarks.tune_tpu --seqs 1024,4096 --dims 64,256 --dtypes float32 --tiles 512,1024
    python -m benchmarks.tune_tpu --dry-run             # no TPU: tiny shapes, interpreted (tests this script)

(from the repository root). For every configuration (dtype, head dim, causal or not, tokens per device
``s``, batch 1, ``--heads`` query / kv heads) and every ``(block_q, block_kv)`` from ``--tiles`` x ``--tiles``
that Mosaic's tile rule and the chip's VMEM budget accept (``kernels/budgets.py``), it times the three
kernels of ``kernels/pallas_tpu.py`` apart: the forward (``hop_fwd``), the fused backward (``hop_bwd``
with ``FUSED_BWD``), and the two-kernel backward's dQ kernel and dK/dV kernel (``hop_bwd`` with only
dq, or only dk and dv, kept: XLA drops the other ``pallas_call``), the dK/dV kernel in both
orientations (``KEY_MAJOR_DKV``); and, with ``--kernels fused_fwd,fused_bwd``, the fused ring's two
kernels (``kernels/pallas_tpu_fused.py``) on a ring of one chip (``fused_fwd_streaming``: its forward
streaming K/V tiles, ``kernels/fused_ring_fwd.py``'s ``WHOLE_KV`` off; ``fused_bwd_two_pass``: its backward in two passes,
``kernels/fused_ring_bwd.py``'s ``ONE_PASS`` off: the forms for shards too long for VMEM). Programs are
compiled ahead of time in parallel threads (the host has many cores; compiling dominates a sweep), then
timed one after another (median
of ``--repeats`` after a warm-up). One JSON object per measurement and one summary per configuration
go to stdout (best tiles per kernel, the best single pair for all three, and what
``pallas_tpu.default_blocks`` picks with its time over the best); a table to stderr. The measured
table in ``kernels/pallas_tpu.py`` (``TUNED``) comes from this script's output.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import sys
import time
from functools import partial

from .bench_gpu import _ints, _one_line
from .flags import dtype_list_flag
from .timing import time_interleaved

KERNELS = ("fwd", "bwd_fused", "dq", "dkv", "dkv_qmajor", "fused_fwd", "fused_fwd_streaming", "fused_bwd",
           "fused_bwd_two_pass")
# what each measured kernel sets in kernels/pallas_tpu.py while it is traced: (FUSED_BWD, KEY_MAJOR_DKV)
FLAGS = {"fwd": (True, True), "bwd_fused": (True, True), "dq": (False, True), "dkv": (False, True),
         "dkv_qmajor": (False, False), "fused_fwd": (True, True), "fused_bwd": (True, True),
         "fused_fwd_streaming": (True, True), "fused_bwd_two_pass": (True, True)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_tpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, interpreted")
    p.add_argument("--seqs", type=_ints, help="tokens per device (default 4096,16384)")
    p.add_argument("--dims", type=_ints, help="head dims (default 128)")
    p.add_argument("--dtypes", default=None, type=dtype_list_flag(["bfloat16", "float32"]),
                   help="comma list (default bfloat16)")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--heads", default=None, help="H/Hkv (default 8/8)")
    p.add_argument("--tiles", type=_ints, help="tile sides to cross (default 256,512,1024,2048)")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median kept (default 3)")
    p.add_argument("--threads", type=int, default=12, help="parallel compiles (default 12)")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip configurations left after this many seconds")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.seqs = args.seqs or ([256] if dry else [4096, 16384])
    args.dims = args.dims or [128]
    args.dtypes = args.dtypes or ["float32" if dry else "bfloat16"]
    args.heads = tuple(int(x) for x in (args.heads or ("2/1" if dry else "8/8")).split("/"))
    args.tiles = args.tiles or ([128, 256] if dry else [256, 512, 1024, 2048])
    args.kernels = [k for k in args.kernels.split(",") if k]
    if not set(args.kernels) <= set(KERNELS):
        p.error(f"--kernels: choose from {', '.join(KERNELS)}; got {args.kernels}")
    args.repeats = args.repeats or (1 if dry else 3)
    return args


def problem(dtype, d, s, h, hk, seed=0):
    """(QShard, KVShard, do, lse, delta) of one hop of ``s`` contiguous tokens (lse, delta from the XLA hop)."""
    import jax
    import jax.numpy as jnp
    from ringattn_fast.kernels import xla
    from ringattn_fast.schedule import HopConfig, KVShard, QShard
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, do = (jax.random.normal(key, (1, s, n, d), jnp.float32).astype(dtype)
                   for key, n in zip(keys, (h, hk, hk, h)))
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    qs, kv = QShard(q, pos), KVShard(k, v, pos)
    o, lse = jax.jit(lambda qs, kv: xla.hop_fwd(qs, kv, HopConfig(causal=True, block_q=min(s, 512),
                                                                  block_kv=min(s, 512))))(qs, kv)
    delta = jnp.sum(do.astype(jnp.float32) * o, -1).swapaxes(1, 2)
    return qs, kv, do, lse, delta


def kernel_fn(name, cfg):
    """A jittable function of (qs, kv, do, lse, delta) that runs one kernel (``KERNELS``)."""
    from ringattn_fast.kernels import pallas_tpu
    if name.startswith("fused_"):
        return _fused_fn(name, cfg)

    def run(qs, kv, do, lse, delta):
        if name == "fwd":
            return pallas_tpu.hop_fwd(qs, kv, cfg)
        g = pallas_tpu.hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=delta)
        return {"dq": g.dq, "dkv": (g.dk, g.dv)}.get(name, (g.dq, g.dk, g.dv))
    return run


def _fused_fn(name, cfg):
    """The fused ring's forward or backward kernel (``pallas_tpu_fused``) on a ring of one device, in a
    ``shard_map`` as the ring calls it. The backward is timed with dO standing in for O (the timing does
    not depend on the values) and no lse cotangent."""
    import jax
    import jax.numpy as jnp
    from ringattn_fast.kernels import pallas_tpu_fused as fused
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def body(qs, kv, do, lse):
        fcfg = fused.make_config(qs, kv, cfg, axis_name="sp")
        if name == "fused_fwd":
            return fused._forward(fcfg, qs, kv)[:2]
        return fused._backward(fcfg, qs, kv, o=do, lse=lse, do=do, dlse=jnp.zeros_like(lse))[:3]
    ring = jax.shard_map(body, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), check_vma=False)
    return lambda qs, kv, do, lse, delta: ring(qs, kv, do, lse)


def lower_one(name, cfg, data):
    """(lowered, None) or (None, error line), in the calling thread: the backward's form (``FLAGS``) is
    read when the kernel is traced."""
    import jax
    from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd, pallas_tpu
    alias = {"dkv_qmajor": "dkv", "fused_fwd_streaming": "fused_fwd", "fused_bwd_two_pass": "fused_bwd"}
    try:
        pallas_tpu.FUSED_BWD, pallas_tpu.KEY_MAJOR_DKV = FLAGS[name]
        fused_ring_bwd.ONE_PASS = name != "fused_bwd_two_pass"
        fused_ring_fwd.WHOLE_KV = name != "fused_fwd_streaming"
        return jax.jit(kernel_fn(alias.get(name, name), cfg)).lower(*data), None
    except Exception as e:  # over the VMEM budget, a tile rule: recorded, skipped
        return None, _one_line(e)
    finally:
        pallas_tpu.FUSED_BWD, pallas_tpu.KEY_MAJOR_DKV, fused_ring_bwd.ONE_PASS = True, True, True
        fused_ring_fwd.WHOLE_KV = True


def compile_one(lowered):
    """(compiled, None) or (None, error line) of `lower_one`'s result (safe in a thread)."""
    if lowered[0] is None:
        return lowered
    try:
        return lowered[0].compile(), None
    except Exception as e:  # Mosaic refused it (VMEM): recorded, skipped
        return None, _one_line(e)


def flops(name, s, h, d, causal):
    """Matmul FLOPs one kernel does: forward 2 matmuls, dQ 3 (S, dP, dQ), dK/dV 4 (S, dP, dV, dK), fused
    backward 5 (S, dP, dV, dK, dQ), the fused ring's one-pass backward 5 too, its two-pass backward 7 (S and
    dP in each pass; before 2026-12-06's one-pass kernel, ``fused_bwd`` was the two-pass one, counted 7)."""
    per_matmul = 2 * s * s * h * d // (2 if causal else 1)
    return per_matmul * {"fwd": 2, "fused_fwd": 2, "fused_fwd_streaming": 2, "dq": 3, "bwd_fused": 5, "fused_bwd": 5,
                         "fused_bwd_two_pass": 7}.get(name, 4)


def sweep(args, dtype, d, s, causal, start):
    """Measure every kernel x tile pair of one configuration; returns (measurements, summary)."""
    import jax
    from ringattn_fast.kernels import pallas_tpu
    from ringattn_fast.schedule import HopConfig
    h, hk = args.heads
    data = problem(dtype, d, s, h, hk)
    pairs = [(bq, bk) for bq, bk in itertools.product(args.tiles, args.tiles) if bq <= s and bk <= s]
    jobs = [(name, bq, bk) for name in args.kernels for bq, bk in pairs]
    cfg = lambda bq, bk: HopConfig(causal=causal, block_q=bq, block_kv=bk, out_dtype=dtype)  # noqa: E731
    lowered = [lower_one(name, cfg(bq, bk), data) for name, bq, bk in jobs]
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        compiled = list(pool.map(compile_one, lowered))
    rows = []
    for (name, bq, bk), (fn, error) in zip(jobs, compiled):
        row = dict(dtype=dtype, dim=d, seq=s, heads=h, kv_heads=hk, causal=causal, kernel=name, block_q=bq,
                   block_kv=bk)
        if fn is None:
            row["error"] = error
        else:
            t = time_interleaved([partial(fn, *data)], args.repeats, 1)[0]
            row.update(ms=1e3 * t, tflops=flops(name, s, h, d, causal) / t / 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if "ms" in r]
    best = {name: min((r for r in ok if r["kernel"] == name), key=lambda r: r["ms"], default=None)
            for name in args.kernels}
    totals = {}
    for bq, bk in pairs:
        got = {r["kernel"]: r["ms"] for r in ok if (r["block_q"], r["block_kv"]) == (bq, bk)}
        two = got["dq"] + got["dkv"] if {"dq", "dkv"} <= set(got) else float("inf")
        if "fwd" in got and min(two, got.get("bwd_fused", two)) < float("inf"):
            totals[(bq, bk)] = got["fwd"] + min(two, got.get("bwd_fused", two))
    shapes = ((1, s, h, d), (1, s, hk, d), jax.numpy.dtype(dtype), jax.devices()[0])
    default = pallas_tpu.default_blocks(*shapes), pallas_tpu.default_bwd_blocks(*shapes)  # forward, backward
    summary = dict(summary=True, dtype=dtype, dim=d, seq=s, heads=h, kv_heads=hk, causal=causal,
                   best={n: None if r is None else [r["block_q"], r["block_kv"], r["ms"]] for n, r in best.items()},
                   default=default, seconds=time.perf_counter() - start)
    ms = {(r["kernel"], r["block_q"], r["block_kv"]): r["ms"] for r in ok}
    if totals:
        pair = min(totals, key=totals.get)
        summary.update(best_pair=list(pair), best_pair_ms=totals[pair])
    # the default call: the forward at its tiles, the backward (fused where measured) at its own
    fwd, bwd = (ms.get((k,) + tuple(t or ())) for k, t in (("fwd", default[0]), ("bwd_fused", default[1])))
    if fwd and bwd and best.get("fwd") and best.get("bwd_fused"):
        summary.update(default_ms=fwd + bwd, default_over_best=(fwd + bwd) / (best["fwd"]["ms"] + best["bwd_fused"]["ms"]))
    if best.get("fused_fwd") and best.get("fused_bwd"):  # the fused ring's defaults against its best tiles
        from ringattn_fast.kernels import pallas_tpu_fused
        fused = (pallas_tpu_fused.default_blocks(*shapes, n=1),) * 2  # one pair for both of its kernels
        fwd, bwd = (ms.get((k,) + tuple(t or ())) for k, t in zip(("fused_fwd", "fused_bwd"), fused))
        summary.update(fused_default=fused)
        if fwd and bwd:
            summary.update(fused_default_over_best=(fwd + bwd) / (best["fused_fwd"]["ms"] + best["fused_bwd"]["ms"]))
    return rows, summary


def main(argv=None):
    args = parse_args(argv)
    import jax
    if not args.dry_run and jax.default_backend() != "tpu":
        print("tune_tpu: no TPU; use --dry-run to test this script on CPU", file=sys.stderr)
        return 2
    print(f"# tile sweep of pallas_tpu on {jax.devices()[0].device_kind}; jax {jax.__version__}; ms per call, "
          f"median of {args.repeats}", file=sys.stderr)
    start, summaries = time.perf_counter(), []
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for dtype, d, s, causal in itertools.product(args.dtypes, args.dims, args.seqs, causals):
        if time.perf_counter() - start > args.budget_s:
            print(json.dumps(dict(skipped=True, dtype=dtype, dim=d, seq=s, causal=causal)), flush=True)
            continue
        try:
            _, summary = sweep(args, dtype, d, s, causal, start)
        except Exception as e:  # report, go on
            summary = dict(summary=True, dtype=dtype, dim=d, seq=s, causal=causal, error=_one_line(e))
        summaries.append(summary)
        print(json.dumps(summary), flush=True)
        print(f"{dtype:>8} d={d:<3} s={s:<6} causal={causal!s:<5} best {summary.get('best')} pair "
              f"{summary.get('best_pair')} {summary.get('best_pair_ms', 0):.2f} ms; default {summary.get('default')} "
              f"x{summary.get('default_over_best') or 0:.2f} ({summary.get('seconds', 0):.0f} s)",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
