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

from ringattn_ref.masks import allowed, bounds_empty, can_be_empty, tile_is_empty

__all__ = ["allowed", "bounds_empty", "bounds_full", "can_be_empty", "finite_part", "mark_bad_keys", "mark_bad_keys_of",
           "masked_grad", "tile_is_empty", "tile_is_full", "tile_kind"]


def mark_bad_keys(k, v):
    """``ringattn_ref.masks.mark_bad_keys`` in ``jnp``: V set to 0 and K to all-NaN for each key whose
    K or V holds a nan/inf. Done once per ring, before the first hop (two elementwise passes over the
    host's shard), so no hop or kernel multiplies ``0 * nan``: a masked key contributes nothing, and
    exactly the rows that may see a bad key turn NaN, in every impl. k, v: [b, s, kv_heads, d]."""
    bad = ~(jnp.isfinite(k).all(-1, keepdims=True) & jnp.isfinite(v).all(-1, keepdims=True))  # (b, s, hk, 1)
    return jnp.where(bad, jnp.nan, k), jnp.where(bad, 0, v).astype(v.dtype)


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


def bounds_full(q, k, *, causal=False, window=None):
    """True where every (query, key) pair of a tile is visible, from the bounds `bounds_empty` takes
    (``(pos_lo, pos_hi[, seg_lo, seg_hi])`` per side, scalars or arrays): the test of
    :func:`tile_is_full`, for a kernel's prefetched bounds, so a full tile runs without a mask. None
    when nothing can be masked. Example, causal: queries [4, 7], keys [0, 3]: ``3 - 4 <= 0``, full."""
    (q_lo, q_hi, *q_seg), (k_lo, k_hi, *k_seg) = q, k
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    full = []
    if right >= 0:
        full.append(k_hi - q_lo <= right)
    if left >= 0:
        full.append(q_hi - k_lo <= left)
    if q_seg:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg, k_seg
        full.append((qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo))
    if not full:
        return None
    out = full[0]
    for f in full[1:]:
        out = out & f
    return out


def tile_kind(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """0 = empty (skip), 1 = full (no mask), 2 = partial (apply the mask): an index for ``lax.switch``."""
    kw = dict(causal=causal, window=window)
    empty = tile_is_empty(q_pos, k_pos, q_seg, k_seg, **kw)
    full = tile_is_full(q_pos, k_pos, q_seg, k_seg, **kw)
    return jnp.where(empty, 0, jnp.where(full, 1, 2)).astype(jnp.int32)
