"""Merging partial attention results, safe when a part saw no key (``lse = -inf``); the accumulation dtype.

Mirrors ``ringattn_ref.softmax.merge``. Two results over disjoint key sets, each normalised within its
part, combine exactly (the blockwise merge of Rabe & Staats, arXiv:2112.05682 §3, on Milakov &
Gimelshein's online normaliser, arXiv:1805.02867; FlashAttention-2 rescales a running sum instead):
``lse = logaddexp(lse1, lse2)``, ``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``. With both
``lse = -inf`` the textbook formula is ``nan``; here it gives ``o = 0, lse = -inf``. The ring folds its
hops with :func:`merge_into`, which keeps ``lse`` as ``(m, l)`` until the end (one rounding, not ``N``).
"""
from __future__ import annotations

import jax.numpy as jnp


def acc_dtype(dtype):
    """The dtype a hop accumulates in: float64 stays float64; every other float accumulates in float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def merge(o1, lse1, o2, lse2):
    """Combine ``(o1, lse1)`` and ``(o2, lse2)``; o: [b, s, h, d], lse: [b, h, s] (same dtype)."""
    m = jnp.maximum(lse1, lse2)  # (b, h, s)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # both -inf: weights below are exp(-inf) = 0
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)  # (b, h, s)
    total = w1 + w2
    lse = m + jnp.log(total)  # log(0) = -inf for rows no part saw
    inv = 1.0 / jnp.where(total == 0, 1.0, total)
    c1 = jnp.einsum("bhs->bsh", w1 * inv)[..., None]  # (b, s, h, 1)
    c2 = jnp.einsum("bhs->bsh", w2 * inv)[..., None]
    return c1 * o1 + c2 * o2, lse


def merge_into(o, m, l, o_hop, lse_hop):
    """Fold one hop's ``(o_hop, lse_hop)`` into a running ``(o, m, l)``: the result so far, normalised,
    over keys whose logsumexp is ``m + log(l)``; returns the new ``(o, m, l)`` (:func:`running_lse` ends it).

    The same sum as :func:`merge`, but the large part of the logsumexp (``m``, the largest hop lse so far)
    is kept apart from the sum of weights ``l``: merging lse itself rounds a number near ``max logit``
    (20, say: 1e-6 in float32) at every hop, and ``N`` such roundings add up in ``lse`` -- which the
    backward turns into ``P = exp(S - lse)`` for every key: with 256 queries on 8 keys over 8 hosts, dV
    off by 1.7e-5 against 1.1e-5. Here each hop's lse is rounded once, and the sum at the end.
    o: [b, s, h, d]; m, l, lse_hop: [b, h, s]; start from ``m = -inf, l = 0``.
    """
    m_new = jnp.maximum(m, lse_hop)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key yet on either side: both weights 0
    old, new = l * jnp.exp(m - m_safe), jnp.exp(lse_hop - m_safe)  # (b, h, s)
    l_new = old + new
    inv = 1.0 / jnp.where(l_new == 0, 1.0, l_new)
    c_old = jnp.einsum("bhs->bsh", old * inv)[..., None]  # (b, s, h, 1)
    c_new = jnp.einsum("bhs->bsh", new * inv)[..., None]
    return c_old * o + c_new * o_hop, m_new, l_new


def running_lse(m, l):
    """The logsumexp of a running ``(m, l)`` (:func:`merge_into`): ``m + log(l)``, ``-inf`` where no key was seen."""
    return jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))


def add_sinks(o, lse, sinks):
    """Attention sinks (gpt-oss): a logit per query head that joins every row's softmax denominator and
    brings no value, applied to a result normalised over the keys: ``lse' = logaddexp(lse, sink)``,
    ``o' = exp(lse - lse') o`` (the merge above with a part whose o is 0). o [b, s, h, d] (its dtype
    kept), lse [b, h, s] float, sinks [h]; a row that saw nothing keeps ``o = 0`` and gets
    ``lse' = sink``. Differentiable in all three (the ring's backward takes lse's cotangent), so every
    impl and strategy gets sinks, and their gradient, from this one function.
    """
    total = jnp.logaddexp(lse, jnp.asarray(sinks).astype(lse.dtype)[None, :, None])  # (b, h, s)
    w = jnp.einsum("bhs->bsh", jnp.exp(lse - total))[..., None]  # (b, s, h, 1); 0 where lse = -inf
    return (w * o.astype(w.dtype)).astype(o.dtype), total
