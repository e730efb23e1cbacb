"""Figures of the course's notebooks (06-12): the roofline, memory per device, tile schedules, the fused ring.

Companion of :mod:`ringattn_ref.viz` (which draws the simulated ring). Every function returns a
matplotlib ``Figure``; matplotlib is imported inside the functions (the course's other helpers do
not need it), with the non-interactive Agg backend when there is no display.

- :func:`plot_roofline` -- attainable FLOP/s against arithmetic intensity, with kernels on it
  (notebook 06);
- :func:`plot_schedule` -- a compiled program's schedule (``ringattn_course.schedules``): kernels and loops
  in schedule order, each transfer as a span from its start to its done, hidden or exposed (notebook 06);
- :func:`plot_memory_vs_devices` -- per-device temp bytes measured with ``memory_analysis()`` as the
  ring grows at a fixed local sequence (notebook 07);
- :func:`plot_empty_tiles` -- which ``block_q x block_kv`` tiles each host computes at each ring
  step, from the kernels' skip test ``kernels.tiles.empty_tiles`` (notebook 08);
- :func:`plot_double_buffer` -- the fused TPU ring's double buffer, remote DMAs and handshake as a
  time-space diagram (notebook 09);
- :func:`plot_decode_schedules` -- seconds per decoded token, ring against the merge reduction, over
  the host count (notebook 11);
- :func:`plot_training` -- loss curves and accuracy by fact distance of ``examples.recall.train``'s
  ring and one-shard models (notebook 12).
"""
from __future__ import annotations

import numpy as np

from ringattn_ref.viz import pyplot  # matplotlib.pyplot, Agg when headless (strategy_figures, timeline use it)

SKIPPED = (0.86, 0.86, 0.86, 1.0)
COMPUTED = (0.17, 0.40, 0.69, 1.0)
SLOT_COLORS = ("#8fb9e0", "#f5b971")  # slot 0, slot 1


