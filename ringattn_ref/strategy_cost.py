"""Cost model of the three ways to split attention over the sequence, and which one to choose.

Per host, one attention forward of ``S`` tokens on ``N`` devices (``c = S / N`` tokens each),
``h`` query heads, ``hk`` kv heads of width ``d``, ``e`` bytes per element; ``F`` FLOP/s and ``B``
bytes/s per host (a row of Table 2, :data:`ringattn_ref.cost.HARDWARE`)::

                 bytes sent per host             steps   peak memory grows with   comm hidden?
    ring         (N-1) 2 c hk d e                N - 1   c                         when c >= (hk/h)(e/2) F/B
    all-gather   (N-1) 2 c hk d e                N - 1   S  (all K/V)              no: before the attention
    Ulysses      (N-1) c d (2 h/N + 2 hk/N) e    2       c  (S h/N = c h)          no: before and after

All three compute the same ``4 b h S^2 d / N`` FLOPs per host (non-causal; a causal mask halves all
three alike with a balanced layout). The ring's transfer runs under its compute (paper §3,
``cost.min_block_size``); the all-gather and Ulysses wait for their collectives (we assume no
overlap with other layers, and an all-to-all at the host's full bandwidth ``B``, as on a switch --
NVSwitch, InfiniBand; on a torus it is slower). Ulysses needs ``h % N == 0``; with
``hk < N`` one kv head goes to several hosts (``strategies.ulysses_heads``).

The memory and bytes columns are exactly what ``ringattn_ref.ring`` and ``ringattn_ref.strategies``
count on their simulated hosts (tests check it), with a ``block x block`` score tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blockwise import default_block
from .cost import as_hardware
from .strategies import local_kv_index, ulysses_heads

STRATEGIES = ("ring", "allgather", "ulysses")
SIMPLICITY = ("allgather", "ulysses", "ring")  # one collective + any kernel first; the ring last


@dataclass(frozen=True)
class StrategyCost:
    """Modelled cost of one strategy, per host, one forward pass (bytes, seconds).

    feasible / why_not: whether it applies (Ulysses needs heads % devices == 0; a memory limit);
    steps: communication rounds; exposed_comm_s: communication not hidden behind compute;
    overlapped: all of it hidden (only the ring can: ``c >= (hk/h)(e/2) F/B``).
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


@dataclass(frozen=True)
class StrategyChoice:
    """``choose_strategy``'s answer: ``strategy`` (a name of :data:`STRATEGIES`), a human-readable
    ``reason``, and every strategy's :class:`StrategyCost` in ``costs``."""
    strategy: str
    reason: str
    costs: dict

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
    """``hardware`` as a ``Hardware`` whose FLOP rate and bandwidth are positive finite numbers."""
    hw = as_hardware(hardware)
    _number(f"hardware.flops_per_s (of {hw.name!r})", hw.flops_per_s)
    _number(f"hardware.bandwidth_bytes_per_s (of {hw.name!r})", hw.bandwidth_bytes_per_s)
    return hw


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
    """Per strategy ``(peak elements, elements sent)`` of the worst host, as the simulations count."""
    b, s, h, hk, d, n = batch, seq, heads, kv_heads, dim, devices
    c = s // n
    kv_shard = 2 * b * c * hk * d
    common = 2 * b * c * h * d + 2 * b * h * c + b * h * block * block  # q, o, m, l, one tile
    ring = (common + kv_shard * (2 if n > 1 else 1), (n - 1) * kv_shard)
    allgather = (common + 2 * b * s * hk * d, (n - 1) * kv_shard)
    if h % n:
        return {"ring": ring, "allgather": allgather, "ulysses": None}
    hq = h // n
    kv = [ulysses_heads(h, hk, n, j)[1] for j in range(n)]
    kv = [g.stop - g.start for g in kv]  # kv heads host j receives
    peak = sent = 0
    for j in range(n):
        received = b * s * (hq + 2 * kv[j]) * d  # q on j's heads, k, v on their kv heads, all S tokens
        repeat = 0 if local_kv_index(h, hk, n, j) is None else 2 * b * s * hq * d  # a local repeat
        peak = max(peak, b * c * (h + 2 * hk) * d + received,  # step 0: inputs + received
                   received + repeat + b * s * hq * d + 2 * b * hq * s + b * hq * block * block,  # attend
                   b * s * hq * d + b * c * h * d)  # step 2: o on j's heads + the received shard
        sent = max(sent, b * c * ((n - 1) * hq + 2 * (sum(kv) - kv[j])) * d  # step 0: to every other host
                   + (n - 1) * b * c * hq * d)  # step 2: their tokens' output on j's heads
    return {"ring": ring, "allgather": allgather, "ulysses": (peak, sent)}


