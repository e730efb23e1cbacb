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

Every function returns a *new* cache; the one passed in is never modified, so a ``ValueError``
always leaves it exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blockwise import attend_kv_shard, hop_attention
from .ring import Host, Message, send_to_next, swap_buffers
from .shards import HopConfig, KVShard, QShard
from .softmax import finalize, init_state, merge
from .validation import check_qkv, check_scale, check_window

VALID, PADDING_QUERY, EMPTY_SLOT = 0, -1, -2  # segment ids: only VALID queries and keys meet


@dataclass(frozen=True)
class KVCache:
    """K/V of up to ``max_seq`` tokens per row over ``n_hosts`` hosts, round-robin.

    k, v: [n_hosts, batch, slots, kv_heads, dim] with ``slots = max_seq / n_hosts``: host ``r``'s
    slot ``i`` holds position ``i * n_hosts + r``. lengths: int [batch], tokens held per row.
    """
    k: np.ndarray
    v: np.ndarray
    lengths: np.ndarray

    n_hosts = property(lambda self: self.k.shape[0])
    batch = property(lambda self: self.k.shape[1])
    slots = property(lambda self: self.k.shape[2])
    kv_heads = property(lambda self: self.k.shape[3])
    dim = property(lambda self: self.k.shape[4])
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


