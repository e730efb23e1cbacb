"""One ring hop in XLA: blockwise attention of the local queries against the K/V shard held now.

Implements the per-hop contract of ``docs/design.md`` (the Pallas kernels implement the same one):

    hop_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window, block_q, block_kv)
        -> o float [b, sq, h, d] normalised within the hop, lse float [b, h, sq]
    hop_bwd(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias, *, ...same...)
        -> dq [b, sq, h, d], dk, dv [b, sk, hk, d] (summed over the GQA group), dbias like bias

This is the Blockwise Parallel Transformer's inner loop (arXiv:2305.19370 §3; Ring Attention,
arXiv:2310.01889, Algorithm 1) written as FlashAttention-2 (arXiv:2307.08691): queries in ``block_q``
chunks (Br), the K/V shard in ``block_kv`` chunks (Bc), an online softmax ``(o, m, l)`` per query
chunk, so only one ``block_q x block_kv`` tile of logits is alive: temp memory is linear in the local
sequence. Tiles the mask leaves empty are skipped with ``lax.cond`` (no FLOPs).

Accumulation is float32 for 16/32-bit inputs and float64 for float64. GQA: ``q`` is viewed as
``[b, s, hk, g, d]`` (query head ``h`` uses kv head ``h // g``), so K/V are never repeated.
``bias`` is ``[b|1, h|1, sq|1, sk|1]``, added to the scaled logits (mirrors ``ringattn_ref.blockwise``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import masks
from .mesh import varying_axes, vary_like


def acc_dtype(dtype):
    """float64 stays float64; every other float accumulates in float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _rows(x, start, size, axis):
    """``x[start:start+size]`` along ``axis``; a broadcast (size-1) axis is left alone."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _logits(q_i, k_j, bias_ij, mask_ij, scale, acc):
    """Scaled, biased, masked logits of one tile: (b, hk, g, bq, bkv) in ``acc``."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=acc) * scale
    if bias_ij is not None:
        bb, bh, bq, bk = bias_ij.shape
        hk, g = s.shape[1:3]
        s = s + bias_ij.astype(acc).reshape(bb, hk if bh > 1 else 1, g if bh > 1 else 1, bq, bk)
    if mask_ij is not None:
        s = jnp.where(mask_ij[:, None, None], s, -jnp.inf)
    return s


