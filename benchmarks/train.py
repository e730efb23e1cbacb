"""Train mode (the default of ``python -m benchmarks.bench``): one attention call's forward and
forward+backward, the shape of a training step, for ``ringattn_fast.ring_attention`` vs
``jax.nn.dot_product_attention`` vs the authors' package.

    python -m benchmarks.bench                       # 8 CPU devices, b=1, S=8192, h=4, d=64, fp32
    python -m benchmarks.bench --seq 2048 --causal true --out runs.jsonl --plot bench.png

In one process, on ``--devices`` simulated CPU devices, for causal and non-causal attention:
``ours`` (``ring_attention``, impl="xla"), ``dense`` (``jax.nn.dot_product_attention`` on one device)
and ``authors`` (PyPI ``ringattention`` 0.1.2, wrapped in ``shard_map`` as its README does; skipped
if not installed). For each: max abs error of the output and of (dq, dk, dv) against a float64 oracle
(``ringattn_ref`` on one host, blockwise), median wall time of the jitted forward and forward+backward
(compilation excluded; the implementations are timed round-robin), and XLA's per-device temp bytes
(``memory_analysis().temp_size_in_bytes``), each also as a ratio to ``ours`` measured in the same run.
One JSON object per line goes to stdout (or ``--out``), a progress bar, a configuration line and a
table to stderr.

The authors' package predates jax 0.8; :mod:`benchmarks.authors` imports it with the stand-ins it
needs (``jax.lib.xla_bridge.get_backend``, empty ``flax`` modules).
"""
from __future__ import annotations

import argparse
import sys
from functools import partial

import numpy as np

from . import report
from .authors import import_ring_attention
from .flags import dtype_flag
from .timing import Progress, time_interleaved

IMPLS = ("ours", "dense", "authors")


def add_arguments(p):
    """Train mode's options (``benchmarks.bench`` adds them to its own parser, beside ``--mode``)."""
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = ring size")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--seq", type=int, default=8192, help="sequence length in tokens")
    p.add_argument("--heads", type=int, default=4, help="attention heads (K/V too)")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="input dtype",
                   type=dtype_flag(["float32", "bfloat16", "float16"]))
    p.add_argument("--causal", default="both", choices=["both", "true", "false"], help="causal mask, or both runs")
    p.add_argument("--block", type=int, default=512,
                   help="the authors' query_chunk_size = key_chunk_size, at most seq / devices")
    p.add_argument("--ours-block-q", type=int, default=None, help="ours' block_q (omitted: its own default)")
    p.add_argument("--ours-block-kv", type=int, default=None, help="ours' block_kv (omitted: its own default)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is kept")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--plot", help="save a bar chart (time and memory) to this image file")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench --mode train", description=__doc__.split("\n")[0],
                                formatter_class=report.HelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


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
            raise SystemExit(f"--impls: unknown impl {name!r}; choose from {', '.join(IMPLS)}")
    return impls


def compile_one(fn, inputs):
    """``(compiled, temp bytes)`` of ``jit(fn)`` for ``inputs``, run once (warm-up)."""
    import jax
    compiled = jax.jit(fn).lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def oracle(q, k, v, do, causal, block):
    """float64 output and (dq, dk, dv) from ringattn_ref on one host (blockwise: no [S, S] array)."""
    import ringattn_ref as ref
    kw = dict(n_hosts=1, causal=causal, block_q=min(block, q.shape[1]), block_kv=min(4 * block, q.shape[1]))
    return ref.ring_attention(q, k, v, **kw), ref.ring_attention_vjp(q, k, v, do, **kw)


TIMES = (("fwd_s", "fwd s"), ("fwd_bwd_s", "fwd+bwd s"))
TEMPS = (("temp_fwd_bytes", "temp fwd MiB"), ("temp_fwd_bwd_bytes", "temp fwd+bwd MiB"))


def table(rows):
    """A markdown table of the JSON rows: each time and temp memory next to its ratio to ``ours``
    (or, without ours, to the first impl) at the same causal setting, all from this run."""
    base = "ours" if any(r["impl"] == "ours" for r in rows) else rows[0]["impl"] if rows else "ours"
    cols = [c for _, name in TIMES + TEMPS for c in (name, f"{name.rsplit(' ', 1)[0]} vs {base}")]
    lines = ["| impl | causal | " + " | ".join(cols) + " | max err o | max err grads |",
             "|---|---|" + "---|" * len(cols) + "---|---|"]
    for r in rows:
        ref = next((b for b in rows if b["impl"] == base and b["causal"] == r["causal"]), None)
        cells = []
        for key, _ in TIMES:
            cells += [f"{r[key]:.3f}", report.ratio(r[key], ref and ref[key])]
        for key, _ in TEMPS:
            cells += [f"{r[key] / 2**20:.1f}", report.ratio(r[key], ref and ref[key])]
        lines.append(f"| {r['impl']} | {r['causal']} | " + " | ".join(cells) +
                     f" | {r['err_o']:.1e} | {r['err_grads']:.1e} |")
    return "\n".join(lines)


def config(args, impls):
    """The configuration line's items (:func:`report.config_line`)."""
    q, kv = args.ours_block_q, args.ours_block_kv
    blocks = "ours default" if q is None and kv is None else f"ours {q or 'default'}x{kv or 'default'}"
    if "authors" in impls:
        blocks += f", authors {args.block}x{args.block}"
    return dict(mode="train", devices=args.devices, batch=args.batch, seq=args.seq, heads=args.heads, dim=args.dim,
                dtype=args.dtype, causal=args.causal, blocks=blocks, repeats=args.repeats, impls=",".join(impls))


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
    """Parse train mode's options (no ``--mode``), run it: the rows, as dicts."""
    return run(parse_args(argv))


def run(args):
    """Measure every impl at every causal setting; emit the rows, print the table; return the rows."""
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
            jobs += [partial(fwd, q, k, v), partial(both, q, k, v, do)]
        medians = time_interleaved(jobs, args.repeats)
        progress.step(f"timing causal={causal} ({args.repeats} rounds)")
        for n, name in enumerate(impls):
            row = dict(impl=name, causal=causal, devices=args.devices if name != "dense" else 1, batch=args.batch,
                       seq=args.seq, heads=args.heads, dim=args.dim, dtype=args.dtype,
                       block=args.block if name == "authors" else None,
                       fwd_s=medians[2 * n], fwd_bwd_s=medians[2 * n + 1], **results[name])
            rows.append(row)
            report.emit(row, out)
    report.finish(rows, out, args, table, plot, config(args, list(impls)))
    return rows

