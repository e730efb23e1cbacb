"""The ring backward pass: FlashAttention-2 Algorithm 2 (arXiv:2307.08691) run around the ring.

Nothing but ``lse`` ([b, h, s]) is kept from the forward. Each host first computes
``D = rowsum(dO * O)`` for its queries, then the ring runs again: host ``my_idx`` holds K/V shard
``kv_idx = (my_idx - step) % N`` at step ``step`` and, for every tile that the mask does not leave
empty, recomputes the probabilities and accumulates the gradients (FA-2 Algorithm 2, lines 11-21)::

    P  = exp(S - lse)                 S = scale * Q K^T + bias, masked          [b, h, q, k]
    dV += P^T dO                      dP = dO V^T
    dS = P * (dP - D)                 dQ += scale * dS K      dK += scale * dS^T Q

(with ``logit_softcap`` c, S starts from ``c tanh(scale Q K^T / c)`` and dS gains the factor
``1 - tanh(scale Q K^T / c)^2``; with a ``score_fn`` f, S starts from ``f(S0)`` and dS gains ``f'(S0)``,
which :func:`score_slope` takes by the complex step, numpy having no autodiff).

``dQ`` stays on its host. ``dK``/``dV`` (a ``KVGrads``) travel with their K/V shard in the same
``ring.Message`` (the authors' code rotates ``k, v, dk, dv`` together); after the last step host ``i``
holds shard ``i + 1``, so one final
gradient-only send brings every ``dK``/``dV`` home. With GQA the kv-head gradients are summed over the
query heads of the group. A row that saw nothing has ``P = 0``: zero, finite gradients. A masked
pair has ``P = 0`` and ``dS = 0`` by ``where`` (never ``0 * nan``), and ``dQ`` multiplies only finite K, so
a masked key's values never reach a gradient (``masks.mark_bad_keys``).

:func:`hop_grads` is the backward of one hop (``attend_kv_shard``'s twin) and :func:`hop_attention_vjp`
that hop on its own, validated: the backward half of the per-hop contract (``ringattn_fast``'s
``kernels/xla.py`` ``hop_bwd`` and the Pallas kernels are tested against it).
"""
from __future__ import annotations

import numpy as np

from .attention import _grid, _shapes, repeat_kv
from .blockwise import check_hop, kv_tile, q_tile, scaled_logits, tile_logits
from .dropout import dropout_mask
from .masks import tile_is_empty
from .ring import hop_is_empty, hop_kinds, hop_kv, ring_forward, send_to_next, setup_ring, swap_buffers
from .shards import HopGrads, KVGrads
from .validation import check_attention_shapes, check_cotangent

COMPLEX_STEP = 1e-30  # far below float64's resolution of any logit: f(s + ih) = f(s) + ih f'(s) exactly