def hop_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window, block_q, block_kv):
    """Attention of ``q`` against one K/V shard: ``(o, lse)``, o 0 and lse -inf where a row saw nothing."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    acc = acc_dtype(q.dtype)
    skip = masks.can_be_empty(causal, window, q_seg is not None)
    axes = varying_axes(q, k, v, q_pos, k_pos, q_seg, k_seg, bias)

    def q_block(i):  # one Br chunk of queries, all of the shard's keys
        start = i * block_q
        q_i = _rows(q, start, block_q, 1).reshape(b, block_q, hk, g, d)  # (b, bq, hk, g, d)
        qp_i, qs_i = _rows(q_pos, start, block_q, 1), _rows(q_seg, start, block_q, 1)
        bias_i = _rows(bias, start, block_q, 2)

        def kv_block(carry, j):  # one Bc chunk: the online-softmax update (FA-2 Algorithm 1)
            start_j = j * block_kv
            kp_j, ks_j = _rows(k_pos, start_j, block_kv, 1), _rows(k_seg, start_j, block_kv, 1)

            def update(carry):
                o, m, l = carry  # (b, hk, g, bq, d), (b, hk, g, bq), (b, hk, g, bq)
                k_j = _rows(k, start_j, block_kv, 1)  # (b, bkv, hk, d)
                v_j = _rows(v, start_j, block_kv, 1)
                mask = masks.allowed(qp_i, kp_j, qs_i, ks_j, causal=causal, window=window)
                s = _logits(q_i, k_j, _rows(bias_i, start_j, block_kv, 3), mask, scale, acc)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
                p = jnp.exp(s - m_safe[..., None])  # masked -> exp(-inf) = 0
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + p.sum(axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p, v_j.astype(acc))
                return alpha[..., None] * o + pv, m_new, l

            if skip:
                empty = masks.tile_is_empty(qp_i, kp_j, qs_i, ks_j, causal=causal, window=window)
                return lax.cond(empty, lambda c: c, update, carry), None
            return update(carry), None

        init = (jnp.zeros((b, hk, g, block_q, d), acc), jnp.full((b, hk, g, block_q), -jnp.inf, acc),
                jnp.zeros((b, hk, g, block_q), acc))
        (o, m, l), _ = lax.scan(kv_block, vary_like(init, axes), jnp.arange(sk // block_kv))
        o = o / jnp.where(l == 0, 1.0, l)[..., None]
        lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
        return o, lse

    o, lse = lax.map(q_block, jnp.arange(sq // block_q))  # (nq, b, hk, g, bq, d), (nq, b, hk, g, bq)
    o = jnp.einsum("nbkgqd->bnqkgd", o).reshape(b, sq, h, d)
    lse = jnp.einsum("nbkgq->bkgnq", lse).reshape(b, h, sq)
    return o, lse


def _sum_to(x, shape):
    """Sum ``x`` over the axes where ``shape`` is 1 (the bias's broadcast axes), keeping dims."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def hop_bwd(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window,
            block_q, block_kv):
    """FlashAttention-2 backward (Algorithm 2) of one hop, recomputing each tile from ``q, k, lse``.

    Outer loop over K/V chunks (dK_j, dV_j accumulate over the query chunks), inner loop over query
    chunks; per tile ``P = exp(S - lse)``, ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - delta)``,
    ``dQ += scale dS K``, ``dK += scale dS^T Q``, ``dbias = dS`` (summed over broadcast axes).
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    acc = acc_dtype(q.dtype)
    skip = masks.can_be_empty(causal, window, q_seg is not None)
    axes = varying_axes(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias)
    lse = lse.reshape(b, hk, g, sq)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw nothing: every p below is masked to 0
    delta = delta.reshape(b, hk, g, sq)
    nq, nk = sq // block_q, sk // block_kv
    bias_rows = bias is not None and bias.shape[2] > 1
    bias_cols = bias is not None and bias.shape[3] > 1

    def kv_block(dq, j):  # one Bc chunk of keys; its dK_j, dV_j stay in the inner carry
        start_j = j * block_kv
        k_j, v_j = _rows(k, start_j, block_kv, 1), _rows(v, start_j, block_kv, 1)  # (b, bkv, hk, d)
        kp_j, ks_j = _rows(k_pos, start_j, block_kv, 1), _rows(k_seg, start_j, block_kv, 1)
        bias_j = _rows(bias, start_j, block_kv, 3)

        def q_block(carry, i):
            start = i * block_q
            qp_i, qs_i = _rows(q_pos, start, block_q, 1), _rows(q_seg, start, block_q, 1)
            bias_ij = _rows(bias_j, start, block_q, 2)

            def tile(carry):
                dk_j, dv_j, db_j = carry
                q_i = _rows(q, start, block_q, 1).reshape(b, block_q, hk, g, d)
                do_i = _rows(do, start, block_q, 1).reshape(b, block_q, hk, g, d).astype(acc)
                lse_i, delta_i = _rows(lse, start, block_q, 3), _rows(delta, start, block_q, 3)
                mask = masks.allowed(qp_i, kp_j, qs_i, ks_j, causal=causal, window=window)
                s = _logits(q_i, k_j, bias_ij, mask, scale, acc)  # (b, hk, g, bq, bkv)
                p = jnp.exp(s - lse_i[..., None])  # masked -> 0
                dv_j = dv_j + jnp.einsum("bkgqs,bqkgd->bskd", p, do_i)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j.astype(acc))
                ds = p * (dp - delta_i[..., None])
                dq_i = scale * jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j.astype(acc))
                dk_j = dk_j + scale * jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i.astype(acc))
                if bias is not None:
                    db = _sum_to(ds.reshape(b, h, block_q, block_kv), bias_ij.shape)
                    db_j = db_j + db if not bias_rows else db
                return (dk_j, dv_j, db_j if not bias_rows else None), (dq_i, db_j if bias_rows else None)

            if not skip:
                return tile(carry)
            empty = masks.tile_is_empty(qp_i, kp_j, qs_i, ks_j, causal=causal, window=window)
            zeros = (vary_like(jnp.zeros((b, block_q, hk, g, d), acc), axes),
                     None if not bias_rows else vary_like(jnp.zeros(bias_ij.shape, acc), axes))
            return lax.cond(empty, lambda c: (c, zeros), tile, carry)

        db0 = None
        if bias is not None and not bias_rows:
            db0 = jnp.zeros(bias_j.shape, acc)
        init = vary_like((jnp.zeros(k_j.shape, acc), jnp.zeros(k_j.shape, acc), db0), axes)
        (dk_j, dv_j, db_j), (dq_blocks, db_blocks) = lax.scan(q_block, init, jnp.arange(nq))
        dq = dq + jnp.einsum("nbqkgd->bnqkgd", dq_blocks).reshape(b, sq, hk, g, d)
        if bias_rows:  # (nq, bb, bh, bq, bkv|1) -> (bb, bh, sq, bkv|1)
            db_j = jnp.einsum("nbhqs->bhnqs", db_blocks).reshape(db_blocks.shape[1:3] + (sq, -1))
        return dq, (dk_j, dv_j, db_j)

    dq0 = vary_like(jnp.zeros((b, sq, hk, g, d), acc), axes)
    if bias is not None and not bias_cols:  # one dbias for all key chunks: accumulate in the carry
        def kv_block_acc(carry, j):
            dq, db = carry
            dq, (dk_j, dv_j, db_j) = kv_block(dq, j)
            return (dq, db + db_j), (dk_j, dv_j)
        db0 = vary_like(jnp.zeros(bias.shape, acc), axes)
        (dq, dbias), (dk, dv) = lax.scan(kv_block_acc, (dq0, db0), jnp.arange(nk))
    else:
        dq, (dk, dv, db_blocks) = lax.scan(kv_block, dq0, jnp.arange(nk))
        dbias = None
        if bias is not None:  # (nk, bb, bh, sq|1, bkv) -> (bb, bh, sq|1, sk)
            dbias = jnp.einsum("nbhqs->bhqns", db_blocks).reshape(db_blocks.shape[1:4] + (sk,))
    dk = jnp.einsum("nbskd->bnskd", dk).reshape(b, sk, hk, d)
    dv = jnp.einsum("nbskd->bnskd", dv).reshape(b, sk, hk, d)
    return dq.reshape(b, sq, h, d), dk, dv, dbias
