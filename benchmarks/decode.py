"""Decode-mode benchmark: one token per step against a sequence-sharded KV cache vs a dense one.

    python -m benchmarks.bench --mode decode                      # 8 CPU devices, cache 8K..128K
    python -m benchmarks.bench --mode decode --lengths 8192,65536 --out decode.jsonl --plot decode.png

For each cache length S, on ``--devices`` simulated CPU devices: ``sharded`` is
``ringattn_fast.decode_step`` (the cache split over the ring, positions round-robin; local attention
per device, then one pmax and one psum) and ``dense`` is a single-device cache with the same step in
plain ``jnp`` (write the token, masked attention over all S slots, the same fused arithmetic). Both are jitted with the cache
donated and fed their own output cache, as a server would. Reported per S: median per-token latency
and tokens/s (batch / latency; compilation excluded, the two timed round-robin), the per-device cache
bytes (the K/V shard a device holds), XLA's per-device temp bytes (``memory_analysis()``), and the
collectives per token counted in the compiled program text (all-reduce, all-gather, all-to-all,
collective-permute, reduce-scatter). Both caches are filled with the same random K/V (the sharded one
in its striped order) up to ``S - repeats - 8`` tokens directly (a 128K prefill on CPU would take far longer than the decoding it sets up).
Each latency is also shown relative to the fastest impl at that length, measured in the same run.
One JSON object per line to stdout (or ``--out``), a configuration line and a markdown table to stderr.
"""
from __future__ import annotations

import argparse
import re

import numpy as np

from . import report
from .flags import dtype_flag
from .timing import Progress, time_interleaved

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench --mode decode", description=__doc__.split("\n")[0],
                                formatter_class=report.HelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = ring size")
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072", help="cache lengths S in tokens, comma list")
    p.add_argument("--batch", type=int, default=1, help="batch size (sequences decoded at once)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads of the cache")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="cache and token dtype",
                   type=dtype_flag(["float32", "bfloat16"]))
    p.add_argument("--repeats", type=int, default=30, help="decode steps timed per length; the median is kept")
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--plot", help="save a figure (latency and per-device memory over S) to this image file")
    return p.parse_args(argv)


def count_collectives(hlo_text):
    """Collective ops in a compiled program's text, by kind (an async pair ``-start``/``-done`` counts once)."""
    found = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo_text)
    return {name: found.count(name) for name in COLLECTIVES if found.count(name)}


