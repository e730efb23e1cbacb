"""Figures of notebook 15 (the 2-D hybrid, and load balance for packed documents).

- :func:`hybrid_holdings` / :func:`plot_hybrid` -- the hybrid's ``R x U`` grid of devices: which layout
  chunks and which heads device ``(r, u)`` holds before and after the all-to-all inside its group, the
  all-to-all along a row and the ring down the columns (``ringattn_ref.hybrid``'s rules: host
  ``p = r * U + u``, group ``r`` = chunks ``rU .. rU + U - 1``, heads group ``u``, ring ``(r, u) -> (r + 1, u)``);
- :func:`plot_work` -- work per host and ring step (``ringattn_ref.balance.work``) as heat maps, one per
  layout, with each layout's imbalance and critical path in its title;
- :func:`plot_layout` -- which host owns each true position, coloured by document.
"""
from __future__ import annotations

import numpy as np

ULYSSES_COLOR, RING_COLOR = "#27ae60", "#2c66b0"


def hybrid_holdings(ulysses_size, ring_size, heads):
    """What device ``(r, u)`` of a hybrid ``ulysses_size x ring_size`` holds, as ``ringattn_ref.hybrid``
    defines it: ``{(r, u): dict(before=(chunks, heads), after=(chunks, heads), ring_to=(r', u))}`` with
    chunks and heads as tuples of indices (chunks of the layout-ordered sequence, ``P = U * R`` of them).

    Before: chunk ``p = r * U + u``, all heads. After the all-to-all inside group ``r``: the group's
    chunks ``rU .. rU + U - 1`` on heads ``u * h / U .. (u + 1) * h / U - 1``; the ring sends to
    ``(r + 1) % R``. Example, U = 4, R = 2, 4 heads: device (1, 2) holds chunk 6 (heads 0-3), then
    chunks 4-7 of head 2, and sends its K/V to (0, 2).
    """
    u_size, r_size = int(ulysses_size), int(ring_size)
    if heads % u_size:
        raise ValueError(f"heads ({heads}) must be divisible by ulysses_size ({u_size})")
    hq = heads // u_size
    return {(r, u): dict(before=((r * u_size + u,), tuple(range(heads))),
                         after=(tuple(range(r * u_size, (r + 1) * u_size)), tuple(range(u * hq, (u + 1) * hq))),
                         ring_to=((r + 1) % r_size, u))
            for r in range(r_size) for u in range(u_size)}


def _device(ax, plt, x, y, held_chunks, held_heads, n_chunks, heads, label):
    """One device box at (x, y) (top left): a strip of the sequence's chunks and one of the heads."""
    w = max(n_chunks, heads) + 1.0
    ax.add_patch(plt.Rectangle((x, y), w, 3.4, fill=False, lw=1.2, edgecolor="black"))
    ax.text(x + w / 2, y + 0.55, label, ha="center", va="center", fontsize=8)
    for j in range(n_chunks):
        ax.add_patch(plt.Rectangle((x + 0.5 + j, y + 1.1), 0.9, 0.8,
                                   color=RING_COLOR if j in held_chunks else "#e6e6e6"))
    for j in range(heads):
        ax.add_patch(plt.Rectangle((x + 0.5 + j, y + 2.2), 0.9, 0.8,
                                   color=ULYSSES_COLOR if j in held_heads else "#e6e6e6"))
    return w


