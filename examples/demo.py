"""Demo: the ring simulation on 8 virtual hosts against plain attention.

Run it as::

    python -m examples.demo [--out DIR] [--hosts 8] [--seq 64] [--heads 4] [--kv-heads 2] [--dim 16]

Runs ``ring_attention(..., return_trace=True)`` for non-causal and causal attention with the
contiguous, striped and zigzag layouts, compares each with ``attention`` (float64), prints the max
error, per-host peak bytes, bytes sent per step and the schedule (which K/V shard each host holds at
each step), and saves the schedule and work figures as PNG files in ``--out`` (default ``out/``).
``bash scripts/demo.sh`` runs it from the repository root after installing what it needs: it imports
``ringattn_ref``, numpy and matplotlib only (no jax), so that is all the script installs.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ringattn_ref import attention, cost, ring_attention, viz

ERROR_BAR = 1e-12  # float64 ring vs oracle (issue acceptance bar)
CASES = (("non-causal", False, "contiguous"), ("causal", True, "contiguous"),
         ("causal", True, "striped"), ("causal", True, "zigzag"))


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out", help="folder for the PNG figures (default: out)")
    p.add_argument("--hosts", type=int, default=8, help="number of virtual hosts (default: 8)")
    p.add_argument("--seq", type=int, default=64, help="sequence length, divisible by 2*hosts (default: 64)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="K/V heads (GQA when < heads; default: 2)")
    p.add_argument("--dim", type=int, default=16, help="head dimension (default: 16)")
    p.add_argument("--block", type=int, default=None, help="block_q = block_kv (default: half a shard)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hosts < 1 or args.seq < 1 or args.seq % (2 * args.hosts):
        p.error(f"--seq ({args.seq}) must be a positive multiple of 2 * --hosts ({2 * args.hosts}) "
                "so that every layout (zigzag included) splits evenly")
    return args


def schedule_table(trace):
    """The schedule as text: row = host, column = step, entry = K/V shard held ('.' = hop skipped)."""
    n_hosts, n_steps = trace.kv_idx.shape
    lines = ["         " + " ".join(f"s{s:<2}" for s in range(n_steps))]
    for i in range(n_hosts):
        cells = (f"{trace.kv_idx[i, s]:>2}{'.' if trace.hop_skipped[i, s] else ' '}" for s in range(n_steps))
        lines.append(f"host {i:<3} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    a = _args(argv)
    rng = np.random.default_rng(a.seed)
    q = rng.standard_normal((a.batch, a.seq, a.heads, a.dim))  # (b, s, h, d) float64
    k, v = (rng.standard_normal((a.batch, a.seq, a.kv_heads, a.dim)) for _ in range(2))  # (b, s, hk, d)
    shard = a.seq // a.hosts
    block = a.block if a.block is not None else max(1, shard // 2)
    print(f"Ring Attention simulation (arXiv:2310.01889): {a.hosts} hosts, batch {a.batch}, seq {a.seq} "
          f"({shard} tokens per host), heads {a.heads} (kv {a.kv_heads}), dim {a.dim}, float64, "
          f"tiles {block}x{block}\n")
    print(f"{'case':<24} {'max |ring - attention|':>22}  {'hops skipped':<12} {'critical path':>15}")
    traces, worst = {}, 0.0
    for mask, causal, layout in CASES:
        o, trace = ring_attention(q, k, v, n_hosts=a.hosts, causal=causal, layout=layout,
                                  block_q=block, block_kv=block, return_trace=True)
        err = float(np.max(np.abs(o - attention(q, k, v, causal=causal))))
        worst = max(worst, err)
        traces[(mask, layout)] = trace
        skipped = f"{int(trace.hop_skipped.sum())}/{trace.hop_skipped.size}"
        print(f"{mask + ' ' + layout:<24} {err:>22.1e}  {skipped:<12} {trace.critical_path():>10.3g} FLOP")
    base = traces[("causal", "contiguous")]
    for layout in ("striped", "zigzag"):
        ratio = traces[("causal", layout)].critical_path() / base.critical_path()
        print(f"causal critical path, {layout} / contiguous: {ratio:.2f}")
    print(f"max error over all cases: {worst:.1e} (bar {ERROR_BAR:g}): {'OK' if worst <= ERROR_BAR else 'FAIL'}\n")

    peak = base.peak_bytes
    same = "all equal" if np.all(peak == peak[0]) else "differ"
    print(f"per-host peak live bytes (q shard, K/V held + receive buffer, o, m, l, one score tile): "
          f"{', '.join(f'{int(p):,}' for p in peak)} ({same})")
    model = cost.step_bytes(shard, a.dim, batch=a.batch, kv_heads=a.kv_heads, dtype_bytes=q.itemsize)
    sent = base.bytes_sent[0]
    print("bytes sent per step by each host (K and V): "
          + ", ".join(f"s{s}: {int(b):,}" for s, b in enumerate(sent))
          + f"  (no send after the last step; cost.step_bytes = {model:,.0f};"
          f" plus {int(base.meta_bytes_sent[0, 0]):,} bytes of positions)\n")
    print("schedule, causal contiguous: host i holds K/V shard (i - step) mod N; '.' = hop skipped")
    print(schedule_table(base) + "\n")

    os.makedirs(a.out, exist_ok=True)
    figures = {"ring_schedule.png": viz.plot_schedule(base),
               "ring_work_contiguous.png": viz.plot_work_heatmap(base),
               "ring_work_striped.png": viz.plot_work_heatmap(traces[("causal", "striped")])}
    import matplotlib.pyplot as plt
    for name, fig in figures.items():
        path = os.path.join(a.out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"saved {'schedule' if 'schedule' in name else 'work'} figure: {path}")
    return 0 if worst <= ERROR_BAR else 1


if __name__ == "__main__":
    sys.exit(main())
