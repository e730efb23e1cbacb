"""The ring backward pass: FlashAttention-2 Algorithm 2 (arXiv:2307.08691) run around the ring.

Nothing but ``lse`` ([b, h, s]) is kept from the forward. Each host first computes
``D = rowsum(dO * O)`` for its queries, then the ring runs again: host ``my_idx`` holds K/V block
``kv_idx = (my_idx - step) % N`` at step ``step`` and, for every tile that the mask does not leave
empty, recomputes the probabilities and accumulates the gradients (FA-2 Algorithm 2, lines 11-21)::

    P  = exp(S - lse)                 S = scale * Q K^T + bias, masked          [b, h, q, k]
    dV += P^T dO                      dP = dO V^T
    dS = P * (dP - D)                 dQ += scale * dS K      dK += scale * dS^T Q

``dQ`` stays on its host. ``dK``/``dV`` travel with their K/V block (the authors' code rotates
``k, v, dk, dv`` together); after the last step host ``i`` holds block ``i + 1``, so one final
gradient-only send brings every ``dK``/``dV`` home. With GQA the kv-head gradients are summed over the
query heads of the group. A row that saw nothing has ``P = 0``: zero, finite gradients. A masked
pair has ``P = 0`` and ``dS = 0`` by ``where`` (never ``0 * nan``), and ``dQ`` multiplies only finite K, so
a masked key's values never reach a gradient (``masks.mark_bad_keys``).

:func:`hop_attention_vjp` is one hop of it on its own: the backward half of the per-hop contract
(``ringattn_fast.hop.hop_bwd`` and the Pallas kernels are tested against it).
"""
from __future__ import annotations

import numpy as np

from .attention import repeat_kv
from .blockwise import tile_logits
from .dropout import dropout_mask
from .masks import as_rows, mark_bad_keys, tile_is_empty
from .ring import Host, KVBlock, hop_is_empty, ring_forward, send_to_next, setup_ring, swap_buffers
from .validation import (check_block, check_bool, check_cotangent, check_positions, check_scale,
                         check_window)


