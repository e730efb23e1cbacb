"""Figures of the work inside one host: the online softmax state, the tile grid with skipping, a block mask.

Companions of :mod:`ringattn_ref.viz` (which draws the ring: schedule, per-hop masks, load, memory,
overlap) for the notebooks on the online softmax (01) and blockwise attention (02). Every function
returns a matplotlib ``Figure``.
"""
from __future__ import annotations

import numpy as np

from .masks import allowed, tile_is_empty
from .validation import check_window
from .viz import pyplot


def plot_online_softmax(logits, values, block):
    """One query row folded block by block into ``(m, l, o)`` (FA-2 Algorithm 1; BPT §3).

    logits: [k] one row of scaled logits; values: [k] a scalar value per key (one output channel);
    block: keys per block, dividing ``k``. Left: the logits, coloured by block, and the running max
    ``m``. Right: the running normalised output ``o / l`` after each block against the exact
    ``softmax(logits) @ values``: equal after the last block, not approximately but exactly.
    """
    plt = pyplot()
    logits = np.asarray(logits, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if logits.ndim != 1 or values.shape != logits.shape:
        raise ValueError(f"logits and values must be 1-D of equal length; got {logits.shape} and {values.shape}")
    if not isinstance(block, (int, np.integer)) or block < 1 or logits.size % block:
        raise ValueError(f"block must be a positive int dividing {logits.size}; got {block!r}")
    n_blocks = logits.size // block
    m, l, o = -np.inf, 0.0, 0.0
    ms, estimates = [], []
    for j in range(n_blocks):
        s = logits[j * block:(j + 1) * block]
        m_new = max(m, s.max())
        alpha = np.exp(m - m_new)  # rescale the old state to the new max
        p = np.exp(s - m_new)
        l, o, m = alpha * l + p.sum(), alpha * o + p @ values[j * block:(j + 1) * block], m_new
        ms.append(m)
        estimates.append(o / l)
    p = np.exp(logits - logits.max())
    exact = p @ values / p.sum()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    colors = plt.get_cmap("tab10")(np.arange(n_blocks) % 10)
    keys = np.arange(logits.size)
    ax.bar(keys, logits, color=np.repeat(colors, block, axis=0), width=0.85)
    edges = np.arange(n_blocks + 1) * block - 0.5
    ax.step(np.r_[edges[:-1], edges[-1]], np.r_[ms, ms[-1]], where="post", color="black", lw=2,
            label="running max m")
    ax.set_xlabel("key index (colour = block)")
    ax.set_ylabel("logit")
    ax.set_title("logits of one query row, seen one block at a time", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax2.plot(np.arange(1, n_blocks + 1), estimates, "o-", color="tab:blue", label="o / l after block j")
    ax2.axhline(exact, color="tab:red", ls="--", label="exact softmax(s) @ v")
    ax2.set_xticks(np.arange(1, n_blocks + 1))
    ax2.set_xlabel("blocks folded in")
    ax2.set_ylabel("output")
    ax2.set_title(f"running output: final error {abs(estimates[-1] - exact):.1e}", fontsize=10)
    ax2.legend(fontsize=8)
    return fig


def plot_tiles(q_pos, k_pos, block_q, block_kv, *, causal=True, window=None, title=None):
    """The ``block_q x block_kv`` tile grid of one attention problem: mask, computed and skipped tiles.

    q_pos: int [sq], k_pos: int [sk] true positions (a host's queries and the K/V shard it holds, or
    ``arange(seq)`` twice for one device). Blue: the query may see the key. Grey hatched tiles are
    skipped without computing, because :func:`ringattn_ref.masks.tile_is_empty` proves them empty
    from the min/max positions alone. The title counts computed / all tiles.
    """
    plt = pyplot()
    from matplotlib.patches import Rectangle

    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    window = check_window(window)
    for name, size, n in (("block_q", block_q, q_pos.size), ("block_kv", block_kv, k_pos.size)):
        if not isinstance(size, (int, np.integer)) or size < 1 or n % size:
            raise ValueError(f"{name} must be a positive int dividing {n}; got {size!r}")
    mask = allowed(q_pos[:, None], k_pos[None, :], causal=causal, window=window)  # (sq, sk)
    nq, nk = q_pos.size // block_q, k_pos.size // block_kv
    fig, ax = plt.subplots(figsize=(1.2 + 4.2 * k_pos.size / max(q_pos.size, k_pos.size),
                                    0.9 + 4.2 * q_pos.size / max(q_pos.size, k_pos.size)),
                           layout="constrained")
    ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest")
    computed = 0
    for i in range(nq):
        for j in range(nk):
            qs, ks = slice(i * block_q, (i + 1) * block_q), slice(j * block_kv, (j + 1) * block_kv)
            skip = tile_is_empty(q_pos[qs], k_pos[ks], causal=causal, window=window)
            computed += not skip
            ax.add_patch(Rectangle((j * block_kv - 0.5, i * block_q - 0.5), block_kv, block_q,
                                   fill=skip, facecolor=(0.85, 0.85, 0.85, 0.85), hatch="//" if skip else None,
                                   edgecolor="black", lw=1.2))
    ax.set_xlabel(f"key (block_kv = {block_kv})")
    ax.set_ylabel(f"query (block_q = {block_q})")
    ax.set_title(title or f"tiles computed: {computed} of {nq * nk} (hatched: skipped)", fontsize=10)
    return fig


def plot_block_mask(bm):
    """A :class:`ringattn_ref.block_mask.BlockMask`: every tile's kind, and which hops the ring computes.

    Left: the tiles of every (query host, K/V shard) pair, queries down and keys across in layout order
    (true order for ``"contiguous"``), thin lines between hosts and shards: white = empty (skipped),
    light blue = partial (computed and masked), dark blue = full (no mask needed). Right: the hops, host x
    ring step (host ``i`` holds shard ``(i - step) % N``): grey = empty, skipped whole.
    """
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    tiles, hops = np.asarray(bm.tiles), np.asarray(bm.hops, bool)
    if tiles.ndim != 4 or tiles.shape[0] != tiles.shape[1] or hops.shape != tiles.shape[:2]:
        raise ValueError(f"bm must be a BlockMask: tiles [n_hosts, n_hosts, nq, nk] and hops [n_hosts, n_hosts]; "
                         f"got tiles {tiles.shape}, hops {hops.shape}")
    n, _, nq, nk = tiles.shape
    grid = tiles.transpose(0, 2, 1, 3).reshape(n * nq, n * nk)  # (host, q tile) x (shard, k tile)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained",
                                  gridspec_kw=dict(width_ratios=(1.6, 1)))
    ax.imshow(grid, cmap=ListedColormap(["white", "#08306b", "#9ecae1"]), vmin=-0.5, vmax=2.5,
              interpolation="nearest", aspect="auto")
    for r in range(1, n):
        ax.axhline(r * nq - 0.5, color="black", lw=0.6)
        ax.axvline(r * nk - 0.5, color="black", lw=0.6)
    counts = bm.tile_counts()
    ax.set_title(f"tiles: {counts['empty']} empty (skipped, {bm.skipped_fraction:.0%}), {counts['partial']} "
                 f"partial, {counts['full']} full", fontsize=10)
    ax.set_xlabel(f"key tile, by K/V shard ({nk} per shard)")
    ax.set_ylabel(f"query tile, by host ({nq} per host)")
    rgba = np.where(hops[..., None], np.array(plt.get_cmap("Blues")(0.75)), np.array([0.82, 0.82, 0.82, 1.0]))
    ax2.imshow(rgba, interpolation="nearest")
    for i in range(n):
        for step in range(n):
            ax2.text(step, i, str((i - step) % n), ha="center", va="center", fontsize=8,
                     color="white" if hops[i, step] else "black")
    ax2.set_xlabel("ring step (number: the K/V shard held)")
    ax2.set_ylabel("host")
    ax2.set_title(f"hops: {bm.empty_hop_fraction:.0%} empty (grey); built in {bm.seconds:.2f} s", fontsize=10)
    return fig