def init_cache(batch, max_seq, kv_heads, dim, *, n_hosts, dtype=np.float64):
    """An empty cache: zeros, ``lengths = 0``. ``max_seq`` must be divisible by ``n_hosts``."""
    batch, max_seq, kv_heads, dim, n_hosts = (_positive_int(x, name) for x, name in (
        (batch, "batch"), (max_seq, "max_seq"), (kv_heads, "kv_heads"), (dim, "dim"), (n_hosts, "n_hosts")))
    if max_seq % n_hosts:
        raise ValueError(f"max_seq ({max_seq}) must be divisible by n_hosts ({n_hosts}): position p lives "
                         f"on host p % n_hosts, every host has max_seq / n_hosts slots")
    shape = (n_hosts, batch, max_seq // n_hosts, kv_heads, dim)
    return KVCache(np.zeros(shape, dtype), np.zeros(shape, dtype), np.zeros(batch, np.int64))


def check_against_cache(q, k, v, cache):
    """Prompt/token arrays against the cache: ``(batch, m, heads)`` or a ValueError naming the argument."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache from init_cache; got {type(cache).__name__}")
    b, m, h, hk, d = check_qkv(q, k, v)
    if b != cache.batch:
        raise ValueError(f"q, k, v must have the cache's batch {cache.batch}; got q {tuple(q.shape)}")
    if (hk, d) != (cache.kv_heads, cache.dim):
        raise ValueError(f"k/v must have the cache's kv_heads = {cache.kv_heads} and dim = {cache.dim}; "
                         f"got k {tuple(k.shape)}")
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


def ring(q, q_pos, q_seg, cache, *, scale, window):
    """The prefill ring: host r keeps queries ``r, r + N, ...``; cache shards travel to host r + 1.

    q: [b, m, h, d]; q_pos, q_seg: int [b, m]. Returns o [b, m, h, d] and the trace.
    """
    n, (b, m, h, d) = cache.n_hosts, q.shape
    mine = [np.arange(r, m, n) for r in range(n)]  # prompt indices each host keeps (striped)
    hosts = [Host(my_idx=r, qs=QShard(q[:, mine[r]], q_pos[:, mine[r]], q_seg[:, mine[r]]),
                  held=Message(r, KVShard(cache.k[r], cache.v[r], cache.positions(r)[None], cache.key_segments(r))))
             for r in range(n)]
    sends = []
    for host in hosts:
        host.m, host.l, host.o = init_state(b, h, len(mine[host.my_idx]), d)
    for step in range(n):
        if step < n - 1:
            send_to_next(hosts)
            sends += [Send(step, r, (r + 1) % n, hosts[r].held.payload_elements() * cache.k.itemsize)
                      for r in range(n)]
        for host in hosts:
            assert host.held.kv_idx == (host.my_idx - step) % n  # the authors' index arithmetic
            hop = HopConfig(scale=scale, causal=True, window=window, block_q=max(host.qs.q.shape[1], 1),
                            block_kv=cache.slots)
            attend_kv_shard((host.m, host.l, host.o), host.qs, host.held.kv, hop)
        if step < n - 1:
            swap_buffers(hosts)
    o = np.zeros((b, m, h, d))
    for host in hosts:
        o[:, mine[host.my_idx]] = finalize(host.m, host.l, host.o)[0]
    return o, InferenceTrace("ring", n, tuple(sends))


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


def prefill(q, k, v, cache, *, lengths=None, window=None, scale=None, return_trace=False):
    """Write a prompt into the cache and attend to it, causally over the cache and itself.

    q: [batch, m, heads, dim]; k, v: [batch, m, kv_heads, dim] (GQA: heads % kv_heads == 0); token
    ``j`` of row ``b`` goes to position ``cache.lengths[b] + j``. lengths: int [batch] in [0, m]
    (default m): prompt tokens past it are padding, neither cached nor attended (output 0).
    window: ``(left, right)`` over true positions (``right`` is irrelevant: causal). Returns
    ``(o [batch, m, heads, dim] float64, new cache)`` and the ring's :class:`InferenceTrace` if
    ``return_trace``.
    """
    b, m, _ = check_against_cache(q, k, v, cache)
    counts = check_lengths(lengths, b, m, cache)
    scale, window = check_scale(scale, q.shape[-1]), check_window(window)
    new = write(cache, np.asarray(k, np.float64), np.asarray(v, np.float64), counts)
    j = np.arange(m)[None]  # (1, m)
    q_pos = cache.lengths[:, None] + j  # (b, m) true positions
    q_seg = np.where(j < counts[:, None], VALID, PADDING_QUERY)  # padding queries see nothing
    o, trace = ring(np.asarray(q, np.float64), q_pos, q_seg, new, scale=scale, window=window)
    return (o, new, trace) if return_trace else (o, new)


def decode_step(q, k, v, cache, *, window=None, scale=None, schedule="tree", return_trace=False):
    """Append one token per row and attend it to everything cached (its own K/V included).

    q: [batch, 1, heads, dim]; k, v: [batch, 1, kv_heads, dim]. ``schedule="tree"``: every host
    attends its own shard (``blockwise.hop_attention``) and the partials meet in :func:`tree_merge`;
    ``"ring"``: the prefill ring with a one-token prompt (for comparison: same result, N - 1 shard
    sends). Returns ``(o [batch, 1, heads, dim], new cache)`` (+ the trace if ``return_trace``).
    """
    b, m, _ = check_against_cache(q, k, v, cache)
    if m != 1:
        raise ValueError(f"q must hold exactly one token per row (m = 1) in decode_step; got shape "
                         f"{tuple(q.shape)}: use prefill for a prompt")
    if (cache.lengths >= cache.max_seq).any():
        row = int(np.argmax(cache.lengths >= cache.max_seq))
        raise ValueError(f"cache: row {row} is full ({cache.max_seq} of max_seq = {cache.max_seq} tokens); "
                         f"no room for a decode step")
    if schedule not in ("tree", "ring"):
        raise ValueError(f"schedule must be 'tree' or 'ring'; got {schedule!r}")
    if schedule == "ring":
        return prefill(q, k, v, cache, window=window, scale=scale, return_trace=return_trace)
    scale, window = check_scale(scale, q.shape[-1]), check_window(window)
    new = write(cache, np.asarray(k, np.float64), np.asarray(v, np.float64), np.ones(b, np.int64))
    q_pos, q_seg = cache.lengths[:, None], np.full((b, 1), VALID)  # (b, 1): the new token's position
    hop = HopConfig(scale=scale, causal=True, window=window)
    parts = [hop_attention(QShard(q, q_pos, q_seg), KVShard(new.k[r], new.v[r], new.positions(r), new.key_segments(r)),
                           hop) for r in range(new.n_hosts)]
    (o, _), trace = tree_merge(parts, new.k.itemsize)
    return (o, new, trace) if return_trace else (o, new)