def plot_memory_vs_devices(n_devices, ring_bytes, dense_bytes=None, *, local_seq):
    """Per-device temp memory against the number of devices ``N`` at a fixed local sequence.

    n_devices: the ``N`` measured (the global sequence is ``N * local_seq``). ring_bytes: a dict
    ``label -> bytes per N`` for the ring (e.g. forward, forward+backward); dense_bytes: the same for
    plain attention of the whole sequence on one device (its ``seq x seq`` scores grow as ``N^2``).
    Bytes are ``compiled.memory_analysis().temp_size_in_bytes`` (Ring Attention, Table 1: the ring's
    per-host activation memory does not depend on the sequence, only on the block).
    """
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    n_devices = np.asarray(n_devices)
    series = [(f"ring: {k}", v, "o-") for k, v in ring_bytes.items()]
    series += [(f"plain attention, 1 device: {k}", v, "s--") for k, v in (dense_bytes or {}).items()]
    for label, values, _ in series:
        if len(values) != n_devices.size:
            raise ValueError(f"{label!r} has {len(values)} values; expected one per device count "
                             f"({n_devices.size})")
    fig, ax = plt.subplots(figsize=(6.8, 4.2), layout="constrained")
    for label, values, style in series:
        ax.plot(n_devices, np.asarray(values, dtype=float) / 2**20, style, lw=2, ms=7, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xticks(n_devices, [f"{n}\n(seq {n * local_seq})" for n in n_devices])
    ax.set_xlabel(f"devices N (local sequence fixed at {local_seq} tokens)")
    ax.set_ylabel("temp memory per device (MiB)")
    ax.set_title("memory_analysis(): the ring is flat in N, plain attention grows as N²", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_empty_tiles(empty, *, title=None):
    """Tiles each host computes at each ring step: a hosts x steps grid of tile maps.

    empty: bool ``[hosts, steps, n_q_tiles, n_kv_tiles]`` -- ``empty[i, s]`` is
    ``kernels.tiles.empty_tiles`` for host ``i``'s queries against the K/V shard it holds at step
    ``s`` (``kv_idx = (i - s) % N``). Blue tiles are computed, grey (empty) ones skipped; a hop whose
    tiles are all empty is skipped whole. The right-hand labels give each host's total, whose maximum
    is the critical path of the ring.
    """
    plt = pyplot()
    empty = np.asarray(empty, dtype=bool)
    if empty.ndim != 4:
        raise ValueError(f"empty must be bool [hosts, steps, n_q_tiles, n_kv_tiles]; got shape {empty.shape}")
    visible = ~empty  # the tiles computed
    hosts, steps, nq, nk = visible.shape
    totals = visible.sum(axis=(1, 2, 3))
    fig, axes = plt.subplots(hosts, steps, figsize=(1.0 + 1.25 * steps, 0.8 + 1.2 * hosts), squeeze=False,
                             layout="constrained")
    for i in range(hosts):
        for s in range(steps):
            ax = axes[i, s]
            tile = visible[i, s]
            rgba = np.where(tile[..., None], np.array(COMPUTED), np.array(SKIPPED))  # (nq, nk, 4)
            ax.imshow(rgba, interpolation="nearest")
            ax.set_xticks(np.arange(nk + 1) - 0.5, minor=True)
            ax.set_yticks(np.arange(nq + 1) - 0.5, minor=True)
            ax.grid(True, which="minor", color="white", lw=1.5)
            ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
            if not tile.any():
                ax.text((nk - 1) / 2, (nq - 1) / 2, "hop\nskipped", ha="center", va="center", fontsize=7)
            if i == 0:
                ax.set_title(f"step {s}", fontsize=9)
            if s == 0:
                ax.set_ylabel(f"host {i}", fontsize=9)
            if s == steps - 1:
                ax.yaxis.set_label_position("right")
                ax2 = ax.twinx()
                ax2.set_yticks([])
                ax2.set_ylabel(f"{totals[i]} tiles", fontsize=8, rotation=0, ha="left", va="center")
    balance = totals.max() / max(totals.mean(), 1e-12)
    fig.suptitle(title or f"computed tiles (blue) per host and step; critical path / mean = {balance:.2f}",
                 fontsize=10)
    return fig


def plot_double_buffer(n_devices=4, *, handshake=True):
    """The fused TPU ring kernel as a time-space diagram: double buffer, remote DMAs, handshake.

    Row ``d`` is device ``d``, column ``step`` its ring step. Each box is the hop computed there:
    the K/V shard ``(d - step) % N`` read from slot ``step % 2`` (colour). Solid arrows: the remote
    DMA that device ``d`` starts at step ``step`` into slot ``1 - step % 2`` of device ``d + 1``, which
    that device reads at ``step + 1`` (no DMA after the last step). Dashed arrows (``handshake``): the
    "capacity" signal device ``d + 1`` sends back after finishing step ``step`` (it no longer reads
    slot ``step % 2``); device ``d`` waits for it before its DMA of step ``step + 1`` overwrites that
    slot. With ``handshake=False`` the red marks show those writes: nothing orders them after the
    neighbour's reads, which is the race the interpreter's race detector reports.
    """
    plt = pyplot()
    from matplotlib.patches import FancyBboxPatch, Patch

    if not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"n_devices must be a positive int; got {n_devices!r}")
    n = int(n_devices)
    w, hgt = 0.62, 0.5  # box size in (step, device) units
    fig, ax = plt.subplots(figsize=(1.6 + 2.0 * n, 1.2 + 0.95 * n), layout="constrained")
    for d in range(n):
        for step in range(n):
            slot = step % 2
            ax.add_patch(FancyBboxPatch((step - w / 2, d - hgt / 2), w, hgt, boxstyle="round,pad=0.02",
                                        facecolor=SLOT_COLORS[slot], edgecolor="black", lw=1))
            ax.text(step, d, f"K/V {(d - step) % n}\nslot {slot}", ha="center", va="center", fontsize=8)
            if step < n - 1 and n > 1:  # DMA: my slot `slot` -> right neighbour's slot 1 - slot
                right = (d + 1) % n
                y_end = right if right > d else n - 0.45  # the wrap-around arrow leaves the figure
                ax.annotate("", xy=(step + 1 - w / 2, y_end - (hgt / 2 if right > d else 0)),
                            xytext=(step + w / 2, d + hgt / 2),
                            arrowprops=dict(arrowstyle="-|>", color="black", lw=1.2, shrinkA=0, shrinkB=2))
            if step < n - 2 and n > 2:  # the neighbour's next write into the slot I read now
                left = (d - 1) % n
                if handshake:
                    y_end = left if left < d else -0.55
                    ax.annotate("", xy=(step + 1 - w / 2 + 0.04, y_end + (hgt / 2 if left < d else 0)),
                                xytext=(step + w / 2 - 0.04, d - hgt / 2),
                                arrowprops=dict(arrowstyle="-|>", color="tab:green", lw=1.2, ls="--",
                                                shrinkA=0, shrinkB=2))
                else:
                    ax.plot([step + 0.5], [d - 0.08], "x", color="tab:red", ms=11, mew=2.5)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(n - 0.4, -0.65)
    ax.set_xticks(range(n), [f"step {s}" for s in range(n)])
    ax.set_yticks(range(n), [f"device {d}" for d in range(n)])
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    handles = [Patch(facecolor=SLOT_COLORS[0], edgecolor="black", label="compute on slot 0"),
               Patch(facecolor=SLOT_COLORS[1], edgecolor="black", label="compute on slot 1"),
               plt.Line2D([], [], color="black", marker=">", label="remote DMA into the right neighbour's other slot")]
    if handshake:
        handles.append(plt.Line2D([], [], color="tab:green", ls="--", marker=">",
                                  label="handshake: 'my slot is free' to the left neighbour"))
    elif n > 2:
        handles.append(plt.Line2D([], [], color="tab:red", marker="x", ls="",
                                  label="unordered: the left neighbour may overwrite the slot being read"))
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncol=2)
    ax.set_title(f"fused ring on {n} devices, " + ("with" if handshake else "WITHOUT") + " the handshake",
                 fontsize=10)
    return fig


