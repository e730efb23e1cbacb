"""From one chip to a thousand, on paper: ring attention's time and efficiency on N = 2 ... 1024 chips.

    python -m benchmarks.scaling                                    # the tables of docs/benchmarks.md
    python -m benchmarks.scaling --long --targets v5e --shards 16384   # every N, every column
    python -m benchmarks.scaling --plot scaling.png --out rows.jsonl

(from the repository root; no accelerator, a second or two). **Everything here is a model.** Its one
measured input is the time of one hop on one TPU v5e chip (forward, and forward+backward, of a ring of one
at 8K, 16K and 32K tokens, batch 1, d = 128, bfloat16: ``benchmarks/results/tpu_v5e_2026-12-07_bench18.jsonl``
for 8 heads, ``_bench19`` for 32 query / 8 kv heads; :func:`measured`). Its other inputs are published peak
FLOP/s and link bandwidths (:data:`TARGETS`, each with its source). Per host and attention layer:

- **hop compute** (:func:`hop_seconds`): the FLOPs of one hop (FlashAttention-2's count, the one the measured
  TFLOP/s use: ``benchmarks.bench_gpu.attention_flops``) over the v5e's measured rate at that shard length,
  interpolated (in log c) between measured lengths and held at the nearest one outside them (1K-4K at 8K's
  rate, 64K at 32K's: **extrapolated**); on another chip, that rate times the ratio of peak FLOP/s
  (**scaled**). The forward's rate and the backward's (``fwd+bwd - fwd``) are kept apart.
- **transfer** (:func:`hop_bytes`): the bytes ``ringattn_fast`` sends per step: the forward K and V in the
  input dtype, ``N - 1`` times; the backward K and V again (``N - 1`` times) and the dK/dV accumulators, in
  ``softmax.acc_dtype`` (float32 for bf16; ``--grad-dtype bfloat16``: ``grad_comm_dtype="bfloat16"``), ``N``
  times. Over the bandwidth one ring step gets (:class:`Target`): one torus link on a TPU, a GPU's whole
  NVLink share through NVSwitch; beyond the chips those links join (a TPU pod, an NVLink domain), the ring
  is as slow as its slowest hop: the data-center network or InfiniBand.
- **a pass** (:func:`pass_seconds`, ``ringattn_ref.cost.ring_pass_seconds``' schedule): a step hides its
  sends behind its hop (**hidden**: the longer of the two) or not (**exposed**: their sum). The compiled
  ring hides both since issue 45 (docs/benchmarks.md, "Does the compiled ring hide its transfers?"); before
  it hid the forward's and not the backward's: **before** is forward hidden + backward exposed.
- **efficiency**: the compute alone (every hop, no transfer) over the predicted time.
- **causal** (``--layouts``): each step as slow as its busiest host. ``zigzag``: the own hop a measured causal
  hop, every other a full hop's half (two half-shard rectangles, at the full hop's rate); ``striped``: every
  hop a measured causal hop (each a triangle); ``contiguous``: the own hop causal, every other a full hop (the
  last host's), for comparison.
- **hide threshold** (:func:`hide_threshold`): the shortest shard whose steady steps hide their sends,
  against the paper's ``c >= F / B`` (Table 2, peak F, a chip's bandwidth) and ``ringattn_ref.cost``.

Not in the model: per-message latency (microseconds: it matters below ~1K tokens), HBM traffic of the
sends competing with the kernels, achieved link bandwidth below peak (the model uses the published peak),
the per-call passes that a ring of one pays once (relayouts, D = rowsum(dO O)), which a measured hop here
includes, and the fused ring's copies into its send slots at N > 1, which it does not.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import report
from .bench_gpu import attention_flops

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Target:
    """One chip and its interconnect, from the published source ``source``. Bandwidths in bytes/s, one direction.

    link: one physical link; chip: all of a chip's links (the paper's ``B`` in Table 2); hop: what one ring
    step gets -- one link on a TPU torus (a ring laid out on neighbours sends over one), the chip's whole NVLink
    share through NVSwitch; domain: the chips those links join (the ICI pod or slice, the NVLink domain);
    outer: a chip's share of the network beyond it (``outer_name``).
    """
    name: str
    peak_flops: float
    link: float
    chip: float
    hop: float
    domain: int
    outer: float
    outer_name: str
    how: str
    source: str

    def bandwidth(self, n):
        """Bytes/s of the ring's slowest hop on ``n`` chips: the fast links within the domain, else the outer one."""
        return self.hop if n <= self.domain else self.outer


