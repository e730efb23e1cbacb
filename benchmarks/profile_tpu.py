"""Where the time goes on a TPU: the device ops of ours, splash attention and the XLA hop, from a profile.

    python -m benchmarks.profile_tpu --seq 8192 --heads 8 --causal     # a TPU (about a minute)
    python -m benchmarks.profile_tpu --dry-run                         # CPU, tiny shapes (tests this script)

Each function (the forward, or with ``--backward`` the forward+backward, of ``ring_attention`` at its
defaults, of ``impl="xla"``, and of splash attention in its own layout and called from ``[b, s, h, d]``) runs
``--repeats`` times under ``jax.profiler``; the events of the device's plane are summed by name (a Pallas
kernel, an XLA fusion, a copy) and averaged per call. One JSON object per function to stdout (its ops,
largest first, in microseconds per call), and the top of each to stderr. Read it beside
``benchmarks.bench_tpu``: the sum of a function's ops is its device time, the wall time less the host's.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
from functools import partial


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_tpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--seq", type=int, default=None, help="tokens (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="profile forward+backward (default: forward)")
    p.add_argument("--kinds", default="ours,splash,splash_bshd,xla", help="comma list of ours, splash, splash_bshd, xla")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="ops per function on stderr")
    args = p.parse_args(argv)
    args.seq = args.seq or (256 if args.dry_run else 8192)
    if args.seq < 1 or args.repeats < 1:
        p.error(f"--seq and --repeats must be >= 1; got {args.seq}, {args.repeats}")
    return args


def functions(args):
    """{kind: (fn, args)}: each a jitted call of one attention (the forward, or forward+backward)."""
    import jax
    import jax.numpy as jnp
    import ringattn_fast as rf

    s, h, d = args.seq, args.heads, args.dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for key in keys)
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def jitted(attn):
        if not args.backward:
            return jax.jit(lambda q, k, v, do: attn(q, k, v))
        return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))

    out = {}
    kinds = args.kinds.split(",")
    if "ours" in kinds:
        ours = dict(impl="pallas_tpu") if args.dry_run else {}
        out["ours"] = (jitted(partial(rf.ring_attention, mesh=mesh, causal=args.causal, **ours)), (q, k, v, do))
    if "xla" in kinds:
        out["xla"] = (jitted(partial(rf.ring_attention, mesh=mesh, causal=args.causal, impl="xla")), (q, k, v, do))
    if {"splash", "splash_bshd"} & set(kinds):
        from .bench_tpu import splash_kernel
        kernel = splash_kernel(s, h, causal=args.causal, fused_bwd=not args.dry_run, interpret=args.dry_run)
        t = lambda x: x.swapaxes(1, 2)  # noqa: E731
        if "splash" in kinds:
            out["splash"] = (jitted(kernel), tuple(t(x) for x in (q * d ** -0.5, k, v, do)))
        if "splash_bshd" in kinds:
            out["splash_bshd"] = (jitted(lambda q, k, v: t(kernel(t(q * d ** -0.5), t(k), t(v)))), (q, k, v, do))
    return out


def profile(fn, data, repeats):
    """{op name: microseconds per call} of ``fn(*data)``, summed over the device plane's events."""
    import jax
    from jax._src.profiler import ProfileData

    jax.block_until_ready(fn(*data))  # compiled and warm
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(repeats):
            jax.block_until_ready(fn(*data))
        jax.profiler.stop_trace()
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        prof = ProfileData.from_file(paths[0])
    totals = collections.Counter()
    on_device = jax.default_backend() != "cpu"  # a CPU (the dry run) has no device plane: its XLA threads
    for plane in prof.planes:
        if plane.name != ("/device:TPU:0" if on_device else "/host:CPU"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops" if on_device else not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                totals[ev.name] += ev.duration_ns / 1e3 / repeats
    return dict(totals.most_common())


def main(argv=None):
    """Profile each kind; 0, or 2 without a TPU and no --dry-run."""
    args = parse_args(argv)
    import jax
    if not args.dry_run and jax.default_backend() != "tpu":
        print("profile_tpu: no TPU; use --dry-run", file=sys.stderr)
        return 2
    for kind, (fn, data) in functions(args).items():
        ops = profile(fn, data, args.repeats)
        row = dict(kind=kind, seq=args.seq, heads=args.heads, dim=args.dim, causal=args.causal,
                   backward=args.backward, device_us=sum(ops.values()), ops_us=ops)
        print(json.dumps(row), flush=True)
        print(f"# {kind}: {row['device_us']:.0f} us of device ops per call", file=sys.stderr)
        for name, us in list(ops.items())[:args.top]:
            print(f"  {us:9.1f}  {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