def dense_step(q, k, v, cache):
    """One decode step on a dense single-device cache ``(ck, cv [b, S, hk, d], held int32 [b])``: write the
    token at ``held``, attend over slots ``<= held``. The same arithmetic as ``inference.attend_shard``
    (fused passes over the cache, no relayout), so the two differ only by the sharding and the merge."""
    import jax.numpy as jnp
    ck, cv, held = cache
    b, s, hk, d = ck.shape
    rows = jnp.arange(b)
    ck, cv = ck.at[rows, held].set(k[:, 0], mode="drop"), cv.at[rows, held].set(v[:, 0], mode="drop")
    h = q.shape[2]
    qg = (q[:, 0].astype(jnp.float32) * d ** -0.5).reshape(b, 1, hk, h // hk, d)
    logits = jnp.sum(ck.astype(jnp.float32)[:, :, :, None, :] * qg, axis=-1)  # (b, S, hk, g)
    seen = (jnp.arange(s)[None] <= held[:, None])[:, :, None, None]
    logits = jnp.where(seen, logits, -jnp.inf)
    m = logits.max(axis=1)
    p = jnp.exp(logits - m[:, None])
    o = jnp.sum(p[..., None] * cv.astype(jnp.float32)[:, :, :, None, :], axis=1) / p.sum(axis=1)[..., None]
    return o.reshape(b, 1, h, d).astype(q.dtype), (ck, cv, held + 1)


def setup(args, s, mesh):
    """``{name: (compiled step, token, cache, per-device cache bytes)}`` for cache length ``s``."""
    import jax
    import jax.numpy as jnp

    import ringattn_fast as rf
    from ringattn_fast.inference import KVCache
    from ringattn_ref.layouts import to_layout

    rng = np.random.default_rng(0)
    b, hk, d, dtype = args.batch, args.kv_heads, args.dim, jnp.dtype(args.dtype)
    held = s - args.repeats - 8
    tok = [jnp.asarray(rng.standard_normal((b, 1, h, d)), dtype) for h in (args.heads, hk, hk)]
    kv = np.asarray(jnp.asarray(rng.standard_normal((b, s, hk, d)), dtype))  # numpy: every put is a new buffer
    lengths = np.full((b,), held, np.int32)
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    striped = to_layout(kv, "striped", args.devices)  # the sharded cache's order: slot-major per device
    sharded = KVCache(put(striped, jax.P(None, "sp")), put(striped, jax.P(None, "sp")), put(lengths, jax.P()),
                      put(np.zeros(b, bool), jax.P()), n_hosts=args.devices, axis_name="sp")
    one = jax.devices()[0]
    dense = tuple(jax.device_put(x, one) for x in (kv, kv, lengths))
    out = {}
    step = jax.jit(lambda q, k, v, c: rf.decode_step(q, k, v, c, mesh=mesh), donate_argnums=3)
    out["sharded"] = (step.lower(*tok, sharded).compile(), tok, sharded,
                      sharded.k.addressable_shards[0].data.nbytes * 2)
    dense_tok = [jax.device_put(t, one) for t in tok]
    out["dense"] = (jax.jit(dense_step, donate_argnums=3).lower(*dense_tok, dense).compile(), dense_tok, dense,
                    dense[0].nbytes * 2)
    return out


def measure(args, s, mesh):
    """The rows of cache length ``s``: one per impl, its median step timed round-robin with the others'."""
    impls = setup(args, s, mesh)
    caches = {name: impl[2] for name, impl in impls.items()}

    def step(name, compiled, tok):
        def run():  # one token; the output cache feeds the next step, as a server would
            o, caches[name] = compiled(*tok, caches[name])
            return o
        return run

    latencies = time_interleaved([step(name, compiled, tok) for name, (compiled, tok, _, _) in impls.items()],
                                 args.repeats, warmup=1)
    rows = []
    for latency, (name, (compiled, _, _, cache_bytes)) in zip(latencies, impls.items()):
        rows.append(dict(impl=name, seq=s, devices=args.devices if name == "sharded" else 1, batch=args.batch,
                         heads=args.heads, kv_heads=args.kv_heads, dim=args.dim, dtype=args.dtype,
                         latency_s=latency, tokens_per_s=args.batch / latency, cache_bytes_per_device=int(cache_bytes),
                         temp_bytes_per_device=int(compiled.memory_analysis().temp_size_in_bytes),
                         collectives=count_collectives(compiled.as_text())))
    return rows


def table(rows):
    """Markdown: one line per (S, impl), its latency next to its ratio to the fastest impl at that S."""
    lines = ["| S | impl | devices | ms/token | vs fastest | tok/s | cache MiB/device | temp MiB/device | "
             "collectives/token |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fastest = min(o["latency_s"] for o in rows if o["seq"] == r["seq"])
        coll = ", ".join(f"{n} {name}" for name, n in r["collectives"].items()) or "none"
        lines.append(f"| {report.length_label(r['seq'])} | {r['impl']} | {r['devices']} | {1e3 * r['latency_s']:.2f} | "
                     f"{report.ratio(r['latency_s'], fastest)} | {r['tokens_per_s']:.0f} | "
                     f"{r['cache_bytes_per_device'] / 2**20:.2f} | {r['temp_bytes_per_device'] / 2**20:.2f} | {coll} |")
    return "\n".join(lines)


def config(args, lengths):
    """The configuration line's items (:func:`report.config_line`); decoding is causal by construction."""
    return dict(mode="decode", devices=args.devices, batch=args.batch, seq=report.lengths_label(lengths),
                heads=args.heads, kv_heads=args.kv_heads, dim=args.dim, dtype=args.dtype, causal="true",
                blocks="default", repeats=args.repeats)


def plot(rows, path):
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name in dict.fromkeys(r["impl"] for r in rows):  # the impls, in the order measured
        rs = sorted((r for r in rows if r["impl"] == name), key=lambda r: r["seq"])
        seq = [r["seq"] for r in rs]
        axes[0].plot(seq, [1e3 * r["latency_s"] for r in rs], "o-", label=name)
        axes[1].plot(seq, [r["cache_bytes_per_device"] / 2**20 for r in rs], "o-", label=f"{name} cache")
        axes[1].plot(seq, [r["temp_bytes_per_device"] / 2**20 for r in rs], "x--", label=f"{name} temp")
    axes[0].set_ylabel("ms per token (median)")
    axes[1].set_ylabel("MiB per device")
    for ax in axes:
        report.log2_length_axis(ax, [r["seq"] for r in rows], "cache length S (tokens)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import ringattn_fast as rf

    mesh = rf.make_mesh(args.devices)
    lengths = [int(x) for x in args.lengths.split(",")]
    progress = Progress(len(lengths))
    out = report.open_rows(args.out)
    rows = []
    for s in lengths:
        for row in measure(args, s, mesh):
            rows.append(row)
            report.emit(row, out)
        progress.step(f"S={report.length_label(s)} done")
    report.finish(rows, out, args, table, plot, config(args, lengths))
    return rows
