"""Inference on N virtual hosts: ring prefill into a sequence-sharded KV cache, then decode.

The KV cache holds up to ``max_seq`` tokens per batch row, split over ``N = n_hosts`` hosts, and
``cache.lengths[b]`` says how many tokens row ``b`` holds (the authors' ``cache_idx``).

**Position -> host: round-robin** (the striped layout of ``layouts.py``). Position ``p`` lives on
host ``p % N`` in slot ``p // N``: with 4 hosts, host 1 holds positions [1, 5, 9, ...]. Contiguous
blocks would put a row's first ``max_seq / N`` tokens all on host 0: a short prompt would leave the
other hosts empty and every decode step would write, and mostly attend, on one host. Round-robin
keeps every host within one token of the others at any length, so decode work and memory stay
balanced, and a prompt written into an empty cache is exactly the striped ring (which also balances
the causal work of prefill, Brandon et al. 2023).

Two schedules (``docs/design.md``):

- :func:`prefill` (a prompt of ``m`` tokens per row) is the ring (arXiv:2310.01889, Algorithm 1):
  host ``r`` keeps prompt queries ``r, r + N, ...`` and the cache shards travel around the ring,
  ``N - 1`` sends of a whole shard. On a non-empty cache this is chunked prefill.
- :func:`decode_step` (one token per row) attends each host's own shard locally and merges the N
  partial ``(o, lse)`` with ``softmax.merge`` as a reduction tree: ``ceil(log2 N)`` steps, each message
  one ``o`` row and one ``lse`` per head. Rotating the cache instead (``schedule="ring"``) would move
  ``S / N`` keys per hop for ``4 d S / N`` FLOPs: notebook 06's overlap condition cannot hold.

Both take the programmable-attention keywords of :func:`ringattn_ref.attention.attention`
(``docs/design.md``, "Programmable attention"): ``logit_softcap``, ``score_fn`` and ``mask_fn`` act on
each pair's logit as in the oracle, the user functions seeing *true* positions (a decode step's query
sits at position ``lengths[b]``, the row's length so far; a slot's key at its own position) and
segment ids 0; ``sinks`` join the denominator once the hosts' partials are merged; and the cache may
hold values of a width of their own (``init_cache(value_dim=)``, MLA), o then being as wide as v.

Every function returns a *new* cache; the one passed in is never modified, so a ``ValueError``
always leaves it exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention import call_mask_fn, call_score_fn, repeat_kv
from .blockwise import scaled_logits
from .masks import allowed, mark_bad_keys
from .ring import Host, Message, send_to_next, swap_buffers
from .shards import HopConfig, KVShard, QShard
from .softmax import finalize, init_state, merge, online_update
from .validation import check_qkv, check_scale, check_sinks, check_softcap, check_window, is_float_dtype

VALID, PADDING_QUERY, EMPTY_SLOT = 0, -1, -2  # segment ids: only VALID queries and keys meet


@dataclass(frozen=True)
class KVCache:
    """K/V of up to ``max_seq`` tokens per row over ``n_hosts`` hosts, round-robin.

    k: [n_hosts, batch, slots, kv_heads, dim], v: [n_hosts, batch, slots, kv_heads, value_dim] with
    ``slots = max_seq / n_hosts``: host ``r``'s slot ``i`` holds position ``i * n_hosts + r``.
    lengths: int [batch], tokens held per row.
    """
    k: np.ndarray
    v: np.ndarray
    lengths: np.ndarray

    n_hosts = property(lambda self: self.k.shape[0])
    batch = property(lambda self: self.k.shape[1])
    slots = property(lambda self: self.k.shape[2])
    kv_heads = property(lambda self: self.k.shape[3])
    dim = property(lambda self: self.k.shape[4])
    value_dim = property(lambda self: self.v.shape[4])
    max_seq = property(lambda self: self.slots * self.n_hosts)

    def positions(self, host):
        """True positions held by ``host``'s slots, int [slots]: ``slot * n_hosts + host``."""
        return np.arange(self.slots) * self.n_hosts + host

    def key_segments(self, host):
        """int [batch, slots]: VALID where the slot holds a token (position < lengths), else EMPTY_SLOT."""
        return np.where(self.positions(host)[None] < self.lengths[:, None], VALID, EMPTY_SLOT)


@dataclass(frozen=True)
class Send:
    """One message of a schedule: at ``step``, host ``src`` sends ``nbytes`` to host ``dst``."""
    step: int
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class InferenceTrace:
    """What moved between hosts in one call: ``schedule`` ("ring" or "tree") and its sends."""
    schedule: str
    n_hosts: int
    sends: tuple

    @property
    def n_steps(self):
        """Communication steps on the critical path (hosts send in parallel within a step)."""
        return len({s.step for s in self.sends})

    @property
    def total_bytes(self):
        return sum(s.nbytes for s in self.sends)