GBIT = 1e9 / 8  # bytes/s in one Gbit/s
TARGETS = {t.name: t for t in (
    Target("v5e", 197e12, 400e9 / 2 / 4, 400e9 / 2, 400e9 / 2 / 4, 256, 2 * 100 * GBIT / 8, "DCN",
           "400 GB/s bidirectional ICI a chip over 4 ports (2D torus); 2 x 100 Gbps NICs a host of 8 chips",
           "Google Cloud TPU documentation, 'TPU v5e' (system architecture table)"),
    Target("v6e", 918e12, 800e9 / 2 / 4, 800e9 / 2, 800e9 / 2 / 4, 256, 4 * 200 * GBIT / 8, "DCN",
           "800 GB/s bidirectional ICI a chip over 4 ports (2D torus); 4 x 200 Gbps NICs a host of 8 chips",
           "Google Cloud TPU documentation, 'TPU v6e' (system architecture table)"),
    Target("v5p", 459e12, 1200e9 / 2 / 6, 1200e9 / 2, 1200e9 / 2 / 6, 6144, 50 * GBIT, "DCN",
           "1200 GB/s bidirectional ICI a chip over the 6 links of a 3D torus (a port count the page does not "
           "give); one slice up to 6144 chips; "
           "50 Gbps DCN a chip",
           "Google Cloud TPU documentation, 'TPU v5p' (system architecture table)"),
    Target("H100", 989e12, 50e9 / 2, 900e9 / 2, 900e9 / 2, 8, 400 * GBIT, "InfiniBand",
           "SXM5, dense BF16; NVLink 4: 18 links of 50 GB/s bidirectional (900 GB/s), 8 GPUs on NVSwitch; "
           "one 400 Gb/s InfiniBand adapter a GPU",
           "NVIDIA, 'NVIDIA H100 Tensor Core GPU Architecture' (whitepaper, 2022); 'NVIDIA DGX H100' (datasheet)"),
    Target("A100", 312e12, 50e9 / 2, 600e9 / 2, 600e9 / 2, 8, 200 * GBIT, "InfiniBand",
           "SXM4, dense BF16; NVLink 3: 12 links of 50 GB/s bidirectional (600 GB/s), 8 GPUs on NVSwitch; "
           "one 200 Gb/s HDR InfiniBand adapter a GPU",
           "NVIDIA, 'NVIDIA A100 Tensor Core GPU Architecture' (whitepaper, 2020); "
           "'NVIDIA DGX A100 System Architecture' (whitepaper)"),
)}
MEASURED_ON = "v5e"
# (heads, kv_heads) -> the run that measured every row of it with one tree (docs/benchmarks.md, tenth session)
RUNS = {(8, 8): "tpu_v5e_2026-12-07_bench18.jsonl", (32, 8): "tpu_v5e_2026-12-07_bench19.jsonl"}
KERNELS = {"fused": "fused", "per_hop": "ours"}  # what a ring of N > 1 runs on a TPU by default; the per-hop kernel
LAYOUTS = ("none", "zigzag", "striped", "contiguous")
NS = tuple(2 ** k for k in range(1, 11))
SHARDS = tuple(2 ** k for k in range(10, 17))
DIM = 128


@dataclass(frozen=True)
class Measured:
    """A kernel's achieved FLOP/s on the measured chip at a few shard lengths, forward and backward, one causal
    flag: ``shards`` ascending, the rates per shard, and ``sources`` (``file:line``) per shard."""
    causal: bool
    shards: tuple
    fwd_flops_per_s: tuple
    bwd_flops_per_s: tuple
    sources: tuple

    def rate(self, shard, backward=False):
        """FLOP/s at ``shard``: linear in log2(shard) between measured lengths, the nearest one's outside."""
        rates = self.bwd_flops_per_s if backward else self.fwd_flops_per_s
        return float(np.interp(np.log2(shard), np.log2(self.shards), rates))

    def provenance(self, shard):
        """How the rate at ``shard`` was had: measured (its row), interpolated, or extrapolated (from which row)."""
        if shard in self.shards:
            return f"measured ({self.sources[self.shards.index(shard)]})"
        if self.shards[0] < shard < self.shards[-1]:
            return "interpolated"
        near = 0 if shard < self.shards[0] else -1
        return f"extrapolated at {report.length_label(self.shards[near])}'s rate ({self.sources[near]})"


