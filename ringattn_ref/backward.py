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
``ring.Message`` (the authors' code, haoliuhl/ringattention ``ringattention/ringattention_jax.py`` at
commit 6305e2fb, rotates ``k, v, dk, dv`` together); after the last step host ``i``
holds shard ``i + 1``, so one final
gradient-only send brings every ``dK``/``dV`` home. (``ringattn_fast.backward`` sends the same messages
in another order, so that no send waits for the hop it overlaps: each step's accumulators leave at the top
of the next step, and the own hop is computed in two halves of query rows, first and last.) With GQA the
kv-head gradients are summed over the query heads of the group. A row that saw nothing has ``P = 0``: zero, finite gradients. A masked
pair has ``P = 0`` and ``dS = 0`` by ``where`` (never ``0 * nan``), and ``dQ`` multiplies only finite K, so
a masked key's values never reach a gradient (``masks.mark_bad_keys``).

:func:`hop_grads` is the backward of one hop (``attend_kv_shard``'s twin) and :func:`hop_attention_vjp`
that hop on its own, validated: the backward half of the per-hop contract (``ringattn_fast``'s
``kernels/xla.py`` ``hop_bwd`` and the Pallas kernels are tested against it).

``ring_attention_vjp(..., return_trace=True)`` also returns the backward's :class:`~ringattn_ref.ring.RingTrace`,
the forward's trace counted the same way, so the backward's cost is measured, not assumed: per computed
tile ``2 b h Br Bc (3 d + 2 d_v)`` FLOPs (``S = Q K^T``, ``dV``, ``dP``, ``dQ``, ``dK``: five matmuls to the
forward's two, 2.5x at ``d_v = d``) and per step the bytes of K, V *and* dK, dV (accumulators of
:func:`grad_itemsize`), then one last gradient-only send. The course's backward bounds (notebooks 05, 06,
10) read their factors from it.
"""
from __future__ import annotations

import numpy as np

from .attention import _grid, _shapes, repeat_kv
from .blockwise import check_hop, kv_tile, q_tile, scaled_logits, tile_logits
from .dropout import dropout_mask
from .masks import tile_is_empty
from .ring import (RingTrace, hop_is_empty, hop_kinds, hop_kv, ring_forward, send_to_next, setup_ring,
                   swap_buffers)
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


def grad_itemsize(itemsize):
    """Bytes per element of the dK/dV accumulators that travel for inputs of ``itemsize`` bytes: float32
    (4) for 16- and 32-bit inputs, float64 for float64, as ``ringattn_fast``'s backward keeps them
    (``softmax.acc_dtype``): a bf16 K/V shard travels with gradients twice its width."""
    return max(4, int(itemsize))


def tiles_to_compute(qs, kv, cfg, kinds=None):
    """bool ``[sq / block_q, sk / block_kv]``: the tiles of a hop the backward computes, i.e. those
    neither the position bounds (``masks.tile_is_empty``) nor ``kinds`` (0 = empty) leave out -- the
    forward's rule, so the two passes skip the same tiles."""
    sq, sk = qs.q.shape[1], kv.k.shape[1]
    todo = np.zeros((sq // cfg.block_q, sk // cfg.block_kv), bool)
    for qi in range(todo.shape[0]):
        rows = slice(qi * cfg.block_q, (qi + 1) * cfg.block_q)
        qt = q_tile(qs, rows)
        for kj in range(todo.shape[1]):
            kt = kv_tile(kv, slice(kj * cfg.block_kv, (kj + 1) * cfg.block_kv), rows)
            todo[qi, kj] = not (tile_is_empty(qt.pos, kt.pos, qt.seg, kt.seg, causal=cfg.causal, window=cfg.window)
                                or (kinds is not None and kinds[qi, kj] == 0))
    return todo


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
    todo = tiles_to_compute(qs, kv, cfg, kinds)
    for qi in range(sq // cfg.block_q):
        rows = slice(qi * cfg.block_q, (qi + 1) * cfg.block_q)
        qt = q_tile(qs, rows)
        for kj in range(k.shape[1] // cfg.block_kv):
            cols = slice(kj * cfg.block_kv, (kj + 1) * cfg.block_kv)
            kt = kv_tile(kv, cols, rows)
            if not todo[qi, kj]:
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


def backward_factors(itemsize=2, *, dim=8, dim_v=None):
    """``(flops_ratio, bytes_ratio)``: the backward's FLOPs and bytes per ring step over the forward's,
    measured from the traces of one small non-causal ring run both ways (2 hosts, inputs of ``itemsize``
    bytes: 2 for bf16, measured with float16 of the same width; ``dim_v`` defaults to ``dim``).

    The backward computes ``3 d + 2 d_v`` per pair to the forward's ``d + d_v`` (2.5x at ``d_v = d``) and
    sends dK, dV at :func:`grad_itemsize` beside K, V (3x for bf16). A shard hides its backward transfer
    when ``c >= bytes_ratio / flops_ratio * F / B`` (1.2 F/B in bf16): ``cost.min_block_size`` times
    ``bytes_ratio / flops_ratio``.
    """
    dtype = {2: np.float16, 4: np.float32, 8: np.float64}.get(int(itemsize))
    if dtype is None:
        raise ValueError(f"itemsize must be 2, 4 or 8 bytes; got {itemsize!r}")
    dim_v = dim if dim_v is None else dim_v
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 8, 1, dim)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((1, 8, 1, dim_v)).astype(dtype)
    do = rng.standard_normal((1, 8, 1, dim_v))
    *_, fwd = ring_forward(q, k, v, n_hosts=2)
    *_, bwd = ring_attention_vjp(q, k, v, do, n_hosts=2, return_trace=True)
    return float(bwd.flops[0, 0] / fwd.flops[0, 0]), float(bwd.bytes_sent[0, 0] / fwd.bytes_sent[0, 0])


def ring_attention_vjp(q, k, v, do, *, n_hosts, causal=False, segment_ids=None, bias=None,
                       window=None, scale=None, layout="contiguous", block_q=None, block_kv=None,
                       dropout_rate=0.0, dropout_key=None, logit_softcap=None, mask_fn=None, score_fn=None,
                       kv_segment_ids=None, return_trace=False):
    """Gradients of :func:`ringattn_ref.ring_attention` for the output cotangent ``do``.

    q: [batch, t, heads, dim]; k: [batch, s, kv_heads, dim]; v: [batch, s, kv_heads, dim_v]; do:
    [batch, t, heads, dim_v]; keywords as in ``ring_attention`` (``t != s``, ``mask_fn``, ``score_fn``
    included: the hops and tiles the block mask calls empty are skipped here too). Returns
    ``(dq, dk, dv)`` float64 in the caller's order, shaped like ``q``, ``k``, ``v``. No gradient is
    returned for ``bias``.

    With ``return_trace``: ``(dq, dk, dv, trace)``, ``trace`` a :class:`~ringattn_ref.ring.RingTrace` of the
    backward ring, arrays ``[n_hosts, n_steps]`` as the forward's: ``kv_idx``, ``tiles_computed`` /
    ``tiles_skipped`` (:func:`tiles_to_compute`), ``hop_skipped``; ``flops`` ``2 b h Br Bc (3 d + 2 d_v)``
    per computed tile (recomputed ``Q K^T``, then ``dV``, ``dP``, ``dQ``, ``dK``); ``bytes_sent`` after step s:
    K and V at the inputs' itemsize plus dK and dV at :func:`grad_itemsize`, and at the last step (s =
    N - 1) the gradient-only send home (0 on a ring of one); ``meta_bytes_sent`` the positions and segment
    ids sent with K/V. ``peak_bytes`` is not modelled for the backward (zeros).
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
    b, _, h, d = hosts[0].qs.q.shape
    d_v = hosts[0].held.kv.v.shape[-1]
    tile_flops = 2 * b * h * hop.block_q * hop.block_kv * (3 * d + 2 * d_v)  # QK^T, dV, dP, dQ, dK
    n_tiles = (c // hop.block_q) * (problem.kv_shard // hop.block_kv)
    g_item = grad_itemsize(problem.itemsize)
    kv_idx, computed, skipped = (np.zeros((n, n), np.int64) for _ in range(3))
    hop_skipped = np.zeros((n, n), bool)
    bytes_sent, meta_sent = np.zeros((n, n), np.int64), np.zeros((n, n), np.int64)
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
            i, grads, kv = host.my_idx, host.held.grads, host.held.kv
            kv_idx[i, step] = host.held.kv_idx
            kv_bytes = (kv.k.size + kv.v.size) * problem.itemsize
            grad_bytes = (grads.dk.size + grads.dv.size) * g_item
            if step < n - 1:  # k, v, dk, dv on to the next host
                bytes_sent[i, step], meta_sent[i, step] = kv_bytes + grad_bytes, host.held.meta_bytes()
            elif n > 1:  # the last send: dk, dv home
                bytes_sent[i, step] = grad_bytes
            if hop_is_empty(host, problem, step):
                hop_skipped[i, step], skipped[i, step] = True, n_tiles
            else:
                kv_hop, kinds = hop_kv(host, problem), hop_kinds(host, problem)
                todo = tiles_to_compute(host.qs, kv_hop, hop, kinds)
                computed[i, step], skipped[i, step] = todo.sum(), todo.size - todo.sum()
                g = hop_grads(host.qs, kv_hop, hop, do=host.do, lse=host.lse, delta=host.delta,
                              dropout=problem.dropout, kinds=kinds)
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
    if not return_trace:
        return dq, dk, dv
    trace = RingTrace(n_hosts=n, layout=problem.layout_name, block_q=hop.block_q, block_kv=hop.block_kv,
                      kv_idx=kv_idx, tiles_computed=computed, tiles_skipped=skipped, hop_skipped=hop_skipped,
                      flops=computed.astype(np.float64) * tile_flops, bytes_sent=bytes_sent,
                      meta_bytes_sent=meta_sent, peak_bytes=np.zeros(n, np.int64), block_mask=problem.block_mask)
    return dq, dk, dv, trace