def _positive_int(x, name):
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{name} must be a positive int; got {x!r}")
    return int(x)


def init_cache(batch, max_seq, kv_heads, dim, *, n_hosts, dtype=np.float64, value_dim=None):
    """An empty cache: zeros, ``lengths = 0``. ``max_seq`` must be divisible by ``n_hosts``; values
    ``value_dim`` wide (default ``dim``; MLA's ``d_v != d``)."""
    value_dim = dim if value_dim is None else value_dim
    batch, max_seq, kv_heads, dim, value_dim, n_hosts = (_positive_int(x, name) for x, name in (
        (batch, "batch"), (max_seq, "max_seq"), (kv_heads, "kv_heads"), (dim, "dim"), (value_dim, "value_dim"),
        (n_hosts, "n_hosts")))
    if max_seq % n_hosts:
        raise ValueError(f"max_seq ({max_seq}) must be divisible by n_hosts ({n_hosts}): position p lives "
                         f"on host p % n_hosts, every host has max_seq / n_hosts slots")
    try:  # every spelling numpy understands: np.float32, "float32", np.dtype(...)
        cache_dtype = np.dtype(dtype)
    except TypeError:
        cache_dtype = None
    if cache_dtype is None or not is_float_dtype(cache_dtype):
        raise ValueError(f"dtype must be a floating-point dtype (the cache holds K and V); got {dtype!r}")
    shape = (n_hosts, batch, max_seq // n_hosts, kv_heads)
    dtype = cache_dtype
    return KVCache(np.zeros(shape + (dim,), dtype), np.zeros(shape + (value_dim,), dtype), np.zeros(batch, np.int64))


def check_against_cache(q, k, v, cache):
    """Prompt/token arrays against the cache: ``(batch, m, heads)`` or a ValueError naming the argument."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache from init_cache; got {type(cache).__name__}")
    b, m, h, hk, d = check_qkv(q, k, v, value_width=True)
    if b != cache.batch:
        raise ValueError(f"q, k, v must have the cache's batch {cache.batch}; got q {tuple(q.shape)}")
    if (hk, d) != (cache.kv_heads, cache.dim):
        raise ValueError(f"k/v must have the cache's kv_heads = {cache.kv_heads} and dim = {cache.dim}; "
                         f"got k {tuple(k.shape)}")
    if v.shape[3] != cache.value_dim:
        raise ValueError(f"v must have the cache's value_dim = {cache.value_dim} (init_cache(value_dim=)); got v "
                         f"{tuple(v.shape)}")
    return b, m, h


def check_lengths(lengths, batch, m, cache):
    """Per-row prompt lengths int [batch] in [0, m] that fit the room left in each row."""
    if lengths is None:
        lengths = np.full(batch, m)
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be an int array of shape [batch] = ({batch},); "
                         f"got shape {lengths.shape}, dtype {lengths.dtype}")
    if lengths.min() < 0 or lengths.max() > m:
        raise ValueError(f"lengths must lie in [0, m = {m}]; got {lengths.tolist()}")
    room = cache.max_seq - cache.lengths
    if (lengths > room).any():
        row = int(np.argmax(lengths > room))
        raise ValueError(f"q: the prompt of row {row} ({lengths[row]} tokens) does not fit the room left in "
                         f"its cache row ({cache.lengths[row]} of max_seq = {cache.max_seq} held, {room[row]} "
                         f"free)")
    return lengths.astype(np.int64)


def write(cache, k, v, counts):
    """A new cache with the first ``counts[b]`` tokens of k, v [b, m, hk, d] appended to each row."""
    ck, cv, n = cache.k.copy(), cache.v.copy(), cache.n_hosts
    for b in range(cache.batch):
        for j in range(counts[b]):
            p = cache.lengths[b] + j  # true position of token j
            ck[p % n, b, p // n], cv[p % n, b, p // n] = k[b, j], v[b, j]  # round-robin
    return KVCache(ck, cv, cache.lengths + counts)


def host_shard(cache, r):
    """Host ``r``'s cache shard as the :class:`KVShard` it attends: K/V marked (``masks.mark_bad_keys``),
    its slots' true positions [1, slots] and segment ids (VALID or EMPTY_SLOT) [batch, slots]."""
    return KVShard(*mark_bad_keys(cache.k[r], cache.v[r]), cache.positions(r)[None], cache.key_segments(r))


def shard_logits(qs, kv, cfg):
    """Masked logits of queries ``qs`` over one whole cache shard ``kv``: [b, h, sq, slots], in the
    oracle's order (``attention.attention``): ``scale q k^T``, ``cfg.logit_softcap``, ``cfg.score_fn``,
    then the mask: causal and ``cfg.window`` over true positions, the cache's segment ids (only VALID
    queries and keys meet) and ``cfg.mask_fn``. The user functions (``variants.py``) see true positions
    and segment ids 0: the cache's ids are its bookkeeping, not the caller's segments.
    """
    b, _, h, _ = qs.q.shape
    s = scaled_logits(qs, kv, cfg)  # (b, h, sq, slots)
    if cfg.logit_softcap is not None:  # Gemma 2, before the score function and the mask
        s = cfg.logit_softcap * np.tanh(s / cfg.logit_softcap)
    if cfg.score_fn is not None:
        s = call_score_fn(cfg.score_fn, s, qs.pos, kv.pos, h)
    mask = allowed(qs.pos[:, :, None], kv.pos[:, None, :], qs.seg[:, :, None], kv.seg[:, None, :], causal=True,
                   window=cfg.window)[:, None]  # (b, 1, sq, slots)
    if cfg.mask_fn is not None:
        mask = mask & call_mask_fn(cfg.mask_fn, qs.pos, kv.pos, None, None, b, h)
    return np.where(mask, s, -np.inf)


def attend(state, qs, kv, cfg):
    """Fold ``qs``'s attention over one cache shard into ``state = (m, l, o)`` (one tile: the whole shard)."""
    return online_update(*state, shard_logits(qs, kv, cfg), repeat_kv(kv.v, qs.q.shape[2]))


def ring(q, q_pos, q_seg, cache, cfg):
    """The prefill ring: host r keeps queries ``r, r + N, ...``; cache shards travel to host r + 1.

    q: [b, m, h, d]; q_pos, q_seg: int [b, m]; cfg: a :class:`HopConfig` (scale, window and the
    programmable-attention fields). Returns ``(o [b, m, h, d_v], lse [b, h, m])`` and the trace.
    """
    n, (b, m, h, _), dv = cache.n_hosts, q.shape, cache.value_dim
    mine = [np.arange(r, m, n) for r in range(n)]  # prompt indices each host keeps (striped)
    hosts = [Host(my_idx=r, qs=QShard(q[:, mine[r]], q_pos[:, mine[r]], q_seg[:, mine[r]]),
                  held=Message(r, host_shard(cache, r))) for r in range(n)]
    sends = []
    for host in hosts:
        host.m, host.l, host.o = init_state(b, h, len(mine[host.my_idx]), dv)
    for step in range(n):
        if step < n - 1:
            send_to_next(hosts)
            sends += [Send(step, r, (r + 1) % n, hosts[r].held.payload_elements() * cache.k.itemsize)
                      for r in range(n)]
        for host in hosts:
            assert host.held.kv_idx == (host.my_idx - step) % n  # the authors' index arithmetic
            host.m, host.l, host.o = attend((host.m, host.l, host.o), host.qs, host.held.kv, cfg)
        if step < n - 1:
            swap_buffers(hosts)
    o, lse = np.zeros((b, m, h, dv)), np.full((b, h, m), -np.inf)
    for host in hosts:
        o[:, mine[host.my_idx]], lse[:, :, mine[host.my_idx]] = finalize(host.m, host.l, host.o)
    return (o, lse), InferenceTrace("ring", n, tuple(sends))


def tree_merge(parts, itemsize):
    """Reduce the hosts' partial ``(o, lse)`` onto host 0 with ``merge``: ``ceil(log2 N)`` steps.

    At step t (stride ``2**t``) host ``r + stride`` sends its partial to host ``r`` for every ``r``
    that is a multiple of ``2 * stride``: with 8 hosts, 4 then 2 then 1 message. ``merge`` is
    associative, so the tree gives the ring's result (up to rounding).
    """
    parts, n, sends, step, stride = list(parts), len(parts), [], 0, 1
    while stride < n:
        for r in range(0, n - stride, 2 * stride):
            o, lse = parts[r + stride]
            sends.append(Send(step, r + stride, r, (o.size + lse.size) * itemsize))
            parts[r] = merge(*parts[r], o, lse)
        stride, step = 2 * stride, step + 1
    return parts[0], InferenceTrace("tree", n, tuple(sends))


def check_variants(heads, *, scale, dim, window, logit_softcap, sinks, mask_fn, score_fn):
    """The settings of one call as a :class:`HopConfig` (causal) and the sinks (float64 [heads] or None),
    or a ValueError naming the argument. The user functions are checked where they are called
    (``attention.call_mask_fn`` / ``call_score_fn``), before any cache is returned."""
    for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function; got {fn!r}")
    sinks = None if check_sinks(sinks, heads) is None else np.asarray(sinks, np.float64)
    cfg = HopConfig(scale=check_scale(scale, dim), causal=True, window=check_window(window),
                    logit_softcap=check_softcap(logit_softcap), mask_fn=mask_fn, score_fn=score_fn)
    return cfg, sinks


def with_sinks(o, lse, sinks):
    """Sinks join the denominator of the merged result: ``merge`` with a part of value 0 and lse the sink."""
    if sinks is None:
        return o
    return merge(o, lse, np.zeros_like(o), np.broadcast_to(sinks[None, :, None], lse.shape))[0]


def prefill(q, k, v, cache, *, lengths=None, window=None, scale=None, logit_softcap=None, sinks=None,
            mask_fn=None, score_fn=None, return_trace=False):
    """Write a prompt into the cache and attend to it, causally over the cache and itself.

    q: [batch, m, heads, dim]; k: [batch, m, kv_heads, dim]; v: [batch, m, kv_heads, value_dim] (GQA:
    heads % kv_heads == 0); token ``j`` of row ``b`` goes to position ``cache.lengths[b] + j``.
    lengths: int [batch] in [0, m] (default m): prompt tokens past it are padding, neither cached nor
    attended (output 0). window: ``(left, right)`` over true positions (``right`` is irrelevant:
    causal). logit_softcap, sinks [heads], mask_fn, score_fn: as :func:`ringattn_ref.attention.attention`
    (module docstring). Returns ``(o [batch, m, heads, value_dim] float64, new cache)`` and the ring's
    :class:`InferenceTrace` if ``return_trace``.
    """
    b, m, h = check_against_cache(q, k, v, cache)
    counts = check_lengths(lengths, b, m, cache)
    cfg, sinks = check_variants(h, scale=scale, dim=q.shape[-1], window=window, logit_softcap=logit_softcap,
                                sinks=sinks, mask_fn=mask_fn, score_fn=score_fn)
    new = write(cache, np.asarray(k, np.float64), np.asarray(v, np.float64), counts)
    j = np.arange(m)[None]  # (1, m)
    q_pos = cache.lengths[:, None] + j  # (b, m) true positions
    q_seg = np.where(j < counts[:, None], VALID, PADDING_QUERY)  # padding queries see nothing
    (o, lse), trace = ring(np.asarray(q, np.float64), q_pos, q_seg, new, cfg)
    o = with_sinks(o, lse, sinks)
    return (o, new, trace) if return_trace else (o, new)


def decode_step(q, k, v, cache, *, window=None, scale=None, logit_softcap=None, sinks=None, mask_fn=None,
                score_fn=None, schedule="tree", return_trace=False):
    """Append one token per row and attend it to everything cached (its own K/V included).

    q: [batch, 1, heads, dim]; k: [batch, 1, kv_heads, dim]; v: [batch, 1, kv_heads, value_dim].
    ``schedule="tree"``: every host attends its own shard and the partials meet in :func:`tree_merge`;
    ``"ring"``: the prefill ring with a one-token prompt (for comparison: same result, N - 1 shard
    sends). The keywords are :func:`prefill`'s; the query's true position is the row's length so far.
    Returns ``(o [batch, 1, heads, value_dim], new cache)`` (+ the trace if ``return_trace``).
    """
    b, m, h = check_against_cache(q, k, v, cache)
    if m != 1:
        raise ValueError(f"q must hold exactly one token per row (m = 1) in decode_step; got shape "
                         f"{tuple(q.shape)}: use prefill for a prompt")
    if (cache.lengths >= cache.max_seq).any():
        row = int(np.argmax(cache.lengths >= cache.max_seq))
        raise ValueError(f"cache: row {row} is full ({cache.max_seq} of max_seq = {cache.max_seq} tokens); "
                         f"no room for a decode step")
    if schedule not in ("tree", "ring"):
        raise ValueError(f"schedule must be 'tree' or 'ring'; got {schedule!r}")
    variants = dict(window=window, scale=scale, logit_softcap=logit_softcap, sinks=sinks, mask_fn=mask_fn,
                    score_fn=score_fn)
    if schedule == "ring":
        return prefill(q, k, v, cache, return_trace=return_trace, **variants)
    cfg, sinks = check_variants(h, dim=q.shape[-1], **variants)
    new = write(cache, np.asarray(k, np.float64), np.asarray(v, np.float64), np.ones(b, np.int64))
    qs = QShard(np.asarray(q, np.float64), cache.lengths[:, None], np.full((b, 1), VALID))  # the new token's position
    parts = [finalize(*attend(init_state(b, h, 1, new.value_dim), qs, host_shard(new, r), cfg))
             for r in range(new.n_hosts)]
    (o, lse), trace = tree_merge(parts, new.k.itemsize)
    o = with_sinks(o, lse, sinks)
    return (o, new, trace) if return_trace else (o, new)