def measured(heads=(8, 8), kernel="fused", results=RESULTS):
    """``{causal: Measured}`` read from the v5e bench run of ``heads`` (:data:`RUNS`): each row's forward ms
    and forward+backward ms of ``kernel`` (:data:`KERNELS`) turned into FLOP/s with the count bench_tpu used."""
    name = RUNS[tuple(heads)]
    rows = {}
    for line_no, line in enumerate((Path(results) / name).read_text().splitlines(), 1):
        r = json.loads(line)
        if "seq" not in r or r["dim"] != DIM or r["dtype"] != "bfloat16":
            continue
        fwd_ms, fwd_bwd_ms = r["ms"][KERNELS[kernel]]
        fwd, fwd_bwd = attention_flops(1, r["heads"], r["seq"], r["dim"], r["causal"])
        rows.setdefault(r["causal"], []).append(
            (r["seq"], fwd / (fwd_ms / 1e3), (fwd_bwd - fwd) / ((fwd_bwd_ms - fwd_ms) / 1e3), f"{name}:{line_no}"))
    return {causal: Measured(causal, *map(tuple, zip(*sorted(rs)))) for causal, rs in rows.items()}


def hop_flops(shard, heads, causal, backward=False, dim=DIM):
    """FLOPs of one hop of ``shard`` queries against ``shard`` keys (batch 1), FA-2's count."""
    fwd, fwd_bwd = attention_flops(1, heads, shard, dim, causal)
    return fwd_bwd - fwd if backward else fwd


def hop_seconds(target, rates, shard, heads, backward=False, dim=DIM):
    """One hop's compute on ``target``: its FLOPs over the measured chip's rate, scaled by the peak FLOP/s ratio."""
    scale = target.peak_flops / TARGETS[MEASURED_ON].peak_flops
    return hop_flops(shard, heads, rates.causal, backward, dim) / (rates.rate(shard, backward) * scale)


def hop_bytes(shard, kv_heads, dtype="bfloat16", grad_dtype=None, dim=DIM):
    """``(kv, grads)``: bytes of one K/V send (K and V, ``[1, shard, kv_heads, dim]`` in ``dtype``) and of one
    dK/dV send, in the accumulators' dtype (``ringattn_fast.softmax.acc_dtype``) unless ``grad_dtype`` is given
    (``grad_comm_dtype``): what ``ringattn_fast.backward`` puts on the wire."""
    import jax.numpy as jnp

    from ringattn_fast.softmax import acc_dtype

    elements = 2 * shard * kv_heads * dim  # K and V
    grads = jnp.dtype(acc_dtype(dtype) if grad_dtype is None else grad_dtype).itemsize
    return elements * jnp.dtype(dtype).itemsize, elements * grads


def step_compute(layout, n, full, diag):
    """Seconds of each of the ``n`` steps' hop, the busiest host's: ``full`` a non-causal hop, ``diag`` a
    causal one (the diagonal, half the FLOPs)."""
    if layout == "none":
        return np.full(n, full)
    rest = {"zigzag": full / 2, "striped": diag, "contiguous": full}[layout]
    return np.concatenate([[diag], np.full(n - 1, rest)])


def pass_seconds(compute, kv_s, grad_s=0.0, hidden=True):
    """One pass around the ring: step ``s`` computes ``compute[s]`` while K/V for step ``s + 1`` and (backward)
    the accumulators of step ``s - 1`` travel; the last accumulators go home after it. Vectorised twin of
    ``ringattn_ref.cost.ring_pass_seconds``."""
    n = len(compute)
    sends = np.full(n, float(kv_s))
    sends[-1] = 0.0
    sends[1:] += grad_s
    steps = np.maximum(compute, sends) if hidden else compute + sends
    return float(steps.sum()) + (grad_s if n > 1 else 0.0)


