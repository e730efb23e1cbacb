"""The 2-D hybrid: Ulysses inside groups of hosts, the ring across the groups, on virtual hosts.

USP (Fang & Zhao, arXiv:2405.07719) and LoongTrain's 2-D attention (arXiv:2406.18485): Ulysses alone
stops at ``heads`` devices and the ring's per-hop compute shrinks as ``1/N``; the hybrid runs Ulysses
over ``U = ulysses_size`` hosts (a node's fast links) and the ring over ``R = ring_size`` groups of them
(the slow links between nodes), ``P = U * R`` hosts in all.

Host ``(r, u)`` is linear host ``p = r * U + u`` (ring-major: ``ringattn_fast`` shards the sequence over
the mesh axes ``(ring_axis, ulysses_axis)``), and starts where every strategy starts: layout shard ``p``
of q, k, v (``c = S / P`` tokens, all heads; ``layouts`` with ``n_hosts = P``). Ulysses group ``r`` is the
``U`` hosts sharing ``r``: shards ``rU .. rU + U - 1``, ``L = U c = S / R`` tokens. Then:

1. all-to-all in each group (sequence -> heads): host ``(r, u)`` receives from each group member its
   ``c`` tokens of q on heads group ``u`` (``heads / U`` heads) and of K/V on the kv heads that group
   uses: ``[S/P, heads] -> [S/R, heads/U]``;
2. the ring over ``r`` on those heads: ``R`` steps; at step ``s`` host ``(r, u)`` holds the K/V of group
   ``(r - s) % R`` and sends it to ``(r + 1, u)`` (``ring.py``'s hosts, messages and index arithmetic);
   masks by true positions, so every layout computes the same attention;
3. all-to-all back: host ``(r, u)`` sends each member ``(r, u')`` the output of ``u'``'s tokens on
   heads group ``u``.

``U = 1`` is the ring, ``R = 1`` is Ulysses. GQA as ``ringattn_fast.ulysses_attention`` does it: each kv
head is repeated ``kv_repeat = U / gcd(kv_heads, U)`` times before the all-to-all (1 when ``kv_heads`` is
a multiple of ``U``), so every host receives ``lcm(kv_heads, U) / U`` kv heads, whole groups for its query
heads. Example: 12 heads, 3 kv heads, ``U = 4``: each kv head 4 times, 3 per host; host 1 holds query
heads 3, 4, 5 and copies of kv heads 0, 1, 1 -- exactly what ``strategies.ulysses_attention`` sends on
``U`` hosts (``strategies.kv_repeat``), so ``R = 1`` is that Ulysses byte for byte, in the trace and in
``strategy_cost``.
"""
from __future__ import annotations

import numpy as np

from .blockwise import attend_kv_shard, bias_tile
from .ring import Host, Message, send_to_next, setup_ring, swap_buffers
from .shards import KVShard, QShard
from .softmax import finalize, init_state
from .strategies import StrategyTrace, _caller_order, kv_repeat
from .validation import check_n_hosts, check_qkv


def _positive_int(name, x):
    if not isinstance(x, (int, np.integer)) or isinstance(x, (bool, np.bool_)) or x < 1:
        raise ValueError(f"{name} must be a positive int; got {x!r}")
    return int(x)


def check_split(heads, ulysses_size, ring_size=None, *, devices=None):
    """Validate a split ``ulysses_size x ring_size`` of ``heads`` query heads (over ``devices`` if given):
    ``ulysses_size`` at most ``heads`` and dividing them, ``ulysses_size * ring_size == devices``.
    Returns ``(ulysses_size, ring_size)``; ``ring_size`` None: ``devices / ulysses_size``."""
    u = _positive_int("ulysses_size", ulysses_size)
    if u > heads:
        raise ValueError(f"ulysses_size ({u}) must not exceed heads ({heads}): Ulysses splits whole heads")
    if heads % u:
        raise ValueError(f"heads ({heads}) must be divisible by ulysses_size ({u}): Ulysses splits whole heads")
    if ring_size is None:
        if devices is None:
            raise ValueError("give ring_size or devices")
        if devices % u:
            raise ValueError(f"ulysses_size ({u}) must divide devices ({devices}): ring_size = devices / ulysses_size")
        return u, devices // u
    r = _positive_int("ring_size", ring_size)
    if devices is not None and u * r != devices:
        raise ValueError(f"ulysses_size * ring_size = {u} * {r} = {u * r} must equal devices ({devices})")
    return u, r


