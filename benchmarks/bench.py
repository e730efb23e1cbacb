"""Benchmark: ``ringattn_fast.ring_attention`` vs ``jax.nn.dot_product_attention`` vs the authors' package.

    python -m benchmarks.bench                       # 8 CPU devices, b=1, S=8192, h=4, d=64, fp32
    python -m benchmarks.bench --seq 2048 --causal true --out runs.jsonl --plot bench.png
    python -m benchmarks.bench --gpu-kernel [--quick]   # on a GPU: the Pallas Triton kernel vs cuDNN
    python -m benchmarks.bench --mode decode            # decoding against a sharded KV cache (decode.py)
    python -m benchmarks.bench --mode strategies        # ring vs all-gather vs Ulysses (strategies.py)

(from the repository root: ``benchmarks`` is a folder of the checkout, not an installed package).

In one process, on ``--devices`` simulated CPU devices, for causal and non-causal attention:
``ours`` (``ring_attention``, impl="xla"), ``dense`` (``jax.nn.dot_product_attention`` on one device)
and ``authors`` (PyPI ``ringattention`` 0.1.2, wrapped in ``shard_map`` as its README does; skipped
if not installed). For each: max abs error of the output and of (dq, dk, dv) against a float64 oracle
(``ringattn_ref`` on one host, blockwise), median wall time of the jitted forward and forward+backward
(compilation excluded; the implementations are timed round-robin), and XLA's per-device temp bytes
(``memory_analysis().temp_size_in_bytes``). One JSON object per line goes to stdout (or ``--out``), a
progress bar and a table to stderr.

The authors' package predates jax 0.8; :mod:`benchmarks.authors` imports it with the stand-ins it
needs (``jax.lib.xla_bridge.get_backend``, empty ``flax`` modules).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import numpy as np

from . import bench_gpu, decode, report
from .authors import import_ring_attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = ring size (default 8)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--block", type=int, default=512,
                   help="the authors' query_chunk_size = key_chunk_size (default 512)")
    p.add_argument("--ours-block-q", type=int, default=None, help="ours' block_q (default: its own default)")
    p.add_argument("--ours-block-kv", type=int, default=None, help="ours' block_kv (default: its own default)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is kept")
    p.add_argument("--impls", default="ours,dense,authors", help="comma list of ours, dense, authors")
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--plot", help="save a bar chart (time and memory) to this image file")
    return p.parse_args(argv)


class Progress:
    """A plain-text progress bar on stderr: ``[#####.....] 5/10 ours causal fwd+bwd``."""

    def __init__(self, total, width=30):
        self.total, self.done, self.width, self.start = total, 0, width, time.perf_counter()

    def step(self, label):
        self.done += 1
        filled = self.width * self.done // self.total
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.0f}s  {label:<40}")
        sys.stderr.write("\n" if self.done == self.total else "")
        sys.stderr.flush()


def make_impls(args, mesh, authors):
    """name -> (f(q, k, v) -> o for causal=False, same for causal=True, input placement)."""
    import jax
    import jax.numpy as jnp

    import ringattn_fast as rf

    sharded = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    impls = {}
    for name in args.impls.split(","):
        if name == "ours":
            impls[name] = (lambda causal: partial(rf.ring_attention, mesh=mesh, causal=causal, impl="xla",
                                                  block_q=args.ours_block_q, block_kv=args.ours_block_kv), sharded)
        elif name == "dense":
            impls[name] = (lambda causal: partial(jax.nn.dot_product_attention, is_causal=causal,
                                                  implementation="xla"), one_device)
        elif name == "authors" and authors is not None:
            def authors_fn(causal):
                kwargs = dict(causal_block_size=1 if causal else None, query_chunk_size=args.block,
                              key_chunk_size=args.block, deterministic=True, dropout_rng=None,
                              attn_pdrop=0.0, policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=True, dtype=jnp.dtype(args.dtype), precision=None)
                per_host = lambda q, k, v: authors(q, k, v, None, None, None, "sp", True, kwargs)  # noqa: E731
                spec = jax.P(None, "sp")
                return jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
            impls[name] = (authors_fn, sharded)
        elif name == "authors":
            print("authors' package `ringattention` is not installed: skipped (pip install ringattention==0.1.2)",
                  file=sys.stderr)
        else:
            raise SystemExit(f"unknown impl {name!r}; choose from ours, dense, authors")
    return impls


def compile_one(fn, inputs):
    """``(compiled, temp bytes)`` of ``jit(fn)`` for ``inputs``, run once (warm-up)."""
    import jax
    compiled = jax.jit(fn).lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def time_interleaved(jobs, repeats):
    """Median seconds of each compiled ``(fn, inputs)`` job, timed round-robin: on a shared machine a
    load spike then hits every implementation alike instead of biasing whichever ran during it."""
    import jax
    times = [[] for _ in jobs]
    for _ in range(repeats):
        for t, (compiled, inputs) in zip(times, jobs):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*inputs))
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def oracle(q, k, v, do, causal, block):
    """float64 output and (dq, dk, dv) from ringattn_ref on one host (blockwise: no [S, S] array)."""
    import ringattn_ref as ref
    kw = dict(n_hosts=1, causal=causal, block_q=min(block, q.shape[1]), block_kv=min(4 * block, q.shape[1]))
    return ref.ring_attention(q, k, v, **kw), ref.ring_attention_vjp(q, k, v, do, **kw)