def row(target, rates, layout, shard, n, *, heads=(8, 8), grad_dtype=None):
    """The model of one (target, layout, shard, N): times in seconds per layer and host, efficiencies."""
    h, hk = heads
    causal = layout != "none"
    full = {b: hop_seconds(target, rates[False], shard, h, b) for b in (False, True)}
    diag = {b: hop_seconds(target, rates[True], shard, h, b) for b in (False, True)} if causal else full
    kv_b, grad_b = hop_bytes(shard, hk, grad_dtype=grad_dtype)
    bw = target.bandwidth(n)
    kv_s, grad_s = kv_b / bw, grad_b / bw
    fwd, bwd = (step_compute(layout, n, full[b], diag[b]) for b in (False, True))
    out = dict(target=target.name, layout=layout, heads=h, kv_heads=hk, shard=shard, n=n, seq=n * shard,
               network="fast" if n <= target.domain else target.outer_name, bandwidth=bw,
               hop_fwd_s=float(fwd[-1]), hop_bwd_s=float(bwd[-1]), kv_send_s=kv_s, grad_send_s=grad_s,
               compute_s=float(fwd.sum() + bwd.sum()),
               rate=(rates[False].provenance(shard) if target.name == MEASURED_ON else
                     f"scaled: v5e's x {target.peak_flops / TARGETS[MEASURED_ON].peak_flops:.2f} (peak FLOP/s), v5e "
                     f"{rates[False].provenance(shard)}"))
    for hidden in (True, False):
        key = "hidden" if hidden else "exposed"
        out[f"fwd_{key}_s"] = pass_seconds(fwd, kv_s, hidden=hidden)
        out[f"bwd_{key}_s"] = pass_seconds(bwd, kv_s, grad_s, hidden=hidden)
        out[f"eff_{key}"] = out["compute_s"] / (out[f"fwd_{key}_s"] + out[f"bwd_{key}_s"])
    out["eff_before"] = out["compute_s"] / (out["fwd_hidden_s"] + out["bwd_exposed_s"])
    return out


def hide_threshold(target, rates, layout, *, backward, bandwidth, heads=(8, 8), grad_dtype=None, dtype="bfloat16",
                   dim=DIM):
    """The shortest shard (tokens, a float) whose steady steps -- step 1 on, the layout's hop -- hide their
    sends: where that hop's compute equals K/V (+ dK/dV in the backward) over ``bandwidth``, by bisection
    in log2 of the shard (compute grows as c^2 / rate(c), the sends as c)."""
    h, hk = heads

    def slack(log_c):
        c = 2.0 ** log_c
        full = hop_seconds(target, rates[False], c, h, backward, dim)
        diag = hop_seconds(target, rates[True], c, h, backward, dim) if layout != "none" else full
        kv_b, grad_b = hop_bytes(1, hk, dtype, grad_dtype, dim)  # per token of the shard
        sends = c * (kv_b + (grad_b if backward else 0)) / bandwidth
        return step_compute(layout, 2, full, diag)[-1] - sends

    lo, hi = 0.0, 30.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if slack(mid) >= 0 else (mid, hi)
    return 2.0 ** hi


def rows_for(args):
    """Every modelled row for the command line's targets, layouts, shards and Ns."""
    rates = measured(args.heads, args.kernel)
    return [row(TARGETS[t], rates, layout, s, n, heads=args.heads, grad_dtype=args.grad_dtype)
            for layout in args.layouts for t in args.targets for s in args.shards for n in args.ns]


def thresholds(args):
    """Per target: the paper's ``F / B`` (peak F, a chip's bandwidth, forward) and ours, forward and backward,
    at the ring step's bandwidth in and beyond the domain, per layout."""
    rates = measured(args.heads, args.kernel)
    out = []
    for name in args.targets:
        t = TARGETS[name]
        r = dict(target=name, peak_flops=t.peak_flops, hop=t.hop, chip=t.chip, outer=t.outer,
                 paper=t.peak_flops / t.chip)
        for layout in args.layouts:
            for backward in (False, True):
                for where, bw in (("fast", t.hop), ("outer", t.outer)):
                    key = f"{layout}_{'bwd' if backward else 'fwd'}_{where}"
                    r[key] = hide_threshold(t, rates, layout, backward=backward, bandwidth=bw, heads=args.heads,
                                            grad_dtype=args.grad_dtype)
        out.append(r)
    return out


def _tokens(c):
    return f"{c / 1024:.1f}K"