def plot_decode_schedules(n_hosts, ring_s, reduction_s, *, hardware=""):
    """Seconds per decoded token with the ring against the merge reduction, over the host count N.

    n_hosts: the ``N`` evaluated; ring_s / reduction_s: dicts ``label (a cache length) -> seconds per
    N`` (notebook 11, from ``ringattn_course.physics.decode_s``). Left: both in microseconds (log-log); right: their
    ratio, how many times longer the ring makes each token wait.
    """
    n_hosts = np.asarray(n_hosts)
    for name, series in (("ring_s", ring_s), ("reduction_s", reduction_s)):
        for label, ys in series.items():
            if len(ys) != len(n_hosts):
                raise ValueError(f"{name}[{label!r}] has {len(ys)} values; expected one per host count "
                                 f"({len(n_hosts)})")
    if set(ring_s) != set(reduction_s):
        raise ValueError(f"ring_s and reduction_s must have the same labels; got {sorted(ring_s)} and "
                         f"{sorted(reduction_s)}")
    plt = pyplot()
    fig, (ax, ratio) = plt.subplots(1, 2, figsize=(10, 3.5))
    for label in ring_s:
        ring, tree = np.asarray(ring_s[label]), np.asarray(reduction_s[label])
        line, = ax.plot(n_hosts, ring * 1e6, "o-", label=f"ring, {label}")
        ax.plot(n_hosts, tree * 1e6, "x--", color=line.get_color(), label=f"reduction, {label}")
        ratio.plot(n_hosts, ring / tree, "o-", color=line.get_color(), label=label)
    ax.set(xscale="log", yscale="log", xlabel="hosts N", ylabel=f"µs per token and head {hardware}".strip())
    ratio.set(xscale="log", yscale="log", xlabel="hosts N", ylabel="ring / reduction")
    for a in (ax, ratio):
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_training(metrics):
    """``examples.recall.train``'s figure from its metrics dict (``run_experiment``'s result or
    ``metrics.json``): training loss of every run; eval accuracy by question-fact distance."""
    plt = pyplot()
    from examples.recall.plots import draw
    return draw(metrics, plt.figure(figsize=(11, 4), layout="constrained"))


