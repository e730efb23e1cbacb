"""GPU check of the Pallas Triton kernel: float32 errors (hop and ring) vs XLA, TFLOP/s vs cuDNN.

    python -m benchmarks.bench_gpu                    # a GPU: seq 4K-32K, heads 8 and 32, d=128, bf16
    python -m benchmarks.bench_gpu --quick            # seq 4K and 16K, heads 32 (about a minute)
    python -m benchmarks.bench_gpu --dry-run          # no GPU needed: tiny shapes, float32, interpreted

(from the repository root; ``python -m benchmarks.bench --gpu-kernel ...`` is the same check).

First the float32 checks (``benchmarks/gpu_checks.py``; skip with ``--no-f32-check``): the hop kernel
and ``ring_attention(impl="pallas_gpu")`` over all local GPUs against the XLA path, forward and backward,
no TF32, at the kernel's default tiles for this GPU (``kernels/budgets.py``). Then, for every (seq,
heads, causal) row, on one device, the whole sequence as a single hop (``q_pos = k_pos = arange(seq)``):

1. **check**: kernel 1 (``kernels.pallas_gpu.hop_fwd`` / ``hop_bwd``, the per-hop contract of
   docs/design.md) against the XLA path (``ringattn_fast.kernels.xla``) run on the same inputs upcast to
   float32 at ``precision="highest"`` (no TF32): max abs error of o and of dq, dk, dv, where
   do ~ N(0, 1) and delta = rowsum(do * o) (FA-2 Alg. 2 line 4). The row passes when every
   error is at most ``tol * max(1, max|reference|)`` (tol 2e-2 for bf16/fp16, 2e-5 for float32).
   The same errors are shown for the reference column, so bf16 rounding can be told from a bug.
2. **speed**: median wall time of ``--repeats`` jitted calls (after ``--warmup`` calls, which
   include compilation; each call ends in ``block_until_ready``) of our forward (o, lse) and
   forward+backward (o, lse, delta, dq, dk, dv), next to ``jax.nn.dot_product_attention(...,
   implementation="cudnn")`` (forward, and its VJP for forward+backward). FLOPs, as FlashAttention-2
   counts them: forward ``4 * b * h * s^2 * d`` (two matmuls), halved when causal; forward+backward
   3.5x forward (five more matmuls in the backward, the recomputation of S included). The target is
   ours / cuDNN forward >= 0.7.

cuDNN needs bf16/fp16 in the BTNH layout (= our [batch, seq, heads, dim]) with head dim a multiple
of 8 and <= 128 (<= 256 from Hopper on); if it raises, the row says so and the check continues.
Batch is ``max(1, --tokens // seq)`` so every row holds about the same number of tokens. Rows are
skipped (and say so) once ``--budget-s`` seconds have passed, so the whole check stays under 5
minutes. ``--dry-run`` runs the same code on the default backend with tiny shapes, float32 and
``implementation="xla"`` as the reference column: on CPU the Triton kernel runs in interpret mode,
which is how CI tests this script. A table goes to stderr, one JSON object per row to stdout.
Returns (and exits with) 0 when every row passes, 1 when a check fails, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

from . import gpu_checks
from .flags import dtype_flag
from .timing import time_interleaved

TARGET_FWD_RATIO = 0.7
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-2}
GRADS = ("dq", "dk", "dv")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny float32 shapes on the default backend (CPU: "
                   "Triton interpret mode), reference implementation='xla'; no GPU needed")
    p.add_argument("--quick", action="store_true", help="seq 4096 and 16384, heads 32 only")
    p.add_argument("--seqs", type=_ints, help="comma list of sequence lengths (default 4096,8192,16384,32768)")
    p.add_argument("--heads", type=_ints, help="comma list of head counts (default 8,32)")
    p.add_argument("--dim", type=int, help="head dim (default 128; dry run 32)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 (dry run float32)",
                   type=dtype_flag(["bfloat16", "float16", "float32"]))
    p.add_argument("--tokens", type=int, help="batch = max(1, tokens // seq) (default 32768; dry run 1)")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--block-q", type=int, help="kernel block_q = FA-2 Br (default: the kernel's default tiles "
                   "for this GPU and dtype, pallas_gpu.default_blocks; dry run 64)")
    p.add_argument("--block-kv", type=int, help="kernel block_kv = FA-2 Bc (default: as --block-q; dry run 32)")
    p.add_argument("--no-f32-check", action="store_true", help="skip the float32 hop and ring checks")
    p.add_argument("--ref-block", type=int, default=1024, help="block of the XLA reference path (default 1024)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (compilation) (default 1)")
    p.add_argument("--repeats", type=int, help="timed calls, median kept (default 5; dry run 2)")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip the rows left after this many seconds")
    p.add_argument("--ref-impl", choices=["cudnn", "xla"], help="implementation= of the reference column "
                   "(default cudnn; dry run xla)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dry = args.dry_run
    args.seqs = args.seqs or ([128] if dry else [4096, 16384] if args.quick else [4096, 8192, 16384, 32768])
    args.heads = args.heads or ([2] if dry else [32] if args.quick else [8, 32])
    args.dim = args.dim or (32 if dry else 128)
    args.dtype = args.dtype or ("float32" if dry else "bfloat16")
    args.block_q = args.block_q or (64 if dry else None)
    args.block_kv = args.block_kv or (32 if dry else None)
    args.repeats = args.repeats or (2 if dry else 5)
    args.ref_impl = args.ref_impl or ("xla" if dry else "cudnn")
    args.tokens = args.tokens or (1 if dry else 32768)
    for name in ("tokens", "dim", "block_q", "block_kv", "ref_block", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def _ints(text):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def attention_flops(batch, heads, seq, dim, causal):
    """(forward, forward+backward) FLOPs as FlashAttention-2 counts them (see the module docstring)."""
    fwd = 4 * batch * heads * seq * seq * dim // (2 if causal else 1)
    return fwd, 3.5 * fwd


def time_call(fn, args, warmup, repeats):
    """Median seconds of ``fn(*args)`` over ``repeats`` calls after ``warmup`` calls (blocking on each)."""
    return time_interleaved([partial(fn, *args)], repeats, warmup)[0]


def make_functions(opts, blocks, ref_blocks, ref_impl):
    """Jitted (ours_fwd, ours_fwd_bwd, xla_fwd_bwd, ref_fwd, ref_fwd_bwd); all take (q, k, v, pos, do).

    ours (``pallas_gpu``, tiles ``blocks``) and xla (``kernels.xla``, tiles ``ref_blocks``) follow the per-hop
    contract, one hop = the whole sequence; ref is ``jax.nn.dot_product_attention`` with
    ``implementation=ref_impl`` and its VJP. fwd_bwd functions return (o, dq, dk, dv).
    """
    import jax
    import jax.numpy as jnp

    from ringattn_fast.kernels import pallas_gpu, xla
    from ringattn_fast.schedule import HopConfig, KVShard, QShard

    def fwd_bwd(module, block_q, block_kv):
        cfg = HopConfig(**opts, block_q=block_q, block_kv=block_kv)

        def run(q, k, v, pos, do):
            qs, kv = QShard(q, pos), KVShard(k, v, pos)
            o, lse = module.hop_fwd(qs, kv, cfg)  # (b, s, h, d), (b, h, s)
            delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), o.astype(jnp.float32))  # D = rowsum(dO*O)
            dq, dk, dv, _ = module.hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=delta)
            return o, dq, dk, dv
        return run

    def ours_fwd(q, k, v, pos, do):
        cfg = HopConfig(**opts, block_q=blocks[0], block_kv=blocks[1])
        return pallas_gpu.hop_fwd(QShard(q, pos), KVShard(k, v, pos), cfg)

    def ref_attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=opts["causal"], implementation=ref_impl)

    def ref_fwd_bwd(q, k, v, pos, do):
        o, vjp = jax.vjp(ref_attention, q, k, v)
        return (o,) + vjp(do.astype(o.dtype))

    return (jax.jit(ours_fwd), jax.jit(fwd_bwd(pallas_gpu, *blocks)), jax.jit(fwd_bwd(xla, *ref_blocks)),
            jax.jit(lambda q, k, v, pos, do: ref_attention(q, k, v)), jax.jit(ref_fwd_bwd))


def _one_line(e, width=160):
    """``TypeName: first line of the message`` (cut to ``width``) of an exception."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:width] if lines else ''}"


