"""The cost physics of the course: a roofline (compute against HBM) and an alpha-beta model of messages.

Notebook 06 derives the paper's overlap condition ``c >= F/B`` from FLOPs and *link* bytes. Two
things it leaves out decide most real numbers (the scaling book's "rooflines" and "collectives"):

- **HBM.** A kernel reads its operands from the chip's high-bandwidth memory at ``H`` bytes/s, so it
  takes at least ``max(flops / F, hbm_bytes / H)`` seconds (the roofline). Its *arithmetic
  intensity* ``flops / hbm_bytes`` against the chip's ridge ``F / H`` says which term wins: above
  the ridge it is compute-bound, below it memory-bound. A FlashAttention hop of ``c`` queries against
  ``c`` keys does ``4 h c^2 d`` FLOPs on ``2 e c d (h + hk)`` bytes (q, o, k, v; the scores stay on
  chip): intensity ``~c/2`` in bf16, compute-bound once ``c`` passes ``2 F / H``. Decode (one query
  row) does ``4 h c d`` FLOPs on the ``2 e c hk d`` bytes of cache it reads: intensity ``h / hk``
  FLOPs per byte in bf16, far below every ridge -- decode is memory-bound at any length.
- **Latency.** A message of ``n`` bytes takes ``alpha + n / B`` seconds (``alpha``: the per-message
  start-up cost). Collectives are sums of messages: a ring all-gather of shards of ``n`` bytes is
  ``N - 1`` of them, a tree reduction ``ceil(log2 N)``. Small messages cost ``alpha``, not bytes.

``CHIPS`` extends each row of the paper's Table 2 (``ringattn_ref.cost.HARDWARE``: ``F`` and ``B``)
with the HBM bandwidth of the chip's datasheet and an *assumed* per-message latency (the notebooks
check their conclusions over a range of ``alpha``, not at one value). Units: FLOPs, bytes, seconds.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ringattn_ref import cost

# HBM bandwidth per chip, bytes/s (datasheets: A100 80 GB SXM 2,039 GB/s; TPU v3 900 GB/s; TPU v4
# 1,200 GB/s; TPU v5e 819 GB/s).
HBM_BYTES_PER_S = {"A100 NVLink": 2.039e12, "A100 InfiniBand": 2.039e12, "TPU v3": 0.9e12,
                   "TPU v4": 1.2e12, "TPU v5e": 0.819e12}
# Per-message latency alpha, seconds: orders of magnitude assumed for a neighbour message (a few us over
# NVLink, more between nodes, about a microsecond over TPU ICI), not measured here.
LATENCY_S = {"A100 NVLink": 3e-6, "A100 InfiniBand": 5e-6, "TPU v3": 1e-6, "TPU v4": 1e-6, "TPU v5e": 1e-6}


@dataclass(frozen=True)
class Chip:
    """One host: peak FLOP/s ``F``, HBM bytes/s ``H``, link bytes/s ``B`` (one direction), latency ``alpha``."""
    name: str
    flops_per_s: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    latency_s: float

    @property
    def ridge(self):
        """``F / H``: the arithmetic intensity (FLOPs per HBM byte) at which compute and HBM take equal time."""
        return self.flops_per_s / self.hbm_bytes_per_s

    def with_latency(self, latency_s):
        """The same chip with another per-message latency (to check a conclusion over a range of alpha)."""
        return Chip(self.name, self.flops_per_s, self.hbm_bytes_per_s, self.link_bytes_per_s, float(latency_s))


CHIPS = {name: Chip(name, hw.flops_per_s, HBM_BYTES_PER_S[name], hw.bandwidth_bytes_per_s, LATENCY_S[name])
         for name, hw in cost.HARDWARE.items()}


def chip(name_or_chip):
    """A :class:`Chip`, or the one of :data:`CHIPS` with that name (ValueError naming the choices)."""
    if isinstance(name_or_chip, Chip):
        return name_or_chip
    if name_or_chip in CHIPS:
        return CHIPS[name_or_chip]
    raise ValueError(f"chip must be a Chip or one of {sorted(CHIPS)}; got {name_or_chip!r}")


def _count(name, x, *, zero_ok=False):
    bad = isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x)
    if bad or x < 0 or (x == 0 and not zero_ok):
        raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} finite number; got {x!r}")
    return x


# ---- the roofline --------------------------------------------------------------------------------

def attention_flops_bytes(q_rows, keys, *, dim, heads, kv_heads=None, batch=1, dtype_bytes=2, materialized=False):
    """``(flops, hbm_bytes)`` of attention of ``q_rows`` queries against ``keys`` keys, per chip.

    FLOPs: ``4 b h q k d`` (``Q K^T`` and ``P V``). HBM bytes of a FlashAttention kernel (the course's
    hops): read q, k, v and write o once, ``e b d (2 h q + 2 hk k)``; the scores never leave the chip.
    ``materialized=True`` is plain attention done op by op, which writes the scores and reads them
    back, writes the probabilities and reads them back: ``+ 4 e b h q k``.
    """
    q, k = _count("q_rows", q_rows), _count("keys", keys)
    d, h, b, e = _count("dim", dim), _count("heads", heads), _count("batch", batch), _count("dtype_bytes", dtype_bytes)
    hk = h if kv_heads is None else _count("kv_heads", kv_heads)
    flops = 4.0 * b * h * q * k * d
    hbm = e * b * d * (2 * h * q + 2 * hk * k) + (4.0 * e * b * h * q * k if materialized else 0.0)
    return flops, hbm


def roofline_s(flops, hbm_bytes, chip_):
    """Seconds a kernel takes at least: ``max(flops / F, hbm_bytes / H)``."""
    c = chip(chip_)
    return max(_count("flops", flops, zero_ok=True) / c.flops_per_s,
               _count("hbm_bytes", hbm_bytes, zero_ok=True) / c.hbm_bytes_per_s)


def bound(flops, hbm_bytes, chip_):
    """``"compute"`` when the intensity ``flops / hbm_bytes`` is at or above the ridge ``F / H``, else ``"memory"``."""
    return "compute" if flops >= chip(chip_).ridge * hbm_bytes else "memory"


# ---- the alpha-beta model ------------------------------------------------------------------------

def message_s(nbytes, chip_):
    """One point-to-point message: ``alpha + n / B`` seconds (0 bytes: no message, 0 s)."""
    c = chip(chip_)
    n = _count("nbytes", nbytes, zero_ok=True)
    return 0.0 if n == 0 else c.latency_s + n / c.link_bytes_per_s


COLLECTIVES = ("ppermute", "all-gather", "reduce-scatter", "all-reduce", "tree-reduce", "all-to-all")


def collective_s(kind, nbytes, devices, chip_):
    """Seconds of one collective over ``devices`` hosts, each holding ``nbytes`` (alpha-beta, ring algorithms).

    ppermute: one message of ``n``. all-gather: ``N - 1`` messages of ``n`` (each host's shard goes
    around). reduce-scatter of an ``n``-byte array: ``N - 1`` messages of ``n / N``. tree-reduce
    (notebook 11's merge tree): ``ceil(log2 N)`` rounds of one ``n``-byte message. all-reduce: the
    faster of a ring (a reduce-scatter then an all-gather, ``2 (N - 1)`` messages of ``n / N``: best
    for large arrays) and a tree (reduce up, broadcast down, ``2 ceil(log2 N)`` messages of ``n``: best
    for small ones) -- libraries pick by size. all-to-all of an ``n``-byte buffer: ``N - 1`` messages of
    ``n / N`` (one to each other host, at the full link bandwidth, as on a switch).
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}; got {kind!r}")
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise ValueError(f"devices must be a positive int; got {devices!r}")
    n, p = _count("nbytes", nbytes, zero_ok=True), devices
    if p == 1:
        return 0.0
    rounds = math.ceil(math.log2(p))
    if kind == "all-reduce":
        return min(2 * (p - 1) * message_s(n / p, chip_), 2 * rounds * message_s(n, chip_))
    messages, size = {"ppermute": (1, n), "all-gather": (p - 1, n), "reduce-scatter": (p - 1, n / p),
                      "tree-reduce": (rounds, n), "all-to-all": (p - 1, n / p)}[kind]
    return messages * message_s(size, chip_)


