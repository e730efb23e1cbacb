"""Cost and memory model of Ring Attention (Liu, Zaharia, Abbeel, arXiv:2310.01889, §3, Tables 1-2).

One ring step on one host: its query shard of ``c`` tokens attends to the K/V shard of ``c`` tokens it
holds (``4 d c^2`` FLOPs: ``Q K^T`` and ``P V``, 2 FLOPs per multiply-add) while it sends that K/V
shard on (``4 c d`` bytes: K and V, ``c x d`` each, 2 bytes in bf16). The transfer hides behind the
compute when ``4 d c^2 / F >= 4 c d / B``, i.e. when the shard length ``c`` (tokens per host; the
paper's "block size") is at least::

    c >= F / B        (F = FLOP/s per host, B = unidirectional host-to-host bandwidth in bytes/s)

Example: an A100 (312 TFLOP/s) over NVLink (300 GB/s) needs ``c >= 1040`` tokens; the paper then
asks for ``s = 6c`` tokens per host (6.2K). Over InfiniBand (12.5 GB/s) it needs ~25K.

The paper counts the forward. The backward ring computes 2.5x the FLOPs and sends K/V *and* their float32
dK/dV, 3x the bytes in bf16, so it needs ``c >= 1.2 F/B`` (:func:`backward_min_block_size`);
:func:`ring_pass_seconds` times a whole pass, hidden or exposed (``benchmarks/scaling.py`` takes both from
one measured chip to a thousand).

Units: FLOPs, bytes and seconds. Activation formulas reproduce Table 1 as printed, and the table is
not in one unit: vanilla attention's ``2bns^2`` is bytes in bf16 (``b n s^2`` scores, 2 bytes each),
while Ring Attention's ``6bch`` counts *elements* (six ``b x c x h`` arrays; ``12bch`` bytes in bf16).
``dtype_bytes`` (default 2) rescales them by ``dtype_bytes / 2``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backward import grad_itemsize

SEQ_PER_BLOCK = 6  # the paper's rule of thumb (Table 2): s = 6c tokens per host


@dataclass(frozen=True)
class Hardware:
    """One host of a ring: peak FLOP/s ``F`` and unidirectional link bandwidth ``B`` (bytes/s).

    Two tiers of links (optional, used by ``strategy_cost``): devices come in groups of ``group_size``
    (a node's GPUs on NVLink, the chips of a TPU host), devices ``0 .. group_size - 1`` in the first,
    linked at ``bandwidth_bytes_per_s``; a device reaches other groups at ``inter_bandwidth_bytes_per_s``
    (its share of the network, e.g. one 100 Gb/s InfiniBand port per GPU: 12.5e9). Both None (the
    default, every row of :data:`HARDWARE`): one tier, every link at ``B``. Example, two nodes of 4
    A100s: ``Hardware("A100 4-GPU nodes", 312e12, 300e9, group_size=4, inter_bandwidth_bytes_per_s=12.5e9)``.
    """
    name: str
    flops_per_s: float
    bandwidth_bytes_per_s: float
    group_size: int | None = None
    inter_bandwidth_bytes_per_s: float | None = None

    @property
    def two_tier(self):
        """Whether the links have two tiers (``group_size`` set)."""
        return self.group_size is not None


# Table 2 of arXiv:2310.01889 (bf16 peak TFLOP/s; GB/s, 1 GB = 1e9 bytes).
HARDWARE = {hw.name: hw for hw in (
    Hardware("A100 NVLink", 312e12, 300e9),
    Hardware("A100 InfiniBand", 312e12, 12.5e9),
    Hardware("TPU v3", 123e12, 112e9),
    Hardware("TPU v4", 275e12, 268e9),
    Hardware("TPU v5e", 196e12, 186e9),
)}


def positive(name, value):
    """``value`` (a number or array) as float, checked positive and finite; ``name`` is for the error."""
    arr = np.asarray(value, dtype=float)
    if arr.size == 0 or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise ValueError(f"{name} must be a positive finite number (or array of them); got {value!r}")
    return arr if arr.ndim else float(arr)


def _plain(x):
    """A 0-d result as a Python float, arrays unchanged."""
    return float(x) if np.ndim(x) == 0 else x


def as_hardware(hardware):
    """A ``Hardware``, or the name of a row of ``HARDWARE`` (Table 2), as a ``Hardware``."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware in HARDWARE:
        return HARDWARE[hardware]
    raise ValueError(f"hardware must be a Hardware or one of {sorted(HARDWARE)}; got {hardware!r}")


def step_flops(shard, dim, *, batch=1, heads=1):
    """FLOPs of one ring step on one host: ``4 * batch * heads * shard^2 * dim`` (§3, ``4 d c^2``).

    ``shard`` (tokens per host, the paper's ``c``) query tokens against ``shard`` key tokens, per head
    of width ``dim``: ``Q K^T`` and ``P V`` are ``2 * shard^2 * dim`` FLOPs each. With
    ``heads = 1, dim = d`` this is the paper's count.
    """
    shard, dim = positive("shard", shard), positive("dim", dim)
    batch, heads = positive("batch", batch), positive("heads", heads)
    return 4.0 * batch * heads * shard ** 2 * dim


def step_bytes(shard, dim, *, batch=1, kv_heads=1, dtype_bytes=2):
    """Bytes one host sends per ring step: K and V, ``2 * batch * shard * kv_heads * dim * dtype_bytes``.

    ``shard``: tokens per host (the paper's ``c``). In bf16 (``dtype_bytes = 2``) with
    ``kv_heads = 1, dim = d`` this is the paper's ``4 c d`` (§3).
    """
    shard, dim = positive("shard", shard), positive("dim", dim)
    batch, kv_heads = positive("batch", batch), positive("kv_heads", kv_heads)
    return 2.0 * batch * shard * kv_heads * dim * positive("dtype_bytes", dtype_bytes)


def min_block_size(flops_per_s, bandwidth_bytes_per_s, *, dtype_bytes=2, heads=1, kv_heads=None, fill=1.0):
    """The paper's "minimal block size": the shortest shard ``c`` (tokens per host) whose compute hides
    the K/V transfer, ``c >= F / B`` (§3).

    From ``4 d c^2 / F >= 2 c d * dtype_bytes / B``: ``c >= (dtype_bytes / 2) * F / B``, i.e. ``F / B``
    in bf16. Returns a float (round up for a usable shard). A100 + NVLink: 312e12 / 300e9 = 1040.

    Beyond the paper's count (defaults reproduce it): with grouped-query attention all ``heads``
    compute while only ``kv_heads`` travel, so the bound scales by ``kv_heads / heads``; a hop that
    computes only a fraction ``fill`` of its tiles (about 1/2 for the causal diagonal hop) still sends
    the whole shard, so it scales by ``1 / fill``. Pass *achieved* FLOP/s and bandwidth, not peak,
    for a real host: the hop runs at the achieved rates.
    """
    f = positive("flops_per_s", flops_per_s)
    b = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    heads = positive("heads", heads)
    kv_heads = heads if kv_heads is None else positive("kv_heads", kv_heads)
    fill = positive("fill", fill)
    return f / b * positive("dtype_bytes", dtype_bytes) / 2.0 * (kv_heads / heads) / fill


@dataclass(frozen=True)
class HopTimes:
    """Seconds one ring step takes to compute and to send its K/V shard (arrays if ``shard`` is)."""
    compute_s: float | np.ndarray
    transfer_s: float | np.ndarray


def hop_times(shard, hardware, *, dim=128, batch=1, heads=1, kv_heads=None, dtype_bytes=2):
    """Per-hop compute time ``step_flops / F`` and transfer time ``step_bytes / B`` for ``shard``.

    shard: int or array of shard lengths (tokens per host, ``c``); hardware: a :class:`Hardware` or a key of
    :data:`HARDWARE`. ``kv_heads`` defaults to ``heads``. Compute grows as ``c^2`` and transfer as
    ``c``; with ``kv_heads == heads`` they cross at ``c = min_block_size(F, B, dtype_bytes=...)``.
    """
    hw = as_hardware(hardware)
    kv_heads = heads if kv_heads is None else kv_heads
    flops = step_flops(shard, dim, batch=batch, heads=heads)
    sent = step_bytes(shard, dim, batch=batch, kv_heads=kv_heads, dtype_bytes=dtype_bytes)
    return HopTimes(flops / hw.flops_per_s, sent / hw.bandwidth_bytes_per_s)


# --- The backward ring (beyond the paper's section 3, which counts the forward) -----------------------------
# FlashAttention-2's backward (arXiv:2307.08691, Algorithm 2) recomputes S = Q K^T and adds dP = dO V^T,
# dV += P^T dO, dQ += dS K and dK += dS^T Q: five matmuls a tile to the forward's two. Each backward step
# sends the held K/V shard on *and* the dK/dV accumulators travelling with it, float32 for bf16 inputs
# (``backward.grad_itemsize``): 3x the forward's bytes for 2.5x its FLOPs. ``backward.backward_factors``
# measures both ratios on the simulated ring's traces; the functions below are the same counts in closed
# form, and ``benchmarks/scaling.py`` scales them from one measured chip to a thousand.
BACKWARD_FLOPS_RATIO = 2.5  # five matmuls to two


def backward_step_flops(shard, dim, *, batch=1, heads=1):
    """FLOPs of one backward ring step on one host: ``2.5 * step_flops`` = ``10 * batch * heads * shard^2 * dim``."""
    return BACKWARD_FLOPS_RATIO * step_flops(shard, dim, batch=batch, heads=heads)


def backward_step_bytes(shard, dim, *, batch=1, kv_heads=1, dtype_bytes=2, grad_bytes=None):
    """Bytes one host sends in a backward ring step: K and V as in the forward (``step_bytes``) plus their
    dK/dV accumulators, ``2 * batch * shard * kv_heads * dim * (dtype_bytes + grad_bytes)``.

    ``grad_bytes`` defaults to ``backward.grad_itemsize(dtype_bytes)``: float32 accumulators for bf16 K/V,
    so a step sends 3x the forward's bytes; 2 is ``ringattn_fast``'s ``grad_comm_dtype="bfloat16"``. (The
    ring's first step sends no accumulators yet and its last no K/V: :func:`ring_pass_seconds`.)
    """
    e = positive("dtype_bytes", dtype_bytes)
    g = grad_itemsize(e) if grad_bytes is None else positive("grad_bytes", grad_bytes)
    kv = step_bytes(shard, dim, batch=batch, kv_heads=kv_heads, dtype_bytes=e)
    return kv * (e + g) / e


def backward_min_block_size(flops_per_s, bandwidth_bytes_per_s, *, dtype_bytes=2, grad_bytes=None, heads=1,
                            kv_heads=None, fill=1.0):
    """The backward's minimal block size: the shortest shard whose backward hop hides its sends (K/V and dK/dV).

    From ``10 h d c^2 fill / F >= 2 hk d c (e + g) / B``: ``c >= (e + g) / 5 * (hk / h) / fill * F / B``, that
    is :func:`min_block_size` times ``(e + g) / (2.5 e)``: **1.2 F/B** in bf16 with float32 accumulators (the
    2.5x FLOPs do not quite pay for the 3x bytes). ``F`` is the backward kernel's FLOP/s; achieved, it is
    not the forward's (on a TPU v5e the backward ran at about 1.6x the forward's rate, docs/benchmarks.md).
    """
    e = positive("dtype_bytes", dtype_bytes)
    g = grad_itemsize(e) if grad_bytes is None else positive("grad_bytes", grad_bytes)
    forward = min_block_size(flops_per_s, bandwidth_bytes_per_s, dtype_bytes=e, heads=heads, kv_heads=kv_heads,
                             fill=fill)
    return forward * (e + g) / (BACKWARD_FLOPS_RATIO * e)


def ring_pass_seconds(compute_s, kv_s, grad_s=0.0, *, hidden=True):
    """Seconds one host spends in a ring pass: ``compute_s[step]`` the hop of each of the N steps, ``kv_s``
    one K/V send, ``grad_s`` one send of the dK/dV accumulators (0: the forward).

    The schedule of ``ring.py`` and ``backward.py``: at step ``s`` the host computes its hop while the K/V for
    step ``s + 1`` are on the wire (steps ``0 .. N-2``: N - 1 sends) and, in the backward, the accumulators
    finished at step ``s - 1`` (steps ``1 .. N-1``); the N-th accumulator send, home, follows the last hop.
    ``hidden``: a step lasts as long as the longer of its compute and its sends (the paper's overlap);
    otherwise as their sum (a transfer the compiler left exposed). Example, N = 2, forward, exposed:
    ``compute_s[0] + kv_s + compute_s[1]``.
    """
    n = len(compute_s)
    total = 0.0
    for step in range(n):
        sends = (kv_s if step < n - 1 else 0.0) + (grad_s if step > 0 else 0.0)
        total += max(compute_s[step], sends) if hidden else compute_s[step] + sends
    return total + (grad_s if n > 1 else 0.0)  # the accumulators' last move, home: nothing left to hide it


@dataclass(frozen=True)
class Table2Row:
    """One row of Table 2: hardware, F, B, ``min_block`` = the paper's "minimal block size" ``c = F/B``
    (tokens per host: the shortest shard whose compute hides its transfer) and sequence per host ``6c``."""
    name: str
    flops_per_s: float
    bandwidth_bytes_per_s: float
    min_block: float
    min_seq: float


def table2(hardware=None, *, dtype_bytes=2):
    """Reproduce Table 2 of arXiv:2310.01889: minimal shard length ``c`` (the paper's "minimal block
    size", tokens per host) and sequence length per host ``6c``.

    hardware: iterable of :class:`Hardware` or names (default: all of :data:`HARDWARE`, in the
    paper's order). Returns a list of :class:`Table2Row`; ``min_block`` and ``min_seq`` in tokens.
    """
    rows = []
    for hw in (HARDWARE.values() if hardware is None else [as_hardware(h) for h in hardware]):
        c = min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, dtype_bytes=dtype_bytes)
        rows.append(Table2Row(hw.name, hw.flops_per_s, hw.bandwidth_bytes_per_s, c, SEQ_PER_BLOCK * c))
    return rows