def sum_over_group(x, kv_heads):
    """GQA: sum per-query-head gradients [b, k, h, d] into their kv head -> [b, k, kv_heads, d]."""
    b, sk, h, d = x.shape
    return x.reshape(b, sk, kv_heads, h // kv_heads, d).sum(axis=3)


def attend_kv_block_bwd(host, block, bias, *, scale, causal, window, block_q, block_kv, dropout=None):
    """Accumulate into ``host.dq`` and ``block.dk``/``block.dv`` the gradients of one hop, in place.

    host: a ring ``Host`` with q, do [b, c, h, d], lse, delta [b, h, c], dq; block: the ``KVBlock`` it
    holds (k, v, dk, dv [b, c, kv_heads, d]); dropout: ``(seed, rate)`` or None. With dropout
    ``O = (P * K) V`` for the keep multiplier ``K = M / (1 - rate)``: ``dV = (P * K)^T dO``,
    ``dP = (dO V^T) * K``, and ``D = rowsum(dO * O)`` is still ``rowsum(P * dP)``. Returns the number of
    tiles computed.
    """
    q, do, k, v = host.q, host.do, block.k, block.v
    h, kv_heads = q.shape[2], k.shape[2]
    lse = np.where(np.isfinite(host.lse), host.lse, 0.0)  # rows that saw nothing: P = exp(-inf) = 0
    k_finite = np.where(np.isfinite(k), k, 0.0)  # dQ = dS K: a masked key's K must not enter as 0 * nan
    computed = 0
    for qi in range(q.shape[1] // block_q):
        qs = slice(qi * block_q, (qi + 1) * block_q)
        for kj in range(k.shape[1] // block_kv):
            ks = slice(kj * block_kv, (kj + 1) * block_kv)
            q_seg, k_seg = (None, None) if host.q_seg is None else (host.q_seg[:, qs], block.k_seg[:, ks])
            if tile_is_empty(host.q_pos[:, qs], block.k_pos[:, ks], q_seg, k_seg, causal=causal, window=window):
                continue
            s = tile_logits(q[:, qs], k[:, ks], host.q_pos[:, qs], block.k_pos[:, ks], q_seg, k_seg, bias,
                            scale=scale, causal=causal, window=window)  # (b, h, tq, tk)
            p = np.exp(s - lse[:, :, qs, None])  # (b, h, tq, tk); 0 where masked
            k_tile, v_tile = repeat_kv(k_finite[:, ks], h), repeat_kv(v[:, ks], h)  # (b, tk, h, d)
            keep = 1.0 if dropout is None else dropout_mask(*dropout, q.shape[0], h, host.q_pos[:, qs],
                                                            block.k_pos[:, ks])  # (b, h, tq, tk)
            dv = np.einsum("bhqk,bqhd->bkhd", p * keep, do[:, qs])  # (b, tk, h, d)
            dp = np.einsum("bqhd,bkhd->bhqk", do[:, qs], v_tile) * keep  # (b, h, tq, tk)
            ds = np.where(p == 0, 0.0, p * (dp - host.delta[:, :, qs, None]))  # (b, h, tq, tk); a pair of
            # probability 0 has no gradient, even in a row made NaN by a bad key (its delta is NaN)
            host.dq[:, qs] += scale * np.einsum("bhqk,bkhd->bqhd", ds, k_tile)
            dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q[:, qs])  # (b, tk, h, d)
            block.dk[:, ks] += sum_over_group(dk, kv_heads)
            block.dv[:, ks] += sum_over_group(dv, kv_heads)
            computed += 1
    return computed


def hop_attention_vjp(q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None, k_seg=None, bias=None, *,
                      scale=None, causal=False, window=None, block_q=None, block_kv=None):
    """One hop's gradients ``(dq, dk, dv)`` float64, from the *final* ``lse`` and ``delta``.

    The backward per-hop oracle (FA-2 Algorithm 2 on one K/V block). q, do: [b, sq, h, d]; k, v:
    [b, sk, hk, d]; lse, delta: [b, h, sq] over *all* hops (``delta = rowsum(do * o_final)``, minus
    the cotangent of lse if lse is an output too); positions, segments, bias and keywords as in
    :func:`ringattn_ref.hop_attention`. dk, dv are summed over the GQA group. For a single hop that is
    the whole attention: ``o, lse = hop_attention(...)``, ``delta = einsum("bqhd,bqhd->bhq", do, o)``.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    q_pos, k_pos = as_rows(q_pos, b), as_rows(k_pos, b)
    check_positions(q_pos, b, sq, "q_pos"), check_positions(k_pos, b, sk, "k_pos")
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    host = Host(my_idx=0, q=f64(q), q_pos=q_pos, q_seg=q_seg, held=None, do=f64(check_cotangent(do, q.shape)),
                lse=f64(lse), delta=f64(delta), dq=np.zeros((b, sq, h, d)))
    k, v = mark_bad_keys(k, v)
    block = KVBlock(kv_idx=0, k=k, v=v, k_pos=k_pos, k_seg=k_seg, dk=np.zeros(k.shape), dv=np.zeros(v.shape))
    attend_kv_block_bwd(host, block, None if bias is None else f64(bias), scale=check_scale(scale, d),
                        causal=check_bool(causal, "causal"), window=check_window(window),
                        block_q=check_block(block_q, sq, "block_q"), block_kv=check_block(block_kv, sk, "block_kv"))
    return host.dq, block.dk, block.dv


def ring_attention_vjp(q, k, v, do, *, n_hosts, causal=False, segment_ids=None, bias=None,
                       window=None, scale=None, layout="contiguous", block_q=None, block_kv=None,
                       dropout_rate=0.0, dropout_key=None):
    """Gradients of :func:`ringattn_ref.ring_attention` for the output cotangent ``do``.

    q, do: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim]; keywords as in
    ``ring_attention``. Returns ``(dq, dk, dv)`` float64 in the caller's order, shaped like
    ``q``, ``k``, ``v``. No gradient is returned for ``bias``.
    """
    check_cotangent(do, q.shape)
    kwargs = dict(n_hosts=n_hosts, causal=causal, segment_ids=segment_ids, bias=bias, window=window,
                  scale=scale, layout=layout, block_q=block_q, block_kv=block_kv, dropout_rate=dropout_rate,
                  dropout_key=dropout_key)
    o, lse, _ = ring_forward(q, k, v, **kwargs)  # the forward saves only o and lse
    problem, hosts = setup_ring(q, k, v, **kwargs)
    n, c, perm = problem.n_hosts, problem.shard, problem.perm
    do_l, o_l, lse_l = np.asarray(do, np.float64)[:, perm], o[:, perm], lse[:, :, perm]  # layout order
    for host in hosts:
        sl = slice(host.my_idx * c, (host.my_idx + 1) * c)
        host.do, host.lse = do_l[:, sl], lse_l[:, :, sl]
        host.delta = np.einsum("bqhd,bqhd->bhq", do_l[:, sl], o_l[:, sl])  # FA-2: D = rowsum(dO * O)
        host.dq = np.zeros_like(host.q)
        host.held.dk, host.held.dv = np.zeros_like(host.held.k), np.zeros_like(host.held.v)

    for step in range(n):
        for host in hosts:
            if not hop_is_empty(host, problem):
                attend_kv_block_bwd(host, host.held, problem.bias, scale=problem.scale,
                                    causal=problem.causal, window=problem.window,
                                    block_q=problem.block_q, block_kv=problem.block_kv,
                                    dropout=problem.dropout)
        if step < n - 1:  # dK/dV of this block are final for this host: send k, v, dk, dv on
            send_to_next(hosts)
            swap_buffers(hosts)

    home = {}  # last hop, gradients only: host i holds block i + 1, whose home is host i + 1
    for host in hosts:
        dest = (host.my_idx + 1) % n if n > 1 else host.my_idx
        assert host.held.kv_idx == dest
        home[dest] = (host.held.dk, host.held.dv)
    inverse = np.argsort(perm)
    dq = np.concatenate([host.dq for host in hosts], axis=1)[:, inverse]
    dk = np.concatenate([home[r][0] for r in range(n)], axis=1)[:, inverse]
    dv = np.concatenate([home[r][1] for r in range(n)], axis=1)[:, inverse]
    return dq, dk, dv
