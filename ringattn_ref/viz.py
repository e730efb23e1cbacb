"""Figures for the ring: schedule, per-hop masks, work per host, memory (Table 1), overlap (§3).

Every function returns a matplotlib ``Figure``. matplotlib is imported inside the functions (the
rest of ``ringattn_ref`` does not need it); without a display and without ``MPLBACKEND`` the
non-interactive Agg backend is used. Traces are the :class:`ringattn_ref.ring.RingTrace` of
``ring_attention(..., return_trace=True)``; only their arrays are read.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from . import cost
from .layouts import layout_permutation
from .masks import allowed, tile_is_empty
from .validation import check_window

SKIPPED_GREY = (0.82, 0.82, 0.82, 1.0)


def pyplot():
    """``matplotlib.pyplot``, switched to the Agg backend first when there is no display and no ``MPLBACKEND``."""
    import matplotlib
    headless = not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and not os.environ.get("MPLBACKEND") and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _layout_name(trace):
    layout = getattr(trace, "layout", "custom")
    return layout if isinstance(layout, str) else "custom"


def plot_schedule(trace):
    """Which K/V shard each host holds at each step: a hosts x steps grid (Algorithm 1).

    Cell ``(host i, step s)`` shows ``kv_idx[i, s] = (i - s) mod N``: shards move one host down per
    step. Hops the mask leaves empty (skipped, no compute) are grey.
    """
    plt = pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    kv_idx = np.asarray(trace.kv_idx)  # (hosts, steps)
    skipped = np.asarray(trace.hop_skipped, dtype=bool)  # (hosts, steps)
    n_hosts, n_steps = kv_idx.shape
    # Categorical colours without the palettes' greys (grey means "skipped" here).
    if n_hosts <= 18:
        base = plt.get_cmap("tab10" if n_hosts <= 9 else "tab20").colors
        greys = (7,) if n_hosts <= 9 else (14, 15)
        cmap = ListedColormap([c for j, c in enumerate(base) if j not in greys][:n_hosts])
    else:
        cmap = plt.get_cmap("viridis")
    norm = BoundaryNorm(np.arange(n_hosts + 1) - 0.5, cmap.N)
    rgba = cmap(norm(kv_idx))  # (hosts, steps, 4)
    rgba[skipped] = SKIPPED_GREY
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * n_steps, 1.2 + 0.5 * n_hosts), layout="constrained")
    ax.imshow(rgba, aspect="auto")
    for i in range(n_hosts):
        for s in range(n_steps):
            label = f"{kv_idx[i, s]}" + ("\nskip" if skipped[i, s] else "")
            dark = rgba[i, s, :3] @ (0.299, 0.587, 0.114) < 0.5  # luminance: white text on dark cells
            ax.text(s, i, label, ha="center", va="center", fontsize=9 if not skipped[i, s] else 7,
                    color="0.35" if skipped[i, s] else "white" if dark else "black")
    ax.set_xticks(range(n_steps))
    ax.set_yticks(range(n_hosts))
    ax.set_xlabel("step")
    ax.set_ylabel("host")
    ax.set_title(f"Ring schedule, {n_hosts} hosts, layout={_layout_name(trace)}\n"
                 f"host i holds K/V shard (i - step) mod {n_hosts}", fontsize=10)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, ticks=range(n_hosts), label="K/V shard index")
    if skipped.any():
        fig.legend(handles=[Patch(color=SKIPPED_GREY, label="hop skipped (mask empty, no compute)")],
                   loc="outside lower center", fontsize=8, frameon=False)
    return fig


def plot_hop_masks(seq, n_hosts, layout="contiguous", causal=True, window=None, host=None):
    """The mask each host applies at each hop, from true positions (blue = query may see key).

    Rows are hosts (or only ``host``), columns are steps; panel ``(r, s)`` is the
    ``[shard, shard]`` mask between host r's queries and K/V shard ``(r - s) mod N``. Grey panels are
    hops skipped as provably empty (``masks.tile_is_empty``). The title of each panel gives the
    number of visible pairs: with a causal mask, contiguous hosts get 0 or all of them, striped and
    zigzag hosts about half each (Brandon et al. 2023).
    """
    plt = pyplot()
    window = check_window(window)
    perm = layout_permutation(layout, seq, n_hosts)
    shard = seq // n_hosts
    hosts = range(n_hosts) if host is None else [host]
    if host is not None and not (isinstance(host, (int, np.integer)) and 0 <= host < n_hosts):
        raise ValueError(f"host must be an int in [0, {n_hosts}) or None; got {host!r}")
    size = 1.25 if n_hosts > 4 else 1.8
    fig, axes = plt.subplots(len(hosts), n_steps := n_hosts, squeeze=False, layout="constrained",
                             figsize=(0.6 + size * n_steps, 0.9 + size * len(hosts)))
    for row, r in enumerate(hosts):
        q_pos = perm[r * shard:(r + 1) * shard]
        for s in range(n_steps):
            kv = (r - s) % n_hosts
            k_pos = perm[kv * shard:(kv + 1) * shard]
            mask = allowed(q_pos[:, None], k_pos[None, :], causal=causal, window=window)  # (shard, shard)
            ax = axes[row, s]
            empty = tile_is_empty(q_pos, k_pos, causal=causal, window=window)
            ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest")
            if empty:
                ax.imshow(np.ones_like(mask, dtype=float), cmap="Greys", vmin=0, vmax=4.5)
                ax.text(shard / 2 - 0.5, shard / 2 - 0.5, "skip", ha="center", va="center", fontsize=8)
            ax.set_title(f"s{s}: kv {kv} · {int(mask.sum())}/{mask.size}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
            if s == 0:
                ax.set_ylabel(f"host {r}\nquery", fontsize=8)
            if row == len(hosts) - 1:
                ax.set_xlabel("key", fontsize=8)
    layout_name = layout if isinstance(layout, str) else "custom"
    who = f"host {host}" if host is not None else "rows = hosts"
    fig.suptitle(f"Per-hop masks, layout={layout_name}, causal={causal}, window={window}, seq={seq}, "
                 f"{n_hosts} hosts\n{who}, columns = steps; blue = query sees key, grey = hop skipped",
                 fontsize=10)
    return fig


def plot_work_heatmap(trace):
    """FLOPs per host per step, and per host in total: the load balance of a causal ring.

    Hosts synchronise every hop, so a step lasts as long as its busiest host: the critical path is
    the sum over steps of the max over hosts. Cells show tiles computed / tiles in the hop.
    """
    plt = pyplot()
    from matplotlib.ticker import EngFormatter, MaxNLocator

    flops = np.asarray(trace.flops, dtype=float)  # (hosts, steps)
    done = np.asarray(trace.tiles_computed)
    total = done + np.asarray(trace.tiles_skipped)
    n_hosts, n_steps = flops.shape
    critical = flops.max(axis=0).sum()
    ideal = flops.sum() / n_hosts  # every host busy every step
    fig, (ax, bar) = plt.subplots(1, 2, width_ratios=(n_steps, 2.5), layout="constrained",
                                  figsize=(2.8 + 0.62 * n_steps, 1.4 + 0.5 * n_hosts))
    im = ax.imshow(flops, cmap="viridis", vmin=0, vmax=max(flops.max(), 1.0), aspect="auto")
    for i in range(n_hosts):
        for s in range(n_steps):
            light = flops[i, s] < 0.6 * flops.max()
            ax.text(s, i, f"{done[i, s]}/{total[i, s]}", ha="center", va="center", fontsize=7,
                    color="white" if light else "black")
    ax.set_xticks(range(n_steps))
    ax.set_yticks(range(n_hosts))
    ax.set_xlabel("step")
    ax.set_ylabel("host")
    ratio = critical / ideal if ideal > 0 else float("nan")
    ax.set_title(f"Work per host per step, layout={_layout_name(trace)} (tiles computed/total)\n"
                 f"critical path {critical:.3g} FLOPs = {ratio:.2f} x perfectly balanced", fontsize=10)
    fig.colorbar(im, ax=ax, label="FLOPs", format=EngFormatter())
    bar.barh(range(n_hosts), flops.sum(axis=1), color="tab:blue")
    bar.set_ylim(n_hosts - 0.5, -0.5)
    bar.set_yticks(range(n_hosts), labels=[])
    bar.xaxis.set_major_locator(MaxNLocator(3))
    bar.xaxis.set_major_formatter(EngFormatter())
    bar.set_xlabel("FLOPs per host")
    bar.set_title("total", fontsize=10)
    return fig


def plot_memory_vs_seq(seqs=None, *, batch=1, hidden=4096, heads=32, shard=4096, dtype_bytes=2,
                       device_bytes=80e9):
    """Max activation per layer against sequence length for each row of Table 1 (log-log).

    Vanilla attention grows as ``s^2``, memory-efficient attention and BPT as ``s``, Ring Attention
    stays at ``6bch`` per host (more hosts, not more memory; ``shard``: tokens per host, ``c``).
    ``device_bytes`` draws a device's
    memory as a horizontal line (None to omit).
    """
    plt = pyplot()
    seqs = np.logspace(10, 24, 57, base=2) if seqs is None else np.asarray(seqs, dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    styles = {"vanilla": "-", "memory-efficient attention": "--", "blockwise parallel transformer": "-.",
              "ring attention": "-"}
    for method, (attn_f, ffn_f) in cost.TABLE1_FORMULAS.items():
        attn, ffn = cost.activation_bytes(method, batch=batch, seq=seqs, hidden=hidden, heads=heads,
                                          shard=shard, dtype_bytes=dtype_bytes)
        ax.plot(seqs, np.maximum(attn, ffn), styles[method], lw=2, label=f"{method}  ({attn_f}; FFN {ffn_f})")
    if device_bytes is not None:
        ax.axhline(device_bytes, color="0.4", lw=1, ls=":")
        ax.text(seqs[0], device_bytes * 1.15, f"device memory {device_bytes / 1e9:g} GB", fontsize=8, color="0.3")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel(f"max activation per layer per host (bytes, {8 * dtype_bytes}-bit)")
    ax.set_title(f"Table 1: activation memory vs sequence length\n(b={batch}, h={hidden}, n={heads}, "
                 f"shard c={shard} tokens per host)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_overlap(shards=None, hardware=("A100 NVLink", "TPU v5e", "A100 InfiniBand"), *, dim=128,
                 batch=1, heads=1, dtype_bytes=2):
    """Per-hop compute time (solid, ``∝ c^2``) vs K/V transfer time (dashed, ``∝ c``) against shard length.

    They cross at ``c = F/B`` (§3): above it the next K/V shard arrives before the current one is
    done, so communication is hidden. shards: the shard lengths ``c`` to plot (tokens per host);
    hardware: names of :data:`ringattn_ref.cost.HARDWARE` or ``Hardware`` objects.
    """
    plt = pyplot()
    shards = np.logspace(6, 17, 45, base=2) if shards is None else np.asarray(shards, dtype=float)
    fig, ax = plt.subplots(figsize=(7.5, 5.2), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (color, hw) in enumerate(zip(colors, hardware)):
        hw = cost.as_hardware(hw)
        t = cost.hop_times(shards, hw, dim=dim, batch=batch, heads=heads, dtype_bytes=dtype_bytes)
        c = cost.min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, dtype_bytes=dtype_bytes)
        at = cost.hop_times(c, hw, dim=dim, batch=batch, heads=heads, dtype_bytes=dtype_bytes)
        lw = max(3.5 - 1.0 * i, 1.0)  # later lines thinner: equal F gives equal compute lines
        ax.plot(shards, t.compute_s, "-", color=color, lw=lw, label=f"{hw.name}: compute")
        ax.plot(shards, t.transfer_s, "--", color=color, lw=1.5, label=f"{hw.name}: transfer")
        ax.plot([c], [at.compute_s], "o", color=color, ms=7, label=f"{hw.name}: c = F/B = {c / 1e3:.1f}K")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("shard length c (tokens per host)")
    ax.set_ylabel("time per hop (s)")
    ax.set_title(f"Overlap condition: compute (solid) hides transfer (dashed) when c >= F/B\n"
                 f"(batch={batch}, heads={heads}, head dim={dim}, {8 * dtype_bytes}-bit K/V)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(fontsize=8, ncol=len(hardware), loc="outside lower center")  # same F: same compute line
    return fig


def plot_ring_gantt(trace, flops_per_s, bandwidth_bytes_per_s, *, title=None):
    """The ring as a Gantt chart: per host, when it computes (top bar) and sends (bottom bar) each step.

    Times come from :func:`ringattn_ref.gantt.ring_timeline` (a host computes ``flops / F``, sends
    ``bytes / B``, and waits for its neighbour's shard). A compute bar is labelled with the K/V
    shard it uses; skipped hops have no compute bar; gaps are waiting. Microseconds on the x axis.
    """
    from .gantt import ring_timeline

    plt = pyplot()
    from matplotlib.patches import Patch

    tl = ring_timeline(trace, flops_per_s, bandwidth_bytes_per_s)
    n_hosts, n_steps = tl.compute_start.shape
    us = 1e6
    fig, ax = plt.subplots(figsize=(8.0, 1.0 + 0.55 * n_hosts), layout="constrained")
    compute_c, send_c = "#2c66b0", "#f0a04b"
    for i in range(n_hosts):
        for s in range(n_steps):
            width = tl.compute_end[i, s] - tl.compute_start[i, s]
            if width > 0:
                ax.broken_barh([(tl.compute_start[i, s] * us, width * us)], (i - 0.4, 0.45), color=compute_c,
                               edgecolor="white")
                ax.text((tl.compute_start[i, s] + width / 2) * us, i - 0.175, str(trace.kv_idx[i, s]),
                        ha="center", va="center", color="white", fontsize=7)
            sent = tl.send_end[i, s] - tl.send_start[i, s]
            if sent > 0:
                ax.broken_barh([(tl.send_start[i, s] * us, sent * us)], (i + 0.08, 0.3), color=send_c,
                               edgecolor="white")
    ax.set_yticks(range(n_hosts), [f"host {i}" for i in range(n_hosts)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.total_s * us * 1.02)
    ax.set_xlabel("time (µs)")
    ideal = float(np.asarray(trace.flops).sum(axis=1).max()) / flops_per_s
    ax.set_title(title or (f"{n_hosts} hosts, layout={_layout_name(trace)}: ring takes {tl.total_s * us:.3g} µs, "
                           f"the busiest host computes {ideal * us:.3g} µs"), fontsize=10)
    fig.legend(handles=[Patch(color=compute_c, label="compute (label: K/V shard)"),
                        Patch(color=send_c, label="send K/V to host i + 1")],
               loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    return fig
