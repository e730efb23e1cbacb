"""Figures of notebook 13 (ring, all-gather, Ulysses side by side); the timeline is in ``timeline.py``.

- :func:`resident` / :func:`plot_strategies` -- what each host holds when it attends: which
  sequence blocks and which head groups of q and of k/v, from the simulations' own index rules
  (the ring's ``kv_idx = (my_idx - step) % N``, ``strategies.ulysses_heads``);
- :func:`plot_memory_vs_seq` -- per-device memory against the sequence length, measured next to the
  cost model's prediction.
"""
from __future__ import annotations

import numpy as np

from ringattn_ref.strategies import ulysses_heads

STRATEGY_COLORS = {"ring": "#2c66b0", "allgather": "#c0392b", "ulysses": "#27ae60"}
TITLES = {"ring": "ring: its queries, one K/V shard at a time",
          "allgather": "all-gather: its queries, all K/V",
          "ulysses": "Ulysses: all tokens, heads / N"}


def resident(strategy, n_hosts, *, step=0, heads=None):
    """``(q, kv)`` boolean arrays ``[n_hosts, n_blocks, n_groups]``: does host ``i`` hold sequence
    block ``b`` of head group ``g`` while it attends (at ring step ``step``)? ``n_blocks = n_groups =
    n_hosts``; heads default to ``n_hosts`` (one head group per host for Ulysses)."""
    n = n_hosts
    heads = n if heads is None else heads
    q, kv = np.zeros((n, n, n), bool), np.zeros((n, n, n), bool)
    for i in range(n):
        if strategy == "ring":
            q[i, i], kv[i, (i - step) % n] = True, True  # the authors' index arithmetic
        elif strategy == "allgather":
            q[i, i], kv[i] = True, True
        elif strategy == "ulysses":
            group = ulysses_heads(heads, heads, n, i)[0].start * n // heads
            q[i, :, group], kv[i, :, group] = True, True
        else:
            raise ValueError(f"strategy must be 'ring', 'allgather' or 'ulysses'; got {strategy!r}")
    return q, kv


def plot_strategies(n_hosts=4, *, step=1):
    """Three panels, one per strategy: for each host a row of q and a row of k/v, cut into
    ``n_hosts`` sequence blocks x ``n_hosts`` head groups; a filled cell is held while attending."""
    from ringattn_ref.viz import pyplot

    plt = pyplot()
    n = n_hosts
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.75 * n + 1.6), layout="constrained")
    for ax, name in zip(axes, ("ring", "allgather", "ulysses")):
        q, kv = resident(name, n, step=step)
        for i in range(n):
            for row, held, alpha in ((2 * i, q[i], 0.45), (2 * i + 1, kv[i], 1.0)):
                for blk in range(n):
                    for g in range(n):
                        color = STRATEGY_COLORS[name] if held[blk, g] else "#eeeeee"
                        ax.add_patch(plt.Rectangle((blk * n + g, row), 0.92, 0.85, color=color,
                                                   alpha=alpha if held[blk, g] else 1.0))
        ax.set_xlim(0, n * n)
        ax.set_ylim(2 * n, 0)
        ax.set_yticks([r + 0.45 for r in range(2 * n)],
                      [f"host {r // 2} {'q' if r % 2 == 0 else 'kv'}" for r in range(2 * n)], fontsize=8)
        ax.set_xticks([blk * n + n / 2 for blk in range(n)], [f"block {blk}" for blk in range(n)], fontsize=8)
        ax.set_xlabel("sequence blocks (each cut into head groups)", fontsize=8)
        ax.set_title(TITLES[name] + (f" (step {step})" if name == "ring" else ""), fontsize=9)
    return fig


def plot_memory_vs_seq(seqs, measured, predicted=None, *, title=None, xlabel="sequence length S"):
    """Per-device bytes against the sequence length, log-log: ``measured`` (solid, dots) and
    ``predicted`` (dashed) are dicts ``strategy -> bytes per seq``."""
    from matplotlib.ticker import ScalarFormatter

    from ringattn_ref.viz import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for name, values in measured.items():
        ax.plot(seqs, np.asarray(values) / 2**20, "o-", color=STRATEGY_COLORS[name], label=f"{name} (measured)")
    for name, values in (predicted or {}).items():
        ax.plot(seqs, np.asarray(values) / 2**20, "--", color=STRATEGY_COLORS[name], alpha=0.7,
                label=f"{name} (cost model)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks(seqs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB per device")
    ax.set_title(title or "per-device memory against the sequence")
    ax.legend(fontsize=8)
    return fig