def threshold_table(rows, layouts):
    """Markdown: the paper's F/B next to the model's hide thresholds (tokens per chip)."""
    cols = ["target", "peak TFLOP/s", "B hop / chip / outer GB/s", "paper F/B (peak F, chip B, fwd)"]
    for layout in layouts:
        cols += [f"{layout}: fwd / bwd", f"{layout}: fwd / bwd beyond the domain"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["target"], f"{r['peak_flops'] / 1e12:.0f}",
                 f"{r['hop'] / 1e9:.0f} / {r['chip'] / 1e9:.0f} / {r['outer'] / 1e9:.1f}", _tokens(r["paper"])]
        for layout in layouts:
            for where in ("fast", "outer"):
                cells.append(f"{_tokens(r[f'{layout}_fwd_{where}'])} / {_tokens(r[f'{layout}_bwd_{where}'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(rows, ns=(8, 64, 1024), shards=(4096, 16384, 65536)):
    """Markdown, one layout: efficiency of the forward+backward, hidden / exposed, at a few N and shard lengths;
    ``*`` where the ring crosses the outer network."""
    cols = [f"N = {n}: hidden / exposed" for n in ns]
    lines = ["| target | shard | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    targets = list(dict.fromkeys(r["target"] for r in rows))
    at = {(r["target"], r["shard"], r["n"]): r for r in rows}
    for t in targets:
        for s in shards:
            cells = []
            for n in ns:
                r = at.get((t, s, n))
                mark = "*" if r and r["network"] != "fast" else ""
                cells.append(f"{r['eff_hidden']:.2f} / {r['eff_exposed']:.2f}{mark}" if r else "")
            lines.append(f"| {t} | {report.length_label(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time(seconds):
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def long_table(rows):
    """Markdown, every row: per-hop times, one layer's forward+backward per chip, efficiencies ("before":
    forward hidden, backward exposed, as the compiled per-hop ring scheduled them before issue 45)."""
    cols = ["target", "layout", "shard", "N", "network", "hop fwd / bwd", "send K/V / dK/dV",
            "layer fwd+bwd hidden / exposed / before", "eff hidden / exposed / before", "rate"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(" | ".join([
            f"| {r['target']}", r["layout"], report.length_label(r["shard"]), str(r["n"]), r["network"],
            f"{_time(r['hop_fwd_s'])} / {_time(r['hop_bwd_s'])}",
            f"{_time(r['kv_send_s'])} / {_time(r['grad_send_s'])}",
            f"{_time(r['fwd_hidden_s'] + r['bwd_hidden_s'])} / {_time(r['fwd_exposed_s'] + r['bwd_exposed_s'])} / "
            f"{_time(r['fwd_hidden_s'] + r['bwd_exposed_s'])}",
            f"{r['eff_hidden']:.2f} / {r['eff_exposed']:.2f} / {r['eff_before']:.2f}", r["rate"]]) + " |")
    return "\n".join(lines)


def inputs_table(rates, heads):
    """Markdown: the measured hops (``heads`` query heads) the model starts from, with their rows."""
    lines = ["| shard | causal | fwd ms | bwd ms | fwd / bwd TFLOP/s | row |", "|---|---|---|---|---|---|"]
    for causal, m in sorted(rates.items()):
        for i, shard in enumerate(m.shards):
            fwd_f, bwd_f = hop_flops(shard, heads, causal), hop_flops(shard, heads, causal, True)
            lines.append(f"| {report.length_label(shard)} | {'yes' if causal else 'no'} | "
                         f"{fwd_f / m.fwd_flops_per_s[i] * 1e3:.3f} | {bwd_f / m.bwd_flops_per_s[i] * 1e3:.3f} | "
                         f"{m.fwd_flops_per_s[i] / 1e12:.1f} / {m.bwd_flops_per_s[i] / 1e12:.1f} | {m.sources[i]} |")
    return "\n".join(lines)


def plot(rows, path, shards=(4096, 16384, 65536)):
    """Efficiency of forward+backward against N, one panel per target: solid hidden, dashed exposed, one colour
    per shard length; a dotted line where the ring leaves the fast links."""
    plt = report.pyplot()
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, len(targets), figsize=(3.1 * len(targets), 3.4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], targets):
        for i, s in enumerate(shards):
            rs = sorted((r for r in rows if r["target"] == name and r["shard"] == s), key=lambda r: r["n"])
            if not rs:
                continue
            ns = [r["n"] for r in rs]
            ax.plot(ns, [r["eff_hidden"] for r in rs], "-", color=f"C{i}", label=f"{report.length_label(s)} hidden")
            ax.plot(ns, [r["eff_exposed"] for r in rs], "--", color=f"C{i}", label=f"{report.length_label(s)} exposed")
        if TARGETS[name].domain < max(NS):
            ax.axvline(TARGETS[name].domain, color="grey", linestyle=":", linewidth=1)
        report.log2_length_axis(ax, [2, 8, 64, 256, 1024], "chips N")
        ax.set_xticks([2, 8, 64, 256, 1024], ["2", "8", "64", "256", "1024"])
        t = TARGETS[name]
        ax.set_title(f"{name}: {t.hop / 1e9:.0f} GB/s a hop; {t.outer_name} {t.outer / 1e9:.3g} past {t.domain}",
                     fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention fwd+bwd efficiency (model)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def _heads(text):
    h, _, hk = text.partition("/")
    return int(h), int(hk or h)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n")[0],
                                formatter_class=report.HelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS))
    p.add_argument("--layouts", default="none,zigzag", help="comma list of " + ", ".join(LAYOUTS)
                   + " (none: non-causal)")
    p.add_argument("--shards", default=",".join(map(str, SHARDS)), help="tokens per chip, comma list")
    p.add_argument("--ns", default=",".join(map(str, NS)), help="ring sizes, comma list")
    p.add_argument("--heads", default="8", choices=["8", "32/8"], help="H or H/Hkv: the measured v5e runs")
    p.add_argument("--kernel", default="fused", choices=list(KERNELS),
                   help="whose measured hop: the fused ring's kernel (a TPU ring's default) or the per-hop kernel")
    p.add_argument("--grad-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dK/dV on the wire (omitted: the accumulators' float32, as ring_attention sends them)")
    p.add_argument("--long", action="store_true", help="print every row, not the summary")
    p.add_argument("--out", help="write one JSON line per row here")
    p.add_argument("--plot", help="save the efficiency-vs-N figure to this image file")
    args = p.parse_args(argv)
    args.targets = args.targets.split(",")
    args.layouts = args.layouts.split(",")
    for name, values, allowed in (("--targets", args.targets, TARGETS), ("--layouts", args.layouts, LAYOUTS)):
        if not set(values) <= set(allowed):
            p.error(f"{name}: expected a comma list of {', '.join(allowed)}; got {','.join(values)}")
    args.shards, args.ns, args.heads = _ints(args.shards), _ints(args.ns), _heads(args.heads)
    if min(args.shards) < 1 or min(args.ns) < 1:
        p.error("--shards and --ns must be positive")
    return args


def _pick(values, preferred):
    """The preferred values that were asked for, else the first three asked for."""
    return [v for v in preferred if v in values] or list(values[:3])


def main(argv=None):
    args = parse_args(argv)
    rows = rows_for(args)
    if args.out:
        with open(args.out, "w") as out:
            for r in rows:
                print(json.dumps(r), file=out)
    h, hk = args.heads
    print(f"model: batch 1, heads {h}/{hk}, d = {DIM}, bfloat16; v5e hop times measured ({args.kernel} kernel, "
          f"{RUNS[args.heads]}); other chips scaled by peak FLOP/s; published bandwidths", file=sys.stderr)
    rates = measured(args.heads, args.kernel)
    print(f"measured on one v5e ({args.kernel} kernel, {h}/{hk} heads):\n\n" + inputs_table(rates, h))
    print("\nhide thresholds (tokens per chip):\n\n" + threshold_table(thresholds(args), args.layouts))
    for layout in args.layouts:
        rs = [r for r in rows if r["layout"] == layout]
        title = "non-causal" if layout == "none" else f"causal, {layout}"
        print(f"\n{title}: " + ("every row" if args.long else "fwd+bwd efficiency, hidden / exposed "
                                "(* the ring crosses the outer network)") + "\n")
        print(long_table(rs) if args.long else summary_table(rs, ns=_pick(args.ns, (8, 64, 1024)),
                                                             shards=_pick(args.shards, (4096, 16384, 65536))))
    if args.plot:
        plot([r for r in rows if r["layout"] == args.layouts[0]], args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