def plot_roofline(chips, points):
    """The roofline of each chip and where kernels sit on it (notebook 06).

    chips: :class:`ringattn_course.physics.Chip` values; points: ``label -> (flops, hbm_bytes)`` of
    kernels (``physics.attention_flops_bytes``), marked on the first chip's line. x: arithmetic
    intensity (FLOPs per HBM byte), y:
    attainable TFLOP/s ``min(F, H x intensity)``; a kernel left of a chip's ridge ``F / H`` is
    memory-bound on it.
    """
    if not chips or not points:
        raise ValueError(f"need at least one chip and one point; got {len(chips)} chips, {len(points)} points")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    intensity = {label: flops / hbm for label, (flops, hbm) in points.items()}
    xs = np.logspace(np.log10(min(min(intensity.values()), 1) / 2), np.log10(max(intensity.values()) * 2), 200)
    for c in chips:
        line, = ax.plot(xs, np.minimum(c.flops_per_s, c.hbm_bytes_per_s * xs) / 1e12, lw=2,
                        label=f"{c.name}: ridge {c.ridge:.0f} FLOP/B")
        ax.axvline(c.ridge, color=line.get_color(), ls=":", lw=1)
    first = chips[0]  # the kernels are drawn on the first chip's roofline
    for label, x in intensity.items():
        y = min(first.flops_per_s, first.hbm_bytes_per_s * x) / 1e12
        ax.plot([x], [y], "k^", ms=7)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per HBM byte)",
           ylabel="attainable TFLOP/s")
    ax.set_title("the roofline: memory-bound left of the ridge, compute-bound right of it", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


# slot widths of plot_schedule's events (schedule order, not time): kernels and loops wide, the rest narrow
EVENT_WIDTH = {"kernel": 4.0, "loop": 4.0, "compute": 2.0, "other": 0.7, "start": 0.35, "done": 0.35}
EVENT_COLOR = {"kernel": "#2c66b0", "loop": "#8fb9e0", "compute": "#2c66b0", "other": "#c8c8c8"}
TRANSFER_COLOR = {True: "#3a9a4a", False: "#d62728"}  # hidden, exposed


def _short(event):
    if event["kind"] == "kernel":
        return event["name"].removeprefix("ring_hop_").removesuffix("_tpu").replace("_", " ") + "\nkernel"
    if event["kind"] == "loop":
        return ("bwd" if event["backward"] else "fwd") + "\nloop"
    return event.get("op", "")


def plot_schedule(schedules, roles=None):
    """Compiled schedules side by side (notebook 06): one column per schedule, one row per computation.

    schedules: ``title -> schedule`` (``ringattn_course.schedules.load`` / ``compile_current``); roles: the
    computations to draw (``schedules.ROLES`` by default: the forward loop body, the backward loop body, the
    entry with the peeled steps). x is the position in the schedule, not time: each event a slot
    (:data:`EVENT_WIDTH`: kernels and loops wide, other work narrow). The bottom lane holds the compute --
    kernels and loops in blue, other work (elementwise fusions, copies, the accumulators' adds) in grey --
    and each transfer has a lane above it, a bar from its ``-start`` to its ``-done``: green where a
    kernel or loop runs inside it (hidden), red where none does (exposed), labelled with the array it sends.
    """
    from ringattn_course import schedules as sch

    if not schedules:
        raise ValueError("schedules must name at least one schedule")
    roles = tuple(sch.ROLES if roles is None else roles)
    plt = pyplot()
    from matplotlib.patches import Patch

    lanes = {r: max(len(sch.transfers(s, r)) for s in schedules.values()) for r in roles}
    fig, axes = plt.subplots(len(roles), len(schedules), squeeze=False, layout="constrained",
                             figsize=(6.2 * len(schedules), sum(1.0 + 0.32 * lanes[r] for r in roles) + 0.9),
                             gridspec_kw=dict(height_ratios=[1.0 + 0.32 * lanes[r] for r in roles]))
    for col, (title, sched) in enumerate(schedules.items()):
        for row, role in enumerate(roles):
            ax, events = axes[row, col], sch.computation(sched, role)["events"]
            x = np.concatenate([[0.0], np.cumsum([EVENT_WIDTH[e["kind"]] for e in events])])
            for i, e in enumerate(events):
                if e["kind"] in EVENT_COLOR:
                    ax.broken_barh([(x[i], x[i + 1] - x[i])], (-0.45, 0.9), facecolors=EVENT_COLOR[e["kind"]],
                                   edgecolors="white", linewidth=0.5)
                    if e["kind"] in ("kernel", "loop"):
                        ax.text((x[i] + x[i + 1]) / 2, 0, _short(e), ha="center", va="center", fontsize=6.5,
                                color="white" if e["kind"] == "kernel" else "black")
            for lane, t in enumerate(sch.transfers(sched, role), start=1):
                ax.broken_barh([(x[t.start], x[t.done + 1] - x[t.start])], (lane - 0.35, 0.7),
                               facecolors=TRANSFER_COLOR[t.hidden], alpha=0.85)
                ax.text(x[t.start] + 0.1, lane, t.event["sends"], va="center", fontsize=6, clip_on=True)
            ax.set_xlim(0, x[-1])
            ax.set_ylim(lanes[role] + 0.6, -0.6)
            ax.set_yticks(range(lanes[role] + 1), ["compute"] + [f"send {k}" for k in range(1, lanes[role] + 1)],
                          fontsize=7)
            ax.set_xticks([])
            exposed = sum(not t.hidden for t in sch.transfers(sched, role))
            ax.set_title(f"{role}: {exposed} exposed", fontsize=8, loc="left")
            if row == 0:
                ax.annotate(title, (0.5, 1.0), xycoords="axes fraction", xytext=(0, 14), textcoords="offset points",
                            ha="center", fontsize=10, weight="bold")
        axes[-1, col].set_xlabel("position in the compiled schedule (order, not time)", fontsize=8)
    handles = [Patch(color=EVENT_COLOR["kernel"], label="kernel"), Patch(color=EVENT_COLOR["loop"], label="loop"),
               Patch(color=EVENT_COLOR["other"], label="other work"),
               Patch(color=TRANSFER_COLOR[True], label="transfer, hidden (a kernel runs while it flies)"),
               Patch(color=TRANSFER_COLOR[False], label="transfer, exposed")]
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncol=5)
    return fig