def table(rows):
    """A markdown table of the JSON rows, with ours' fwd+bwd speedup over the authors' package."""
    head = ("| impl | causal | fwd s | fwd+bwd s | temp fwd MiB | temp fwd+bwd MiB | max err o | max err grads |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['causal']} | {r['fwd_s']:.3f} | {r['fwd_bwd_s']:.3f} | "
                     f"{r['temp_fwd_bytes'] / 2**20:.1f} | {r['temp_fwd_bwd_bytes'] / 2**20:.1f} | "
                     f"{r['err_o']:.1e} | {r['err_grads']:.1e} |")
    for causal in sorted({r["causal"] for r in rows}):
        by = {r["impl"]: r for r in rows if r["causal"] == causal}
        if "ours" in by and "authors" in by:
            lines.append(f"\ncausal={causal}: ours vs authors, fwd+bwd speedup "
                         f"{by['authors']['fwd_bwd_s'] / by['ours']['fwd_bwd_s']:.2f}x, fwd speedup "
                         f"{by['authors']['fwd_s'] / by['ours']['fwd_s']:.2f}x, temp fwd+bwd "
                         f"{by['ours']['temp_fwd_bwd_bytes'] / by['authors']['temp_fwd_bwd_bytes']:.2f}x")
    return "\n".join(lines)


def plot(rows, path):
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    labels = [f"{r['impl']}\n{'causal' if r['causal'] else 'full'}" for r in rows]
    x = np.arange(len(rows))
    axes[0].bar(x - 0.2, [r["fwd_s"] for r in rows], 0.4, label="fwd")
    axes[0].bar(x + 0.2, [r["fwd_bwd_s"] for r in rows], 0.4, label="fwd+bwd")
    axes[0].set_ylabel("median seconds")
    axes[1].bar(x - 0.2, [r["temp_fwd_bytes"] / 2**20 for r in rows], 0.4, label="fwd")
    axes[1].bar(x + 0.2, [r["temp_fwd_bwd_bytes"] / 2**20 for r in rows], 0.4, label="fwd+bwd")
    axes[1].set_ylabel("temp MiB per device")
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=8)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu-kernel" in argv:  # issue 4's GPU check lives in its own module
        return bench_gpu.main([a for a in argv if a != "--gpu-kernel"])
    if "--mode" in argv:  # --mode train (this module, the default), decode (decode.py), strategies (strategies.py)
        i = argv.index("--mode")
        mode, argv = (argv[i + 1:i + 2] or [""])[0], argv[:i] + argv[i + 2:]
        if mode not in ("train", "decode", "strategies"):
            raise SystemExit(f"--mode must be train, decode or strategies; got {mode!r}")
        if mode == "decode":
            return decode.main(argv)
        if mode == "strategies":
            from . import strategies
            return strategies.main(argv)
    args = parse_args(argv)
    args.block = min(args.block, args.seq // args.devices)  # a chunk cannot exceed the per-device shard
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp

    import ringattn_fast as rf

    authors = import_ring_attention() if "authors" in args.impls.split(",") else None
    mesh = rf.make_mesh(args.devices)
    impls = make_impls(args, mesh, authors)
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q64, k64, v64, do64 = (rng.standard_normal(shape) for _ in range(4))
    progress = Progress(len(causals) * (2 + 2 * len(impls)))
    out = report.open_rows(args.out)
    rows = []
    for causal in causals:
        want_o, want_grads = oracle(q64, k64, v64, do64, causal, args.block)
        progress.step(f"float64 oracle causal={causal}")
        jobs, results = [], {}
        for name, (make, placement) in impls.items():
            q, k, v, do = (jax.device_put(jnp.asarray(x, args.dtype), placement) for x in (q64, k64, v64, do64))
            attn = make(causal)

            def fwd_bwd(q, k, v, do, attn=attn):
                o, vjp = jax.vjp(attn, q, k, v)
                return o, vjp(do)

            fwd, temp_fwd = compile_one(attn, (q, k, v))
            progress.step(f"{name} causal={causal} compile fwd")
            both, temp_fwd_bwd = compile_one(fwd_bwd, (q, k, v, do))
            progress.step(f"{name} causal={causal} compile fwd+bwd")
            o, grads = both(q, k, v, do)
            results[name] = dict(
                temp_fwd_bytes=int(temp_fwd), temp_fwd_bwd_bytes=int(temp_fwd_bwd),
                err_o=float(np.max(np.abs(np.asarray(o, np.float64) - want_o))),
                err_grads=max(float(np.max(np.abs(np.asarray(g, np.float64) - w)))
                              for g, w in zip(grads, want_grads)))
            jobs += [(fwd, (q, k, v)), (both, (q, k, v, do))]
        medians = time_interleaved(jobs, args.repeats)
        progress.step(f"timing causal={causal} ({args.repeats} rounds)")
        for n, name in enumerate(impls):
            row = dict(impl=name, causal=causal, devices=args.devices if name != "dense" else 1, batch=args.batch,
                       seq=args.seq, heads=args.heads, dim=args.dim, dtype=args.dtype,
                       block=args.block if name == "authors" else None,
                       fwd_s=medians[2 * n], fwd_bwd_s=medians[2 * n + 1], **results[name])
            rows.append(row)
            report.emit(row, out)
    report.finish(rows, out, args, table, plot)
    return rows


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