def sum_over_group(x, kv_heads):
    """GQA: sum per-query-head gradients [b, k, h, d] into their kv head -> [b, k, kv_heads, d]."""
    b, sk, h, d = x.shape
    return x.reshape(b, sk, kv_heads, h // kv_heads, d).sum(axis=3)


def score_slope(score_fn, s, q_pos, k_pos, heads):
    """``d score_fn(s) / d s`` pair by pair, [b, h, tq, tk], by the complex step (Squire & Trapp 1998).

    s: the tile's logits where ``score_fn`` takes them (after the scale and soft-cap) [b, h, tq, tk];
    q_pos [b|1, tq], k_pos [b|1, tk]. A score function is elementwise in s (``variants.py``), so its
    Jacobian is diagonal and ``Im f(s + ih) / h`` is its derivative: no difference to cancel, exact to
    rounding for every function built of analytic operations (``+``, ``*``, ``tanh``, ``exp``; ``abs`` of
    positions is fine, of ``s`` it is not). ``ringattn_fast`` takes ``jax.vjp`` of the same function.
    """
    qp, kp, _, _, head = _grid(q_pos, k_pos, None, None, heads)
    try:
        out = np.asarray(score_fn(s + 1j * COMPLEX_STEP, qp, kp, head))
    except Exception as e:  # noqa: BLE001 - the user's function: say how it was called
        raise ValueError(f"score_fn raised {type(e).__name__} on complex logits: the float64 ring backward "
                         f"differentiates it by the complex step (s + 1e-30j), so it must accept complex s; it "
                         f"was called with s, q_pos, k_pos, head of shapes {_shapes(s, qp, kp, head)}") from e
    if not np.iscomplexobj(out) or out.shape != s.shape:
        raise ValueError(f"score_fn must keep complex logits complex and of their shape {s.shape} (the float64 "
                         f"ring backward differentiates it by the complex step); got {out.dtype} {out.shape}")
    return out.imag / COMPLEX_STEP


def hop_grads(qs, kv, cfg, *, do, lse, delta, dropout=None, kinds=None):
    """The gradients of one hop, tile by tile (FA-2 Algorithm 2): :class:`HopGrads` (dbias None).

    qs, kv, cfg as in ``blockwise.attend_kv_shard`` (validated, cfg resolved); do [b, sq, h, d];
    lse, delta [b, h, sq]: the *final* lse and ``delta = rowsum(do * o_final)``; dropout: ``(seed,
    rate)`` or None. With dropout ``O = (P * keep) V`` for the keep multiplier ``keep = mask / (1 - rate)``:
    ``dV = (P * keep)^T dO``, ``dP = (dO V^T) * keep``, and ``D = rowsum(dO * O)`` is still
    ``rowsum(P * dP)``. dk, dv are summed over the GQA group. kinds: the hop's tile kinds
    (``block_mask.tile_kinds``; 0 = empty, skipped) or None.
    """
    q, k, v = qs.q, kv.k, kv.v
    b, sq, h, _ = q.shape
    kv_heads = k.shape[2]
    lse = np.where(np.isfinite(lse), lse, 0.0)  # rows that saw nothing: P = exp(-inf) = 0
    k_finite = np.where(np.isfinite(k), k, 0.0)  # dQ = dS K: a masked key's K must not enter as 0 * nan
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for qi in range(sq // cfg.block_q):
        rows = slice(qi * cfg.block_q, (qi + 1) * cfg.block_q)
        qt = q_tile(qs, rows)
        for kj in range(k.shape[1] // cfg.block_kv):
            cols = slice(kj * cfg.block_kv, (kj + 1) * cfg.block_kv)
            kt = kv_tile(kv, cols, rows)
            if (tile_is_empty(qt.pos, kt.pos, qt.seg, kt.seg, causal=cfg.causal, window=cfg.window)
                    or (kinds is not None and kinds[qi, kj] == 0)):
                continue
            s = tile_logits(qt, kt, cfg)  # (b, h, tq, tk)
            p = np.exp(s - lse[:, :, rows, None])  # (b, h, tq, tk); 0 where masked
            k_t, v_t = repeat_kv(k_finite[:, cols], h), repeat_kv(kt.v, h)  # (b, tk, h, d)
            keep = 1.0 if dropout is None else dropout_mask(*dropout, b, h, qt.pos, kt.pos)  # (b, h, tq, tk)
            dv_t = np.einsum("bhqk,bqhd->bkhd", p * keep, do[:, rows])  # (b, tk, h, d)
            dp = np.einsum("bqhd,bkhd->bhqk", do[:, rows], v_t) * keep  # (b, h, tq, tk)
            ds = np.where(p == 0, 0.0, p * (dp - delta[:, :, rows, None]))  # (b, h, tq, tk); a pair of
            # probability 0 has no gradient, even in a row made NaN by a bad key (its delta is NaN)
            s0 = None if cfg.logit_softcap is None and cfg.score_fn is None else scaled_logits(qt, kt, cfg)
            t = None if cfg.logit_softcap is None else np.tanh(s0 / cfg.logit_softcap)
            if cfg.score_fn is not None:  # chain rule through f, at f's input (after the soft-cap)
                s1 = s0 if t is None else cfg.logit_softcap * t
                ds = np.where(p == 0, 0.0, ds * score_slope(cfg.score_fn, s1, qt.pos, kt.pos, h))
            if t is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
                ds = np.where(p == 0, 0.0, ds * (1.0 - t * t))
            dq[:, rows] += cfg.scale * np.einsum("bhqk,bkhd->bqhd", ds, k_t)
            dk[:, cols] += sum_over_group(cfg.scale * np.einsum("bhqk,bqhd->bkhd", ds, qt.q), kv_heads)
            dv[:, cols] += sum_over_group(dv_t, kv_heads)
    return HopGrads(dq, dk, dv)


def hop_attention_vjp(qs, kv, cfg, *, do, lse, delta):
    """One hop's gradients :class:`HopGrads` ``(dq, dk, dv, None)`` float64, from the *final* ``lse``, ``delta``.

    The backward per-hop oracle (FA-2 Algorithm 2 on one K/V shard). qs, kv, cfg as in
    :func:`ringattn_ref.hop_attention`; do: [b, sq, h, d]; lse, delta: [b, h, sq] over *all* hops
    (``delta = rowsum(do * o_final)``, minus the cotangent of lse if lse is an output too). dk, dv are
    summed over the GQA group. For a single hop that is the whole attention: ``o, lse =
    hop_attention(qs, kv, cfg)``, ``delta = einsum("bqhd,bqhd->bhq", do, o)``.
    """
    qs, kv, cfg = check_hop(qs, kv, cfg)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    o_shape = qs.q.shape[:3] + kv.v.shape[-1:]  # (b, sq, h, d_v)
    return hop_grads(qs, kv, cfg, do=f64(check_cotangent(do, o_shape)), lse=f64(lse), delta=f64(delta))


def ring_attention_vjp(q, k, v, do, *, n_hosts, causal=False, segment_ids=None, bias=None,
                       window=None, scale=None, layout="contiguous", block_q=None, block_kv=None,
                       dropout_rate=0.0, dropout_key=None, logit_softcap=None, mask_fn=None, score_fn=None,
                       kv_segment_ids=None):
    """Gradients of :func:`ringattn_ref.ring_attention` for the output cotangent ``do``.

    q: [batch, t, heads, dim]; k: [batch, s, kv_heads, dim]; v: [batch, s, kv_heads, dim_v]; do:
    [batch, t, heads, dim_v]; keywords as in ``ring_attention`` (``t != s``, ``mask_fn``, ``score_fn``
    included: the hops and tiles the block mask calls empty are skipped here too). Returns
    ``(dq, dk, dv)`` float64 in the caller's order, shaped like ``q``, ``k``, ``v``. No gradient is
    returned for ``bias``.
    """
    check_attention_shapes(q, k, v)
    check_cotangent(do, q.shape[:3] + v.shape[-1:])  # do is shaped like o: (b, t, h, d_v)
    kwargs = dict(n_hosts=n_hosts, causal=causal, segment_ids=segment_ids, bias=bias, window=window,
                  scale=scale, layout=layout, block_q=block_q, block_kv=block_kv, dropout_rate=dropout_rate,
                  dropout_key=dropout_key, logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn,
                  kv_segment_ids=kv_segment_ids)
    o, lse, _ = ring_forward(q, k, v, **kwargs)  # the forward saves only o and lse
    problem, hosts = setup_ring(q, k, v, **kwargs, cross_attention=True)
    n, c, perm, hop = problem.n_hosts, problem.shard, problem.perm, problem.hop
    do_l, o_l, lse_l = np.asarray(do, np.float64)[:, perm], o[:, perm], lse[:, :, perm]  # layout order
    for host in hosts:
        sl = slice(host.my_idx * c, (host.my_idx + 1) * c)
        host.do, host.lse = do_l[:, sl], lse_l[:, :, sl]
        host.delta = np.einsum("bqhd,bqhd->bhq", do_l[:, sl], o_l[:, sl])  # FA-2: D = rowsum(dO * O)
        host.dq = np.zeros_like(host.qs.q)
        kv = host.held.kv
        host.held = host.held._replace(grads=KVGrads(np.zeros_like(kv.k), np.zeros_like(kv.v)))  # they travel

    for step in range(n):
        for host in hosts:
            grads = host.held.grads
            if not hop_is_empty(host, problem, step):
                g = hop_grads(host.qs, hop_kv(host, problem), hop, do=host.do, lse=host.lse, delta=host.delta,
                              dropout=problem.dropout, kinds=hop_kinds(host, problem))
                host.dq += g.dq  # dQ stays
                grads.dk[...] += g.dk  # dK/dV accumulate in the message that travels
                grads.dv[...] += g.dv
        if step < n - 1:  # dK/dV of this shard are final for this host: send k, v, dk, dv on
            send_to_next(hosts)
            swap_buffers(hosts)

    home = {}  # last hop, gradients only: host i holds shard i + 1, whose home is host i + 1
    for host in hosts:
        dest = (host.my_idx + 1) % n if n > 1 else host.my_idx
        assert host.held.kv_idx == dest
        home[dest] = host.held.grads
    dq = np.concatenate([host.dq for host in hosts], axis=1)[:, np.argsort(perm)]
    kv_inverse = np.argsort(problem.kv_perm)
    dk = np.concatenate([home[r].dk for r in range(n)], axis=1)[:, kv_inverse]
    dv = np.concatenate([home[r].dv for r in range(n)], axis=1)[:, kv_inverse]
    return dq, dk, dv