def format_table2(rows):
    """Table 2 as text, in the paper's units (TFLOP/s, GB/s, thousands of tokens)."""
    lines = [f"{'hardware':<16} {'F TFLOP/s':>9} {'B GB/s':>7} {'min block':>9} {'min seq':>8}"]
    for r in rows:
        lines.append(f"{r.name:<16} {r.flops_per_s / 1e12:>9.0f} {r.bandwidth_bytes_per_s / 1e9:>7.1f} "
                     f"{r.min_block / 1e3:>8.1f}K {r.min_seq / 1e3:>7.1f}K")
    return "\n".join(lines)


# Table 1 of arXiv:2310.01889 as printed: maximum activation per layer (bf16 bytes for 2bns^2; 6bch
# counts elements, see the module docstring)
# (b batch, s sequence, h hidden, n heads, c tokens per host: the shard length, the paper's "block size").
TABLE1_FORMULAS = {
    "vanilla": ("2bns^2", "8bsh"),
    "memory-efficient attention": ("2bsh + 4bch", "8bsh"),
    "blockwise parallel transformer": ("2bsh", "2bsh"),
    "ring attention": ("6bch", "2bch"),
}


def activation_bytes(method, *, batch, seq, hidden, heads, shard, dtype_bytes=2):
    """Per-host peak activation bytes ``(attention, feedforward)`` of one layer (Table 1).

    method: a key of :data:`TABLE1_FORMULAS`; ``shard``: tokens per host (the paper's ``c``). Any size
    argument may be a numpy array (for curves).
    The table's values as printed, scaled by ``dtype_bytes / 2``. Ring Attention's ``6bch`` is six
    ``b x c x h`` arrays -- query, K and V held, K and V receive buffers, output -- counted in elements
    (in bf16 bytes it is ``12bch``; the paper's ``2bns^2`` is bytes); it does not
    depend on ``seq``: more hosts, not more memory per host.
    """
    b, s = positive("batch", batch), positive("seq", seq)
    h, n, c = positive("hidden", hidden), positive("heads", heads), positive("shard", shard)
    unit = positive("dtype_bytes", dtype_bytes) / 2.0
    formulas = {
        "vanilla": (2 * b * n * s ** 2, 8 * b * s * h),
        "memory-efficient attention": (2 * b * s * h + 4 * b * c * h, 8 * b * s * h),
        "blockwise parallel transformer": (2 * b * s * h, 2 * b * s * h),
        "ring attention": (6 * b * c * h * np.ones_like(s), 2 * b * c * h * np.ones_like(s)),  # flat in s
    }
    if method not in formulas:
        raise ValueError(f"method must be one of {list(TABLE1_FORMULAS)}; got {method!r}")
    attn, ffn = formulas[method]
    return _plain(attn * unit), _plain(ffn * unit)


@dataclass(frozen=True)
class Table1Row:
    """One row of Table 1: formulas and their values (bytes) for the given sizes."""
    method: str
    attention_formula: str
    ffn_formula: str
    attention_bytes: float
    ffn_bytes: float
    total_bytes: float  # the layer's peak: attention and FFN run one after the other


def table1(*, batch, seq, hidden, heads, shard, dtype_bytes=2):
    """Table 1 of arXiv:2310.01889 evaluated at the given sizes (``shard``: tokens per host, ``c``):
    a list of :class:`Table1Row`."""
    rows = []
    for method, (attn_formula, ffn_formula) in TABLE1_FORMULAS.items():
        attn, ffn = activation_bytes(method, batch=batch, seq=seq, hidden=hidden, heads=heads,
                                     shard=shard, dtype_bytes=dtype_bytes)
        rows.append(Table1Row(method, attn_formula, ffn_formula, attn, ffn, _plain(np.maximum(attn, ffn))))
    return rows