# ---- the ring and decode, with both -------------------------------------------------------------

def ring_step_s(block, chip_, *, dim, heads, kv_heads=None, batch=1, dtype_bytes=2, fill=1.0):
    """``(compute_s, transfer_s)`` of one ring step: the hop on the roofline (``fill`` of its tiles
    computed), and the ``alpha + n / B`` of sending its K/V shard on."""
    hk = heads if kv_heads is None else kv_heads
    flops, hbm = attention_flops_bytes(block, block, dim=dim, heads=heads, kv_heads=hk, batch=batch,
                                       dtype_bytes=dtype_bytes)
    kv_bytes = cost.step_bytes(block, dim, batch=batch, kv_heads=hk, dtype_bytes=dtype_bytes)
    return roofline_s(fill * flops, hbm, chip_), message_s(kv_bytes, chip_)


def ring_s(seq, devices, chip_, **kwargs):
    """A ring forward of ``seq`` tokens on ``devices`` hosts: ``N - 1`` steps of the slower of compute and
    transfer, then the last hop (no send). ``kwargs``: those of :func:`ring_step_s`."""
    compute, transfer = ring_step_s(seq / devices, chip_, **kwargs)
    return (devices - 1) * max(compute, transfer) + compute


@dataclass(frozen=True)
class DecodeTimes:
    """Seconds per decoded token and layer: local attention on one shard, and each schedule's total."""
    local_s: float
    ring_s: float
    tree_s: float
    allreduce_s: float


