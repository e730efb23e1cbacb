"""Masks from true positions (causal, window, segments) and tile classification, in ``jnp``.

The vocabulary is ``ringattn_ref.masks``'s, and so is the code: :func:`allowed` (which pairs may
attend), :func:`tile_is_empty` (can a tile be skipped) and the bounds test both rest on,
:func:`bounds_empty`, are written with array operators only and serve numpy, ``jnp`` and the Pallas
kernels alike (``docs/design.md``, "Mask" and "Skipping"). This module adds what only the fast path
needs: whether a tile is *full* (every pair visible, so it runs without a mask) and the three-way
:func:`tile_kind` for ``lax.switch``.
"""
from __future__ import annotations

import jax.numpy as jnp

from ringattn_fast.kernels import IMPLS
from ringattn_ref.masks import allowed, bounds_empty, bounds_full, can_be_empty, tile_is_empty

__all__ = ["allowed", "bad_key_sums", "bounds_empty", "bounds_full", "can_be_empty", "finite_part", "mark_bad_keys",
           "mark_bad_keys_of", "marked_for_ring", "masked_grad", "tile_is_empty", "tile_is_full", "tile_kind"]


def mark_bad_keys(k, v):
    """``ringattn_ref.masks.mark_bad_keys`` in ``jnp``: V set to 0 and K to all-NaN for each key whose
    K or V holds a nan/inf. Done once per ring, before the first hop (two elementwise passes over the
    host's shard), so no hop or kernel multiplies ``0 * nan``: a masked key contributes nothing, and
    exactly the rows that may see a bad key turn NaN, in every impl. k, v: [b, s, kv_heads, d].

    A key is bad iff ``sum(k * 0) + sum(v * 0)`` over its row is NaN (``inf * 0`` and ``nan * 0`` are NaN,
    every finite value times 0 is 0): a float sum over the lanes, where ``isfinite(k).all(-1)`` reduced
    booleans at 64 GB/s on a TPU v5e (250 us per 16 MiB shard, 7 % of an 8K-token forward+backward). The
    sums stay in x's dtype (``jnp.sum`` adds 16-bit floats in float32 inside): summed as float32, XLA kept
    one more K-sized buffer in the compiled forward+backward (32 MiB more temp at 32K tokens, v5e)."""
    bad = jnp.isnan(bad_key_sums(k, v))  # (b, s, hk, 1)
    return jnp.where(bad, jnp.nan, k), jnp.where(bad, 0, v).astype(v.dtype)


def marked_for_ring(kv, impl, comm_dtype):
    """``kv`` as the hops of a ring of ``impl`` take it: marked (:func:`mark_bad_keys_of`), unless the impl's
    kernels mark the K/V tiles that hold a bad key themselves (``kernels.Impl.marks_keys``) and K/V travel
    as they are (``comm_dtype`` None; a scaled wire format would map an inf to a finite value)."""
    return kv if IMPLS[impl].marks_keys and comm_dtype is None else mark_bad_keys_of(kv)


def bad_key_sums(k, v):
    """``sum(k * 0) + sum(v * 0)`` per key and kv head, [b, s, hk, 1] in k's dtype: 0, or NaN for a key that
    :func:`mark_bad_keys` marks (the TPU kernels mark such keys' tiles themselves from these sums)."""
    return _zeros_sum(k) + _zeros_sum(v)


def _zeros_sum(x):
    """``sum(x * 0)`` over the last axis, keepdims, in x's dtype: 0, or NaN where the row holds a nan/inf."""
    return jnp.sum(x * jnp.zeros((), x.dtype), axis=-1, keepdims=True)


def mark_bad_keys_of(kv):
    """A ``schedule.KVShard`` with its K and V marked by :func:`mark_bad_keys`."""
    k, v = mark_bad_keys(kv.k, kv.v)
    return kv._replace(k=k, v=v)


def finite_part(x):
    """x with its non-finite entries set to 0: K in ``dQ = dS K``, where a masked bad key's NaN K
    would otherwise meet ``dS = 0`` as ``0 * nan`` (XLA hop and kernels alike)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def masked_grad(p, dp, delta):
    """FA-2's ``dS = P * (dP - D)``, zeroed with ``where`` where ``P`` is 0: a masked pair (and an
    underflowed one) has no gradient, even in a row that a bad key made NaN (its D is NaN)."""
    return jnp.where(p == 0, 0.0, p * (dp - delta))


def tile_is_full(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """True (bool scalar) iff every (query, key) pair of the tile is provably visible (no mask needed).

    q_pos [b, sq], k_pos [b, sk] (segments alike or None). causal ``max k_pos - min q_pos <= 0``;
    window ``max q_pos - min k_pos <= left`` and ``max k_pos - min q_pos <= right``; segments: one
    id shared by all the tile's queries and keys. Differences only, as in :func:`bounds_empty`.
    """
    q_lo, q_hi = q_pos.min(axis=1), q_pos.max(axis=1)  # (b,)
    k_lo, k_hi = k_pos.min(axis=1), k_pos.max(axis=1)  # (b,)
    full = jnp.ones(q_lo.shape, bool)
    if causal:
        full &= k_hi - q_lo <= 0
    if window is not None:
        left, right = window
        if left >= 0:
            full &= q_hi - k_lo <= left
        if right >= 0:
            full &= k_hi - q_lo <= right
    if q_seg is not None:
        s_lo = jnp.minimum(q_seg.min(axis=1), k_seg.min(axis=1))
        s_hi = jnp.maximum(q_seg.max(axis=1), k_seg.max(axis=1))
        full &= s_lo == s_hi
    return jnp.all(full)


def tile_kind(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """0 = empty (skip), 1 = full (no mask), 2 = partial (apply the mask): an index for ``lax.switch``."""
    kw = dict(causal=causal, window=window)
    empty = tile_is_empty(q_pos, k_pos, q_seg, k_seg, **kw)
    full = tile_is_full(q_pos, k_pos, q_seg, k_seg, **kw)
    return jnp.where(empty, 0, jnp.where(full, 1, 2)).astype(jnp.int32)