def hybrid_splits(heads, devices):
    """Every split ``(ulysses_size, ring_size)`` of ``devices``: ``ulysses_size`` divides ``devices`` and
    ``heads`` (so it never exceeds ``heads``). Example: 4 heads on 8 devices: (1, 8), (2, 4), (4, 2)."""
    return [(u, devices // u) for u in range(1, min(heads, devices) + 1) if devices % u == 0 and heads % u == 0]


def hybrid_attention(q, k, v, *, ulysses_size, ring_size, causal=False, segment_ids=None, bias=None, window=None,
                     scale=None, layout="contiguous", block_q=None, block_kv=None, return_trace=False):
    """Attention by the 2-D hybrid on ``ulysses_size x ring_size`` simulated hosts (module docstring).

    Arguments as in :func:`ringattn_ref.ring_attention` with ``n_hosts = ulysses_size * ring_size``
    (layout over all of them; ``block_q`` / ``block_kv`` divide ``c = seq / n_hosts``); ``heads`` must
    be divisible by ``ulysses_size``. Trace steps: ``"all-to-all qkv"``, ``"ring 1"`` .. ``"ring R"``
    (the ring's sends happen after steps 1 .. R-1, none after the last), ``"all-to-all o"``; rows are
    the hosts ``p = r * U + u``. Peak per host: the largest of (its q, k, v shards + the received q/k/v),
    the ring's live set (``ring.Host.live_elements``: q, held and received K/V, o, m, l, one score tile),
    (o on its heads + the received output shard); the all-to-all terms only when ``U > 1``.
    Returns o [batch, seq, heads, dim_v] float64 (and a :class:`StrategyTrace` if ``return_trace``).
    """
    h = check_qkv(q, k, v, value_width=True)[2]
    n_u, n_r = check_split(h, ulysses_size, ring_size)
    check_n_hosts(n_u * n_r, q.shape[1], layout, name="ulysses_size * ring_size")
    problem, hosts = setup_ring(q, k, v, n_hosts=n_u * n_r, causal=causal, segment_ids=segment_ids, bias=bias,
                                window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv)
    n, e, hop = problem.n_hosts, problem.itemsize, problem.hop
    b, c, _, d = hosts[0].qs.q.shape
    hk, d_v = hosts[0].held.kv.k.shape[2], hosts[0].held.kv.v.shape[3]
    hq, rep = h // n_u, kv_repeat(hk, n_u)
    hku = hk * rep // n_u  # kv heads per host after the all-to-all
    sent = [(hst.held.kv.k.repeat(rep, axis=2), hst.held.kv.v.repeat(rep, axis=2)) for hst in hosts]  # k, v as sent
    bytes_sent, flops = np.zeros((n, n_r + 2), np.int64), np.zeros((n, n_r + 2))
    peak = np.zeros(n, np.int64)
    tile = b * hq * hop.block_q * hop.block_kv
    tile_flops = 2 * tile * (d + d_v)  # Q K^T and P V
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs, axis=1)  # noqa: E731  (along the sequence)
    o_heads = {}  # (r, u) -> host (r, u)'s output, its group's L tokens on its heads, (b, L, h/U, d_v)
    for u in range(n_u):
        qh, kvh = slice(u * hq, (u + 1) * hq), slice(u * hku, (u + 1) * hku)
        bias_u = problem.bias
        if bias_u is not None and bias_u.shape[1] > 1:
            bias_u = bias_u[:, qh]  # (b|1, h/U, s|1, s|1): heads group u
        ring = []  # the R hosts (r, u), r = 0 .. R-1: one ring per heads group
        for r in range(n_r):  # step 0: host (r, u) receives from each member of group r (its own part stays)
            group = range(r * n_u, (r + 1) * n_u)
            qs = QShard(cat([hosts[p].qs.q[:, :, qh] for p in group]), cat([hosts[p].qs.pos for p in group]),
                        cat([hosts[p].qs.seg for p in group]))  # q (b, L, h/U, d), pos (1, L)
            kv = KVShard(cat([sent[p][0][:, :, kvh] for p in group]), cat([sent[p][1][:, :, kvh] for p in group]),
                         cat([hosts[p].held.kv.pos for p in group]), cat([hosts[p].held.kv.seg for p in group]))
            for p in group:
                if p != r * n_u + u:
                    bytes_sent[p, 0] += (hosts[p].qs.q[:, :, qh].size + 2 * sent[p][0][:, :, kvh].size) * e
            host = Host(my_idx=r, qs=qs, held=Message(kv_idx=r, kv=kv))
            host.m, host.l, host.o = init_state(b, hq, qs.q.shape[1], d_v)
            ring.append(host)
        for step in range(n_r):  # steps 1 .. R: ring_forward's loop over the groups
            if step < n_r - 1:
                send_to_next(ring)  # (r, u) -> (r + 1, u): post the sends, then compute
            for host in ring:
                p = host.my_idx * n_u + u
                assert host.held.kv_idx == (host.my_idx - step) % n_r  # the authors' index arithmetic
                if step < n_r - 1:
                    bytes_sent[p, 1 + step] = host.held.payload_elements() * e
                peak[p] = max(peak[p], host.live_elements(tile) * e)
                kv = host.held.kv._replace(bias=bias_tile(bias_u, host.qs.pos, host.held.kv.pos))
                computed, _ = attend_kv_shard((host.m, host.l, host.o), host.qs, kv, hop)
                flops[p, 1 + step] = computed * tile_flops
            if step < n_r - 1:
                swap_buffers(ring)
        for host in ring:
            p, (o, _) = host.my_idx * n_u + u, finalize(host.m, host.l, host.o)
            o_heads[host.my_idx, u] = o
            if n_u > 1:
                inputs = hosts[p].qs.q.size + hosts[p].held.payload_elements()  # the copies: views, not counted
                received = host.qs.q.size + host.held.kv.k.size + host.held.kv.v.size
                peak[p] = max(peak[p], (inputs + received) * e, (o.size + b * c * h * d_v) * e)
            bytes_sent[p, n_r + 1] = (n_u - 1) * b * c * hq * d_v * e  # step R + 1: the others' tokens
    shards = [np.concatenate([o_heads[p // n_u, u][:, (p % n_u) * c:(p % n_u + 1) * c] for u in range(n_u)], axis=2)
              for p in range(n)]  # host p's c tokens, all heads (b, c, h, d_v)
    o = _caller_order(problem, shards, axis=1)  # (b, s, h, d_v)
    steps = ("all-to-all qkv",) + tuple(f"ring {s + 1}" for s in range(n_r)) + ("all-to-all o",)
    trace = StrategyTrace("hybrid", n, steps, bytes_sent, flops, peak, ulysses_size=n_u, ring_size=n_r)
    return (o, trace) if return_trace else o