def plot_hybrid(ulysses_size, ring_size, heads):
    """Two panels of the ``ring_size`` rows x ``ulysses_size`` columns of devices: left, what each holds
    at the start (its layout chunk, all heads); right, after the all-to-all inside its row (its group's
    chunks, ``heads / U`` heads), with the all-to-all (green, along the row) and the ring (blue, down the
    column, back to the top). In each box the top strip is the sequence's ``U R`` chunks, the bottom strip
    the heads; a coloured cell is held."""
    from ringattn_ref.viz import pyplot

    plt = pyplot()
    u_size, r_size = int(ulysses_size), int(ring_size)
    n_chunks = u_size * r_size
    held = hybrid_holdings(u_size, r_size, heads)
    w, gap_x, gap_y = max(n_chunks, heads) + 1.0, 2.0, 2.2
    fig, axes = plt.subplots(2, 1, figsize=(max(1.9 * u_size + 1.0, 6.5), 2 * (1.0 * r_size + 0.7)),
                             layout="constrained")
    for ax, when in zip(axes, ("before", "after")):
        for (r, u), h in held.items():
            x, y = u * (w + gap_x), r * (3.4 + gap_y)
            chunks, hs = h[when]
            _device(ax, plt, x, y, chunks, hs, n_chunks, heads, f"({r}, {u}): host {r * u_size + u}")
            if when == "before":
                continue
            if u + 1 < u_size:  # the all-to-all inside the row
                ax.annotate("", xy=(x + w + gap_x, y + 1.7), xytext=(x + w, y + 1.7),
                            arrowprops=dict(arrowstyle="<->", color=ULYSSES_COLOR, lw=1.8))
            if r_size == 1:
                continue
            xm = x + w / 2
            if h["ring_to"][0] == r + 1:  # the ring: (r, u) -> (r + 1, u) ...
                ax.annotate("", xy=(xm - 0.6, y + 3.4 + gap_y), xytext=(xm - 0.6, y + 3.4),
                            arrowprops=dict(arrowstyle="->", color=RING_COLOR, lw=1.8))
            elif r_size == 2:  # ... and the last group back to the first: up, beside the down arrow
                ax.annotate("", xy=(xm + 0.6, 3.4), xytext=(xm + 0.6, y),
                            arrowprops=dict(arrowstyle="->", color=RING_COLOR, lw=1.8))
            else:  # ... around the column's left side
                ax.annotate("", xy=(x - 0.1, 1.7), xytext=(x - 0.1, y + 1.7),
                            arrowprops=dict(arrowstyle="->", color=RING_COLOR, lw=1.2, ls="--",
                                            connectionstyle="arc3,rad=-0.25"))
        ax.set_xlim(-1.5, u_size * (w + gap_x) - gap_x + 0.5)
        ax.set_ylim(r_size * (3.4 + gap_y) - gap_y + 0.3, -0.3)
        ax.set_axis_off()
    axes[0].set_title(f"start: device (r, u) holds layout chunk rU + u of {n_chunks} (blue), all {heads} heads "
                      f"(green)", fontsize=9)
    axes[1].set_title(f"after the all-to-all in its row (green arrows): the row's {u_size} chunks,\n"
                      f"{heads // u_size} of {heads} heads; the ring (blue arrows) runs down each column", fontsize=9)
    return fig


def plot_work(works, *, titles=None):
    """Heat maps of work per host (rows) and ring step (columns), one per entry of ``works`` (a dict
    ``name -> [N, N]`` array, ``ringattn_ref.balance.work``), on one colour scale; each title gives the
    layout's imbalance (slowest host / mean) and critical path (sum over steps of the slowest host)."""
    from ringattn_ref.viz import pyplot

    plt = pyplot()
    works = {name: np.asarray(w, np.float64) for name, w in works.items()}
    top = max(float(w.max()) for w in works.values()) or 1.0
    fig, axes = plt.subplots(1, len(works), figsize=(3.6 * len(works) + 0.8, 3.6), layout="constrained",
                             squeeze=False)
    for ax, (name, w) in zip(axes[0], works.items()):
        im = ax.imshow(w, cmap="magma_r", vmin=0, vmax=top, interpolation="nearest")
        totals = w.sum(axis=1)
        imb = totals.max() / totals.mean() if totals.sum() else 1.0
        ax.set_title((titles or {}).get(name, name) + f"\nimbalance {imb:.2f}, critical path "
                     f"{w.max(axis=0).sum():.0f}", fontsize=9)
        ax.set_xlabel("ring step")
        ax.set_ylabel("host")
        ax.set_xticks(range(w.shape[1]))
        ax.set_yticks(range(w.shape[0]))
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="tiles computed")
    return fig


def plot_layout(perm, n_hosts, doc_lengths, *, title=None):
    """Which host owns each true position under the layout ``perm`` (``perm[p]``: the true position at
    layout position ``p``; host ``i`` owns layout positions ``i S/N .. (i+1) S/N - 1``): one row per host,
    a mark at every position it owns, coloured by document (documents one after the other from 0)."""
    from ringattn_ref.viz import pyplot

    plt = pyplot()
    perm = np.asarray(perm)
    seq, n = perm.size, int(n_hosts)
    doc = np.searchsorted(np.cumsum(doc_lengths), np.arange(seq), side="right")  # document of each position
    owner = np.empty(seq, np.int64)
    owner[perm] = np.arange(seq) // (seq // n)
    fig, ax = plt.subplots(figsize=(9, 0.32 * n + 1.3), layout="constrained")
    colors = plt.get_cmap("tab10")(doc % 10)
    ax.scatter(np.arange(seq), owner, c=colors, marker="|", s=120)
    for end in np.cumsum(doc_lengths)[:-1]:
        ax.axvline(end - 0.5, color="grey", lw=0.6)
    ax.set_yticks(range(n))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(-0.5, seq - 0.5)
    ax.set_xlabel("true position (colour: document; grey lines: document boundaries)")
    ax.set_ylabel("host")
    ax.set_title(title or "which host owns each position", fontsize=9)
    return fig