def decode_s(seq, devices, chip_, *, dim, heads, kv_heads=None, batch=1, dtype_bytes=2, stat_bytes=4):
    """One decoded token: every host holds ``c = seq / N`` cached tokens and one query row per head.

    local: attention of one row against the shard, on the roofline (it reads ``2 e b c hk d`` bytes
    of cache for ``4 b h c d`` FLOPs: memory-bound). ring: the cache shards travel, ``N - 1`` steps of
    the slower of a local hop and sending a shard. tree: local, then ``ceil(log2 N)`` merge messages of
    ``b h (d + 1)`` statistics (``o`` and ``lse``, ``stat_bytes`` each). allreduce: local, then
    ``ringattn_fast``'s ``pmax`` of ``lse`` and ``psum`` of ``[o, 1]`` rescaled, two all-reduces.
    """
    hk = heads if kv_heads is None else kv_heads
    c = seq / devices
    flops, hbm = attention_flops_bytes(1, c, dim=dim, heads=heads, kv_heads=hk, batch=batch, dtype_bytes=dtype_bytes)
    local = roofline_s(flops, hbm, chip_)
    shard = cost.step_bytes(c, dim, batch=batch, kv_heads=hk, dtype_bytes=dtype_bytes)
    ring = (devices - 1) * max(local, message_s(shard, chip_)) + local
    stats = batch * heads * (dim + 1) * stat_bytes
    tree = local + collective_s("tree-reduce", stats, devices, chip_)
    allreduce = local + collective_s("all-reduce", batch * heads * stat_bytes, devices, chip_) + \
        collective_s("all-reduce", stats, devices, chip_)
    return DecodeTimes(local, ring, tree, allreduce)


def min_block(chip_, *, dim, heads, kv_heads=None, batch=1, dtype_bytes=2, fill=1.0):
    """Smallest block ``c`` (tokens per host) whose ring step hides its transfer under this model: the hop
    on the roofline against ``alpha + n / B``. With ``alpha = 0`` and a compute-bound hop it is the
    paper's ``(hk / h) (e / 2) F / B / fill``; latency raises it, most for small messages. Found by
    bisection on ``ring_step_s`` (compute grows as ``c^2`` once compute-bound, transfer as ``c``);
    ``inf`` when no block hides it (a memory-bound hop that never becomes compute-bound cannot)."""
    def hides(c):
        compute, transfer = ring_step_s(c, chip_, dim=dim, heads=heads, kv_heads=kv_heads, batch=batch,
                                        dtype_bytes=dtype_bytes, fill=fill)
        return compute >= transfer
    lo, hi = 1.0, 2.0
    while not hides(hi):
        lo, hi = hi, 2 * hi
        if hi > 2**40:
            return math.inf
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if hides(mid) else (mid, hi)
    return hi


def strategy_times(costs, devices, chip_):
    """Each strategy's forward time with per-message latency added to ``ringattn_ref.strategy_costs``'s model.

    costs: ``strategy_costs(...)``'s dict (its ``compute_s`` and ``comm_s`` are bandwidth only). The ring
    sends one K/V message per step, ``N - 1`` steps of ``max(compute / N, comm / (N - 1) + alpha)`` and the
    last hop; the all-gather pays ``N - 1`` latencies before the attention; Ulysses two all-to-alls of
    ``N - 1`` messages each. Infeasible strategies stay ``inf``.
    """
    alpha, n = chip(chip_).latency_s, devices
    times = {}
    for name, c in costs.items():
        if not c.feasible:
            times[name] = math.inf
        elif n == 1:
            times[name] = c.compute_s
        elif name == "ring":
            times[name] = (n - 1) * max(c.compute_s / n, c.comm_s / (n - 1) + alpha) + c.compute_s / n
        else:
            times[name] = c.compute_s + c.comm_s + (n - 1) * alpha * (1 if name == "allgather" else 2)
    return times