def strategy_costs(*, seq, heads, kv_heads, dim, devices, hardware, batch=1, dtype_bytes=2, block=None,
                   memory_limit_bytes=None):
    """Every strategy's :class:`StrategyCost` for one attention forward: ``{name: cost}``.

    seq, heads, kv_heads, dim, devices, batch: the model's shape and the sequence-parallel degree;
    hardware: a :class:`ringattn_ref.cost.Hardware` or a key of ``HARDWARE``; dtype_bytes: 2 for
    bf16; block: the score tile side (default: the largest divisor of ``seq / devices`` <= 128);
    memory_limit_bytes: a strategy whose peak exceeds it is not feasible.
    """
    hw = _checked_hardware(hardware)
    _check_shape(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices, batch=batch,
                 block=1 if block is None else block)
    block = default_block(seq // devices) if block is None else block  # the simulations' default
    e, n = _number("dtype_bytes", dtype_bytes), devices
    if memory_limit_bytes is not None:
        _number("memory_limit_bytes", memory_limit_bytes)
    compute = 4.0 * batch * heads * seq * seq * dim / n / hw.flops_per_s  # same for all three
    costs = {}
    for name, pb in _peaks_and_bytes(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices,
                                     batch=batch, block=block).items():
        if pb is None:
            costs[name] = StrategyCost(name, False, f"needs heads divisible by devices; got {heads} heads on "
                                       f"{devices} devices", 0, 0, 2, compute, np.inf, np.inf, np.inf, False)
            continue
        peak, sent = int(pb[0] * e), int(pb[1] * e)
        comm = sent / hw.bandwidth_bytes_per_s
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
    return costs


def _ms(seconds):
    return f"{seconds * 1e3:,.1f} ms"


def _describe(cost, c, kv_heads, heads, hw, dtype_bytes):
    """One line on one strategy: its modelled time and what decides it."""
    if not cost.feasible:
        return f"{cost.strategy}: not possible, {cost.why_not}"
    line = f"{cost.strategy}: {_ms(cost.time_s)} ({_ms(cost.compute_s)} compute"
    memory = f"{cost.peak_bytes / 2**20:,.0f} MiB per device"
    if cost.strategy == "ring":
        need = kv_heads / heads * dtype_bytes / 2 * hw.flops_per_s / hw.bandwidth_bytes_per_s
        state = "hides its transfers" if cost.overlapped else "cannot hide its transfers"
        return (line + f", {_ms(cost.exposed_comm_s)} exposed), {memory}: {state}, "
                f"c = {c} vs (hk/h)(e/2)F/B = {need:.0f}")
    collective = "all-gather" if cost.strategy == "allgather" else "2 all-to-alls"
    return line + f" + {_ms(cost.comm_s)} of {collective}), {memory}"


def choose_strategy(*, seq, heads, kv_heads=None, dim, devices, hardware, batch=1, dtype_bytes=2,
                    memory_limit_bytes=None, tolerance=0.05, block=None):
    """Which sequence parallelism to use for this shape on this hardware, and why.

    Arguments as in :func:`strategy_costs` (``kv_heads`` defaults to ``heads``). Among the feasible
    strategies, those within ``tolerance`` (5%; a finite number >= 0, 0 = only the fastest) of the
    fastest modelled forward are equally good, and the simplest of them wins (:data:`SIMPLICITY`:
    the all-gather -- one collective, any attention kernel and mask, Llama 3's choice --, then
    Ulysses, then the ring). Returns a :class:`StrategyChoice`; ``str(choice)`` is the reason, one
    line per strategy. Rates (the hardware's FLOP/s and bytes/s), ``dtype_bytes`` and
    ``memory_limit_bytes`` must be positive finite numbers, not bools: a ValueError names the one
    that is not.

    Example: 128 heads, 8 kv heads, d = 128, 128K tokens on 8 A100s: over NVLink the three are
    within 1% and the all-gather wins; over InfiniBand the ring, the only one that hides its
    transfers (the all-gather's exposed 38 ms are 8% of the step).
    """
    hw = _checked_hardware(hardware)
    tolerance = _number("tolerance", tolerance, zero_ok=True)
    kv_heads = heads if kv_heads is None else kv_heads
    costs = strategy_costs(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices, hardware=hw,
                           batch=batch, dtype_bytes=dtype_bytes, block=block,
                           memory_limit_bytes=memory_limit_bytes)
    feasible = [cost for cost in costs.values() if cost.feasible]
    if not feasible:
        raise ValueError("no strategy fits: " + "; ".join(f"{n}: {c.why_not}" for n, c in costs.items()))
    best = min(cost.time_s for cost in feasible)
    good = [cost.strategy for cost in feasible if cost.time_s <= (1 + tolerance) * best]
    choice = next(name for name in SIMPLICITY if name in good)
    fastest = min(feasible, key=lambda cost: cost.time_s).strategy
    why = (f"the fastest modelled forward" if choice == fastest else
           f"within {tolerance:.0%} of the fastest ({fastest}) and simpler")
    head = (f"{choice}: {why}, on {hw.name}, {devices} devices, seq {seq} ({seq // devices} per device), "
            f"{heads} heads / {kv_heads} kv heads of {dim}")
    lines = [_describe(costs[name], seq // devices, kv_heads, heads, hw, dtype_bytes) for name in STRATEGIES]
    return StrategyChoice(choice, "\n".join([head] + ["  " + line for line in lines]), costs)