def max_errors(outs, refs):
    """{name: max abs(out - ref)} over o, dq, dk, dv, computed in float32 on the device."""
    import jax.numpy as jnp
    return {name: float(jnp.max(jnp.abs(x.astype(jnp.float32) - r))) for name, x, r in zip(("o",) + GRADS, outs, refs)}


def run_row(args, seq, heads, causal):
    """One table row: errors vs the XLA path and TFLOP/s of ours and the reference; a JSON-able dict."""
    import jax
    import jax.numpy as jnp

    batch, dtype = max(1, args.tokens // seq), jnp.dtype(args.dtype)
    shape = (batch, seq, heads, args.dim)
    keys = jax.random.split(jax.random.key(args.seed), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)  # (b, s, h, d)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))  # (b, s) true positions
    ref_block = min(args.ref_block, seq)
    blocks = default_tiles(args, shape, dtype)
    ours_fwd, ours_fb, xla_fb, ref_fwd, ref_fb = make_functions(
        dict(scale=args.dim ** -0.5, causal=causal, window=None), blocks, (ref_block, ref_block), args.ref_impl)
    flops_fwd, flops_fb = attention_flops(batch, heads, seq, args.dim, causal)
    row = dict(seq=seq, batch=batch, heads=heads, dim=args.dim, dtype=args.dtype, causal=causal,
               block_q=blocks[0], block_kv=blocks[1], backend=jax.default_backend(), ref_impl=args.ref_impl,
               flops_fwd=flops_fwd, flops_fwd_bwd=flops_fb)
    data = (q, k, v, pos, do)

    with jax.default_matmul_precision("highest"):  # the reference: float32, no TF32
        truth = jax.block_until_ready(xla_fb(*(x.astype(jnp.float32) for x in (q, k, v)), pos, do))
    ours = jax.block_until_ready(ours_fb(*data))
    row["err"] = max_errors(ours, truth)
    row["ref_max"] = {name: float(jnp.max(jnp.abs(r))) for name, r in zip(("o",) + GRADS, truth)}
    row["ok"] = all(row["err"][n] <= TOL[args.dtype] * max(1.0, row["ref_max"][n]) for n in row["err"])
    del ours
    t_fwd = time_call(ours_fwd, data, args.warmup, args.repeats)
    t_fb = time_call(ours_fb, data, args.warmup, args.repeats)
    row["ms"] = {"ours_fwd": 1e3 * t_fwd, "ours_fwd_bwd": 1e3 * t_fb}
    row["tflops"] = {"ours_fwd": flops_fwd / t_fwd / 1e12, "ours_fwd_bwd": flops_fb / t_fb / 1e12}
    row["ref_error"], row["ref_err"] = None, {}
    try:  # the forward first: its ratio is the target even if the reference's backward fails
        row["ref_err"]["o"] = max_errors([jax.block_until_ready(ref_fwd(*data))], truth[:1])["o"]
        r_fwd = time_call(ref_fwd, data, args.warmup, args.repeats)
        row["ms"]["ref_fwd"], row["tflops"]["ref_fwd"] = 1e3 * r_fwd, flops_fwd / r_fwd / 1e12
        row["ratio_fwd"] = r_fwd / t_fwd  # ours / reference, in TFLOP/s
        row["ref_err"].update(max_errors(jax.block_until_ready(ref_fb(*data)), truth))
        r_fb = time_call(ref_fb, data, args.warmup, args.repeats)
        row["ms"]["ref_fwd_bwd"], row["tflops"]["ref_fwd_bwd"] = 1e3 * r_fb, flops_fb / r_fb / 1e12
        row["ratio_fwd_bwd"] = r_fb / t_fb
    except Exception as e:  # cuDNN missing, or this shape/dtype/GPU unsupported: say so, keep going
        row["ref_error"] = ("fwd+bwd: " if "ratio_fwd" in row else "") + _one_line(e)
    return row


def default_tiles(args, shape, dtype):
    """(block_q, block_kv): the ones asked for, else the kernel's default for this device and dtype."""
    from ringattn_fast.kernels import pallas_gpu
    from ringattn_fast.mesh import current_device
    auto = pallas_gpu.default_blocks(shape, shape, dtype, current_device()) or (64, 32)
    return (args.block_q or auto[0], args.block_kv or auto[1])


HEADER = (f"{'seq':>6} {'b':>3} {'h':>3} {'causal':>6} | {'err o':>8} {'err dq':>8} {'err dk':>8} {'err dv':>8} "
          f"{'ok':>4} | {'fwd':>7} {'fwd+bwd':>7} | {'ref fwd':>7} {'ref f+b':>7} | {'fwd x':>6} {'f+b x':>6}")


def format_row(row):
    """One table line: errors, TFLOP/s of ours and the reference, ours/reference ratios."""
    head = f"{row['seq']:>6} {row['batch']:>3} {row['heads']:>3} {str(row['causal']):>6} | "
    if "err" not in row:
        return head + row.get("skipped", f"FAILED: {row.get('error')}")
    errs = " ".join(f"{row['err'][n]:8.1e}" for n in ("o",) + GRADS)
    ok = f"{'yes' if row['ok'] else 'NO':>4}"
    t = {key: f"{val:7.3g}" for key, val in row["tflops"].items()}
    ours = f"{t['ours_fwd']} {t['ours_fwd_bwd']}"
    if "ratio_fwd" not in row:
        return f"{head}{errs} {ok} | {ours} | {row['ref_impl']} unavailable: {row['ref_error']}"
    fb = (f"{t['ref_fwd_bwd']} | {row['ratio_fwd']:6.2f} {row['ratio_fwd_bwd']:6.2f}" if "ratio_fwd_bwd" in row else
          f"{'n/a':>7} | {row['ratio_fwd']:6.2f} {'n/a':>6}  ({row['ref_impl']} {row['ref_error']})")
    return f"{head}{errs} {ok} | {ours} | {t['ref_fwd']} {fb}"


def _has_gpu():
    import jax
    return jax.default_backend() == "gpu"


def main(argv=None):
    """Run the check; returns 0 (every row passed), 1 (a check failed) or 2 (no GPU and no --dry-run)."""
    args = parse_args(argv)
    if not args.dry_run and not _has_gpu():
        import jax
        print(f"bench_gpu: no GPU (JAX backend is {jax.default_backend()!r}); the kernel check needs a CUDA GPU. "
              f"Use --dry-run to test this script on CPU (Triton interpret mode).", file=sys.stderr)
        return 2
    import jax
    err = sys.stderr
    print(f"# kernel 1 (pallas_gpu hop) vs XLA hop (float32, highest) and vs jax.nn.dot_product_attention"
          f"(implementation={args.ref_impl!r}) on {jax.devices()[0].device_kind}; {args.dtype}, d={args.dim}, "
          f"block_q={args.block_q or 'auto'}, block_kv={args.block_kv or 'auto'}; TFLOP/s (FA-2 count), median of "
          f"{args.repeats}; "
          f"jax {jax.__version__}, backend {jax.default_backend()}"
          f"{' [dry run]' if args.dry_run else ''}", file=err)
    start, rows = time.perf_counter(), []
    checks = [] if args.no_f32_check else gpu_checks.run_checks(dry_run=args.dry_run, dim=args.dim)
    for check in checks:
        print(gpu_checks.format_check(check), file=err, flush=True)
        print(json.dumps(check), flush=True)
    print(HEADER, file=err)
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for seq in args.seqs:
        for heads in args.heads:
            for causal in causals:
                row = dict(seq=seq, batch=max(1, args.tokens // seq), heads=heads, causal=causal)
                if time.perf_counter() - start > args.budget_s:
                    row["skipped"] = f"skipped: time budget of {args.budget_s:.0f} s spent"
                else:
                    try:
                        row = run_row(args, seq, heads, causal)
                    except Exception as e:  # our kernel failed (compile, OOM, ...): report it, go on
                        row.update(ok=False, error=_one_line(e))
                rows.append(row)
                print(format_row(row), file=err, flush=True)
                print(json.dumps(row), flush=True)
    done = [r for r in rows if "err" in r]
    ratios = [r["ratio_fwd"] for r in done if "ratio_fwd" in r]
    summary = dict(summary=True, rows=len(rows), checked=len(done), f32_checks_ok=all(c["ok"] for c in checks),
                   all_ok=all(r.get("ok", True) for r in rows + checks),
                   min_ratio_fwd=min(ratios) if ratios else None, target_fwd_ratio=TARGET_FWD_RATIO,
                   meets_target=bool(ratios) and min(ratios) >= TARGET_FWD_RATIO,
                   seconds=time.perf_counter() - start)
    print(json.dumps(summary), flush=True)
    print(f"# {len(done)}/{len(rows)} rows checked, {'all passed' if summary['all_ok'] else 'FAILED (see rows)'}; "
          f"min ours/{args.ref_impl} forward = {f'{min(ratios):.2f}' if ratios else 'n/a'} "
          f"(target >= {TARGET_FWD_RATIO}); {summary['seconds']:.0f} s", file=err)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
