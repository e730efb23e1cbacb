"""Cost model of the three ways to split attention over the sequence, and which one to choose.

Per host, one attention forward of ``S`` tokens on ``N`` devices (``c = S / N`` tokens each),
``h`` query heads, ``hk`` kv heads of width ``d``, ``e`` bytes per element; ``F`` FLOP/s and ``B``
bytes/s per host (a row of Table 2, :data:`ringattn_ref.cost.HARDWARE`)::

                 bytes sent per host             steps   peak memory grows with   comm hidden?
    ring         (N-1) 2 c hk d e                N - 1   c                         when c >= (hk/h)(e/2) F/B
    all-gather   (N-1) 2 c hk d e                N - 1   S  (all K/V)              no: before the attention
    Ulysses      (N-1) c d (2 h/N + 2 hk'/N) e   2       c  (S h/N = c h)          no: before and after

    hybrid U x R (U-1) c d (2 h/U + 2 hk'/U) e    2 + R-1 c  (S h/N = c h)          the ring's part, when
                 + (R-1) 2 U c (hk'/U) d e                                             U c >= (hk'/h)(e/2) F/B

All of them compute the same ``4 b h S^2 d / N`` FLOPs per host (non-causal; a causal mask halves all
alike with a balanced layout). The ring's transfer runs under its compute (paper §3,
``cost.min_block_size``); the all-gather and Ulysses wait for their collectives (we assume no
overlap with other layers, and an all-to-all at the host's full bandwidth ``B``, as on a switch --
NVSwitch, InfiniBand; on a torus it is slower). Ulysses needs ``h % N == 0``; with GQA each kv head
is repeated ``kv_repeat = N / gcd(hk, N)`` times before the all-to-all (``hk' = hk * kv_repeat``, 1
repeat when ``hk`` is a multiple of ``N``; ``strategies.kv_repeat``), as ``ringattn_fast`` does it: the
bytes are those of the program that runs, not of an ideal that sends each host only its distinct kv heads.

The hybrid (``hybrid.hybrid_attention``; USP, LoongTrain's 2-D attention) runs Ulysses inside groups
of ``U`` devices and the ring over the ``R = N / U`` groups: two all-to-alls of ``U`` devices around a
ring of ``R`` steps, each computing ``1/R`` of the work (``R`` times a ring step's) while it sends the
group's K/V on its heads (``hk' = hk * kv_repeat(hk, U)``). Every split with ``U`` dividing ``N`` and
``h`` is priced and the fastest kept. ``U = 1`` is the ring and ``R = 1`` Ulysses, in bytes sent, peak
bytes and time alike (the same kv heads sent, the same all-to-all pricing; a property test checks it).

Two tiers of links (``cost.Hardware.group_size``, ``inter_bandwidth_bytes_per_s``): device ``p`` is in
link group ``p // group_size``. A ring step is as slow as its slowest hop (a hop between groups runs at
the inter bandwidth); in an all-to-all a device sends to its own link group at ``B`` and to the other
groups at the inter bandwidth, both at once, and the slowest device sets the time. The hybrid puts its
Ulysses groups on consecutive devices (host ``r U + u``), inside a link group when ``U`` divides
``group_size``. One tier (the default): everything at ``B``, as above.

The memory and bytes columns are exactly what ``ringattn_ref.ring``, ``ringattn_ref.strategies`` and
``ringattn_ref.hybrid`` count on their simulated hosts (tests check it), with a ``block x block`` score tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blockwise import default_block
from .cost import as_hardware
from .hybrid import check_split, hybrid_splits
from .strategies import kv_repeat

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
SIMPLICITY = ("allgather", "ulysses", "ring", "hybrid")  # one collective + any kernel first; two levels last


@dataclass(frozen=True)
class StrategyCost:
    """Modelled cost of one strategy, per host, one forward pass (bytes, seconds).

    feasible / why_not: whether it applies (Ulysses needs heads % devices == 0; a memory limit);
    steps: communication rounds; exposed_comm_s: communication not hidden behind compute;
    overlapped: all of it hidden (only the ring can: ``c >= (hk/h)(e/2) F/B``);
    ulysses_size, ring_size: the hybrid's split (``U x R``), None for the other strategies.
    """
    strategy: str
    feasible: bool
    why_not: str | None
    peak_bytes: int
    bytes_sent: int
    steps: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    time_s: float
    overlapped: bool
    ulysses_size: int | None = None
    ring_size: int | None = None


@dataclass(frozen=True)
class StrategyChoice:
    """``choose_strategy``'s answer: ``strategy`` (a name of :data:`STRATEGIES`), a human-readable
    ``reason``, every strategy's :class:`StrategyCost` in ``costs``, and the split (``ulysses_size``,
    ``ring_size``) when the hybrid is chosen (else None)."""
    strategy: str
    reason: str
    costs: dict
    ulysses_size: int | None = None
    ring_size: int | None = None

    def __str__(self):
        return self.reason


def _number(name, value, *, zero_ok=False):
    """A real number (not a bool, a string or an array), finite, ``> 0`` (``>= 0`` with ``zero_ok``):
    a zero or negative rate would end in ZeroDivisionError or pick a strategy from negative times."""
    need = "a finite number >= 0" if zero_ok else "a positive finite number"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be {need} (not a bool or a string); got {value!r}")
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {need}; got {value!r}")
    return float(value)


def _checked_hardware(hardware):
    """``hardware`` as a ``Hardware`` whose FLOP rate and bandwidths are positive finite numbers, and
    whose two-tier fields are both set (a positive int group size) or both None."""
    hw = as_hardware(hardware)
    _number(f"hardware.flops_per_s (of {hw.name!r})", hw.flops_per_s)
    _number(f"hardware.bandwidth_bytes_per_s (of {hw.name!r})", hw.bandwidth_bytes_per_s)
    if (hw.group_size is None) != (hw.inter_bandwidth_bytes_per_s is None):
        raise ValueError(f"hardware.group_size and hardware.inter_bandwidth_bytes_per_s (of {hw.name!r}) go "
                         f"together: both set (two tiers of links) or both None; got {hw.group_size!r} and "
                         f"{hw.inter_bandwidth_bytes_per_s!r}")
    if hw.two_tier:
        g = hw.group_size
        if not isinstance(g, (int, np.integer)) or isinstance(g, (bool, np.bool_)) or g < 1:
            raise ValueError(f"hardware.group_size (of {hw.name!r}) must be a positive int; got {g!r}")
        _number(f"hardware.inter_bandwidth_bytes_per_s (of {hw.name!r})", hw.inter_bandwidth_bytes_per_s)
    return hw


def _link_groups(hw, devices):
    """The link group of each device id (all 0 on one tier)."""
    return devices // hw.group_size if hw.two_tier else np.zeros_like(devices)


def _ring_bandwidth(hw, n, stride=1):
    """The bandwidth of a ring step where device ``p`` of ``n`` sends to ``p + stride``: the inter
    bandwidth if any hop leaves its link group (the step waits for its slowest hop), else ``B``."""
    p = np.arange(n)
    crosses = bool(np.any(_link_groups(hw, p) != _link_groups(hw, (p + stride) % n)))
    return hw.inter_bandwidth_bytes_per_s if crosses else hw.bandwidth_bytes_per_s


def _all_to_all_seconds(hw, per_peer, n):
    """Seconds of one all-to-all inside every run of ``size = len(per_peer)`` consecutive devices among
    ``n``; each member sends ``per_peer[a]`` bytes to member ``a``. A device's sends to its own link group
    run at ``B``, those to other groups at the inter bandwidth, both at once; the slowest device sets it."""
    per_peer = np.asarray(per_peer, np.float64)
    size = len(per_peer)
    if size == 1:
        return 0.0
    p = np.arange(n)
    own = per_peer[p % size]  # what each device keeps (sends nobody)
    key = (p // size) * n + _link_groups(hw, p)  # (its all-to-all group, its link group)
    _, idx = np.unique(key, return_inverse=True)
    near = np.bincount(idx, weights=own)[idx] - own  # to the others of its link group
    far = per_peer.sum() - own - near
    t = near / hw.bandwidth_bytes_per_s
    if hw.two_tier:
        t = np.maximum(t, far / hw.inter_bandwidth_bytes_per_s)
    return float(t.max())


def _check_shape(*, seq, heads, kv_heads, dim, devices, batch, block):
    for name, x in (("seq", seq), ("heads", heads), ("kv_heads", kv_heads), ("dim", dim),
                    ("devices", devices), ("batch", batch), ("block", block)):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be a positive int; got {x!r}")
    if seq % devices:
        raise ValueError(f"seq ({seq}) must be divisible by devices ({devices}): each holds seq / devices tokens")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if (seq // devices) % block:
        raise ValueError(f"block ({block}) must divide the shard seq / devices = {seq // devices}")


def _peaks_and_bytes(*, seq, heads, kv_heads, dim, devices, batch, block):
    """Per strategy ``(peak elements, elements sent)`` of the worst host, as the simulations count;
    for Ulysses also the per-receiver elements of its two all-to-alls (for two tiers of links)."""
    b, s, h, hk, d, n = batch, seq, heads, kv_heads, dim, devices
    c = s // n
    kv_shard = 2 * b * c * hk * d
    common = 2 * b * c * h * d + 2 * b * h * c + b * h * block * block  # q, o, m, l, one tile
    ring = (common + kv_shard * (2 if n > 1 else 1), (n - 1) * kv_shard)
    allgather = (common + 2 * b * s * hk * d, (n - 1) * kv_shard)
    if h % n:
        return {"ring": ring, "allgather": allgather, "ulysses": None}
    hq, hk_sent = h // n, hk * kv_repeat(hk, n)  # query heads per host; kv heads as sent (repeated)
    received = b * s * (hq + 2 * hk_sent // n) * d  # q on j's heads, k, v on its kv heads, all S tokens
    peak = received + b * s * hq * d + 2 * b * hq * s + b * hq * block * block  # attend: + o, m, l, a tile
    if n > 1:  # the all-to-alls: inputs + received; o on its heads + the received output shard
        peak = max(peak, b * c * (h + 2 * hk) * d + received, b * s * hq * d + b * c * h * d)
    to_each = (np.full(n, b * c * (hq + 2 * hk_sent // n) * d), np.full(n, b * c * hq * d))  # steps 0 and 2
    sent = (n - 1) * (to_each[0][0] + to_each[1][0])  # to every other host, every host alike
    return {"ring": ring, "allgather": allgather, "ulysses": (peak, sent, to_each)}


def _hybrid_elements(*, seq, heads, kv_heads, dim, ulysses_size, ring_size, batch, block):
    """``(peak elements, (all-to-all qkv, ring, all-to-all o) elements sent)`` of every host of the
    hybrid (all alike), as ``hybrid.hybrid_attention`` counts them."""
    b, h, d, u, r = batch, heads, dim, ulysses_size, ring_size
    c, tokens = seq // (u * r), seq // r  # tokens per host before / after the all-to-all
    hq, hk_sent = h // u, kv_heads * kv_repeat(kv_heads, u)  # query heads per host, kv heads as sent
    q_u, kv_u = b * tokens * hq * d, 2 * b * tokens * (hk_sent // u) * d  # q and K/V after the all-to-all
    peak = q_u + kv_u * (2 if r > 1 else 1) + q_u + 2 * b * hq * tokens + b * hq * block * block  # the ring
    if u > 1:
        peak = max(peak, b * c * (h + 2 * kv_heads) * d + q_u + kv_u,  # inputs + received
                   q_u + b * c * h * d)  # o on its heads + the received output shard
    to_each = b * c * (hq + 2 * hk_sent // u) * d  # step 0, to each other member of the group
    return peak, ((u - 1) * to_each, (r - 1) * kv_u, (u - 1) * b * c * hq * d)


def hybrid_bytes_sent(*, seq, heads, kv_heads, dim, ulysses_size, ring_size, batch=1, dtype_bytes=2):
    """Bytes one host sends in one forward of the hybrid (``hybrid.hybrid_attention``), every host alike,
    by collective: ``{"all-to-all": ..., "collective-permute": ...}`` (the names of the HLO collectives
    ``ringattn_fast`` compiles them to): the two all-to-alls inside a Ulysses group, ``(U-1) c d (2 h/U
    + 2 hk'/U) e`` with ``hk' = hk * kv_repeat``, and the ring's ``R - 1`` sends of its group's K/V on its
    heads, ``(R-1) 2 (S/R) (hk'/U) d e``; q/k/v/o only (positions and segment ids left out). Their sum is
    ``strategy_costs(..., ulysses_size=U)["hybrid"].bytes_sent``.

    To compare with a compiled program (``benchmarks.strategies.collective_bytes``): the all-to-alls run
    over the Ulysses axis (pass ``n = ulysses_size`` for them), the permutes over the ring axis, in a loop
    of ``R - 1`` trips. Example: 8 heads, 8 kv heads, ``d = 64``, 2048 tokens on ``4 x 2``, float32:
    ``c = 256`` tokens, 2 heads per host after the all-to-all; all-to-all ``3 * 256 * 64 * (2 + 2 * 2) * 4``
    (q, k, v) ``+ 3 * 256 * 64 * 2 * 4`` (o) ``= 1572864``; permute ``1 * 2 * 1024 * 2 * 64 * 4 = 1048576``.
    """
    _check_shape(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=1, batch=batch, block=1)
    u, r = check_split(heads, ulysses_size, ring_size)
    _check_shape(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=u * r, batch=batch, block=1)
    e = _number("dtype_bytes", dtype_bytes)
    _, (to_all, ring, back) = _hybrid_elements(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, ulysses_size=u,
                                               ring_size=r, batch=batch, block=1)
    return {"all-to-all": int((to_all + back) * e), "collective-permute": int(ring * e)}


def _hybrid_cost(hw, split, *, seq, heads, kv_heads, dim, batch, block, e, compute, memory_limit_bytes):
    """The hybrid's :class:`StrategyCost` for one split ``(U, R)``: all-to-all, ``R`` ring steps (the
    transfer of the next under the compute of this one, as the ring), all-to-all."""
    u, r = split
    n, b, c, d = u * r, batch, seq // (u * r), dim
    peak, (to_all, ring, back) = _hybrid_elements(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, ulysses_size=u,
                                                  ring_size=r, batch=batch, block=block)
    hq, hk_sent = heads // u, kv_heads * kv_repeat(kv_heads, u)
    a2a = (_all_to_all_seconds(hw, np.full(u, e * b * c * (hq + 2 * hk_sent // u) * d), n)
           + _all_to_all_seconds(hw, np.full(u, e * b * c * hq * d), n))
    step_c = compute / r
    step_x = ring * e / _ring_bandwidth(hw, n, stride=u) / (r - 1) if r > 1 else 0.0  # as the ring computes it
    time = a2a + (r - 1) * max(step_c, step_x) + step_c
    hidden = a2a == 0 and step_c >= step_x
    peak, sent = int(peak * e), int((to_all + ring + back) * e)
    why_not = None
    if memory_limit_bytes is not None and peak > memory_limit_bytes:
        why_not = f"needs {peak / 2**30:.2f} GiB per device, over the limit of {memory_limit_bytes / 2**30:.2f} GiB"
    return StrategyCost("hybrid", why_not is None, why_not, peak, sent, (2 if u > 1 else 0) + r - 1, compute,
                        a2a + (r - 1) * step_x, 0.0 if hidden else max(time - compute, 0.0), time, hidden, u, r)


def strategy_costs(*, seq, heads, kv_heads, dim, devices, hardware, batch=1, dtype_bytes=2, block=None,
                   memory_limit_bytes=None, hybrid=None, ulysses_size=None, ring_size=None):
    """Every strategy's :class:`StrategyCost` for one attention forward: ``{name: cost}``.

    seq, heads, kv_heads, dim, devices, batch: the model's shape and the sequence-parallel degree;
    hardware: a :class:`ringattn_ref.cost.Hardware` (one or two tiers of links) or a key of ``HARDWARE``;
    dtype_bytes: 2 for bf16; block: the score tile side (default: the largest divisor of
    ``seq / devices`` <= 128); memory_limit_bytes: a strategy whose peak exceeds it is not feasible.
    hybrid: whether ``"hybrid"`` is priced too: None (default) when the hardware has two tiers or
    ``ulysses_size`` is given, so one-tier results are those of the three strategies alone; True / False.
    Its cost is that of the fastest feasible split ``U x R`` of :func:`hybrid.hybrid_splits` (``U``
    divides ``devices`` and ``heads``), or of ``ulysses_size x devices / ulysses_size`` if given (a
    ValueError if it exceeds or does not divide ``heads``, or does not divide ``devices``; ``ring_size``,
    optional, must then be ``devices / ulysses_size``).
    """
    hw = _checked_hardware(hardware)
    _check_shape(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices, batch=batch,
                 block=1 if block is None else block)
    block = default_block(seq // devices) if block is None else block  # the simulations' default
    e, n = _number("dtype_bytes", dtype_bytes), devices
    if memory_limit_bytes is not None:
        _number("memory_limit_bytes", memory_limit_bytes)
    if hybrid not in (None, True, False):
        raise ValueError(f"hybrid must be None, True or False; got {hybrid!r}")
    if ulysses_size is None and ring_size is not None:
        raise ValueError(f"ring_size ({ring_size!r}) needs ulysses_size: the hybrid's split is "
                         f"ulysses_size x ring_size")
    if hybrid is False and ulysses_size is not None:
        raise ValueError(f"ulysses_size ({ulysses_size!r}) is the hybrid's split, but hybrid=False")
    splits = hybrid_splits(heads, devices) if ulysses_size is None else [check_split(heads, ulysses_size, ring_size,
                                                                                     devices=devices)]
    compute = 4.0 * batch * heads * seq * seq * dim / n / hw.flops_per_s  # the same for all
    ring_bw = _ring_bandwidth(hw, n)  # the ring and the all-gather's ring: B, or the inter bandwidth
    costs = {}
    for name, pb in _peaks_and_bytes(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices,
                                     batch=batch, block=block).items():
        if pb is None:
            costs[name] = StrategyCost(name, False, f"needs heads divisible by devices; got {heads} heads on "
                                       f"{devices} devices", 0, 0, 2, compute, np.inf, np.inf, np.inf, False)
            continue
        peak, sent = int(pb[0] * e), int(pb[1] * e)
        if name != "ulysses":
            comm = sent / ring_bw
        else:  # each all-to-all at the pace of its slowest device (on one tier: (N-1) parts at B)
            comm = sum(_all_to_all_seconds(hw, to_each * e, n) for to_each in pb[2])  # as the hybrid's
        if name == "ring":  # N steps: step compute against the transfer of the next block
            step_c, step_x = compute / n, (comm / (n - 1) if n > 1 else 0.0)
            time, steps, hidden = (n - 1) * max(step_c, step_x) + step_c, n - 1, step_c >= step_x
        else:  # the collectives come before (and, for Ulysses, after) the attention
            time, steps, hidden = compute + comm, (n - 1 if name == "allgather" else 2 if n > 1 else 0), n == 1
        why_not = None
        if memory_limit_bytes is not None and peak > memory_limit_bytes:
            why_not = (f"needs {peak / 2**30:.2f} GiB per device, over the limit of "
                       f"{memory_limit_bytes / 2**30:.2f} GiB")
        costs[name] = StrategyCost(name, why_not is None, why_not, peak, sent, steps, compute, comm,
                                   max(time - compute, 0.0), time, hidden)
    if hybrid or (hybrid is None and (hw.two_tier or ulysses_size is not None)):
        options = [_hybrid_cost(hw, split, seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, batch=batch,
                                block=block, e=e, compute=compute, memory_limit_bytes=memory_limit_bytes)
                   for split in splits]
        fits = [cost for cost in options if cost.feasible]
        costs["hybrid"] = (min(fits, key=lambda cost: cost.time_s) if fits else
                           min(options, key=lambda cost: cost.peak_bytes))  # the first of equals: the smaller U
    return costs


def _ms(seconds):
    return f"{seconds * 1e3:,.1f} ms"


def _describe(cost, c, kv_heads, heads, hw, dtype_bytes, ring_bw):
    """One line on one strategy: its modelled time and what decides it."""
    if not cost.feasible:
        return f"{cost.strategy}: not possible, {cost.why_not}"
    line = f"{cost.strategy}: {_ms(cost.time_s)} ({_ms(cost.compute_s)} compute"
    memory = f"{cost.peak_bytes / 2**20:,.0f} MiB per device"
    if cost.strategy == "ring":
        need = kv_heads / heads * dtype_bytes / 2 * hw.flops_per_s / ring_bw
        state = "hides its transfers" if cost.overlapped else "cannot hide its transfers"
        return (line + f", {_ms(cost.exposed_comm_s)} exposed), {memory}: {state}, "
                f"c = {c} vs (hk/h)(e/2)F/B = {need:.0f}")
    if cost.strategy == "hybrid":
        same = " = the ring" if cost.ulysses_size == 1 else " = Ulysses" if cost.ring_size == 1 else ""
        return (f"hybrid {cost.ulysses_size} x {cost.ring_size} (Ulysses over {cost.ulysses_size}, the ring "
                f"over {cost.ring_size} groups{same}): {_ms(cost.time_s)} ({_ms(cost.compute_s)} compute, "
                f"{_ms(cost.exposed_comm_s)} exposed of {_ms(cost.comm_s)} communication), {memory}")
    collective = "all-gather" if cost.strategy == "allgather" else "2 all-to-alls"
    return line + f" + {_ms(cost.comm_s)} of {collective}), {memory}"


def choose_strategy(*, seq, heads, kv_heads=None, dim, devices, hardware, batch=1, dtype_bytes=2,
                    memory_limit_bytes=None, tolerance=0.05, block=None, hybrid=None, ulysses_size=None,
                    ring_size=None):
    """Which sequence parallelism to use for this shape on this hardware, and why.

    Arguments as in :func:`strategy_costs` (``kv_heads`` defaults to ``heads``; ``hybrid`` None prices
    the hybrid on two-tier hardware). Among the feasible
    strategies, those within ``tolerance`` (5%; a finite number >= 0, 0 = only the fastest) of the
    fastest modelled forward are equally good, and the simplest of them wins (:data:`SIMPLICITY`:
    the all-gather -- one collective, any attention kernel and mask, Llama 3's choice --, then
    Ulysses, then the ring, then the hybrid: two levels of collectives). Returns a
    :class:`StrategyChoice` (with the split when the hybrid wins); ``str(choice)`` is the reason, one
    line per strategy. Rates (the hardware's FLOP/s and bytes/s), ``dtype_bytes`` and
    ``memory_limit_bytes`` must be positive finite numbers, not bools: a ValueError names the one
    that is not.

    Example: 128 heads, 8 kv heads, d = 128, 128K tokens on 8 A100s: over NVLink the three are
    within 1% and the all-gather wins; over InfiniBand the ring, the only one that hides its
    transfers (the all-gather's exposed 38 ms are 8% of the step). Two tiers: 8 devices in nodes of 4
    (NVLink inside, 12.5 GB/s InfiniBand across), 4 heads, 64K tokens: Ulysses cannot split 4 heads 8
    ways, the ring's every step waits for InfiniBand; the hybrid 4 x 2 keeps its all-to-alls on NVLink
    and computes half the attention per ring step, enough to hide the transfer: 3.6 ms against 9.8.
    """
    hw = _checked_hardware(hardware)
    tolerance = _number("tolerance", tolerance, zero_ok=True)
    kv_heads = heads if kv_heads is None else kv_heads
    costs = strategy_costs(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices, hardware=hw,
                           batch=batch, dtype_bytes=dtype_bytes, block=block,
                           memory_limit_bytes=memory_limit_bytes, hybrid=hybrid, ulysses_size=ulysses_size,
                           ring_size=ring_size)
    feasible = [cost for cost in costs.values() if cost.feasible]
    if not feasible:
        raise ValueError("no strategy fits: " + "; ".join(f"{n}: {c.why_not}" for n, c in costs.items()))
    best = min(cost.time_s for cost in feasible)
    good = [cost.strategy for cost in feasible if cost.time_s <= (1 + tolerance) * best]
    choice = next(name for name in SIMPLICITY if name in good)
    fastest = min(feasible, key=lambda cost: cost.time_s).strategy
    why = (f"the fastest modelled forward" if choice == fastest else
           f"within {tolerance:.0%} of the fastest ({fastest}) and simpler")
    chosen = costs[choice]
    label = choice if choice != "hybrid" else f"hybrid {chosen.ulysses_size} x {chosen.ring_size}"
    links = "" if not hw.two_tier else (f" (groups of {hw.group_size}, "
                                        f"{hw.inter_bandwidth_bytes_per_s / 1e9:g} GB/s across)")
    head = (f"{label}: {why}, on {hw.name}{links}, {devices} devices, seq {seq} ({seq // devices} per device), "
            f"{heads} heads / {kv_heads} kv heads of {dim}")
    lines = [_describe(costs[name], seq // devices, kv_heads, heads, hw, dtype_bytes, _ring_bandwidth(hw, devices))
             for name in STRATEGIES if name in costs]
    return StrategyChoice(choice, "\n".join([head] + ["  " + line for line in lines]), costs,
                          chosen.ulysses_size, chosen.ring_size)
