"""Masks from true positions (causal, window, segments) and the empty-tile test used for skipping.

Mirrors ``ringattn_ref.masks`` in ``jnp``. Every mask is a function of the tokens' *true* positions,
so the same code serves the contiguous, striped and zigzag layouts (``docs/design.md``, "Mask").
Query at position ``i`` may see key at position ``j`` iff ``j <= i`` (causal), ``i - left <= j <=
i + right`` (window, ``-1`` = unbounded side) and ``seg[i] == seg[j]`` (segments).
"""
from __future__ import annotations

import jax.numpy as jnp


def allowed(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """Which (query, key) pairs may attend: bool ``[b, sq, sk]``, or ``None`` when nothing is masked.

    q_pos: int [b, sq], k_pos: int [b, sk] true positions; q_seg/k_seg: int [b, sq]/[b, sk] or None.
    """
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]  # (b, sq, 1), (b, 1, sk)
    ok = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        ok = both(ok, kp <= qp)
    if window is not None:
        left, right = window
        if left >= 0:
            ok = both(ok, kp >= qp - left)
        if right >= 0:
            ok = both(ok, kp <= qp + right)
    if q_seg is not None:
        ok = both(ok, q_seg[:, :, None] == k_seg[:, None, :])
    return ok


def can_be_empty(causal, window, has_segments):
    """Whether any tile can be provably empty; when not, callers emit no ``lax.cond`` at all."""
    return bool(causal or has_segments or (window is not None and max(window) >= 0))


def tile_is_empty(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """True (bool scalar) iff the mask is provably empty for every (query, key) pair of the tile.

    Uses only the min/max of each batch row's positions (and segment ids), so it is exact for
    contiguous tiles and conservative otherwise (``docs/design.md``, "Skipping"):
    causal ``max q_pos < min k_pos``; window ``min k_pos > max q_pos + right`` or
    ``max k_pos < min q_pos - left``; segments: the id ranges do not overlap.
    """
    q_lo, q_hi = q_pos.min(axis=1), q_pos.max(axis=1)  # (b,)
    k_lo, k_hi = k_pos.min(axis=1), k_pos.max(axis=1)  # (b,)
    empty = jnp.zeros(q_lo.shape, bool)
    if causal:
        empty |= q_hi < k_lo
    if window is not None:
        left, right = window
        if right >= 0:
            empty |= k_lo > q_hi + right
        if left >= 0:
            empty |= k_hi < q_lo - left
    if q_seg is not None:
        empty |= (q_seg.max(axis=1) < k_seg.min(axis=1)) | (q_seg.min(axis=1) > k_seg.max(axis=1))
    return jnp.all(empty)


def tile_is_full(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """True (bool scalar) iff every (query, key) pair of the tile is provably visible (no mask needed).

    causal ``min q_pos >= max k_pos``; window ``max q_pos - min k_pos <= left`` and
    ``max k_pos - min q_pos <= right``; segments: one id shared by all the tile's queries and keys.
    """
    q_lo, q_hi = q_pos.min(axis=1), q_pos.max(axis=1)  # (b,)
    k_lo, k_hi = k_pos.min(axis=1), k_pos.max(axis=1)  # (b,)
    full = jnp.ones(q_lo.shape, bool)
    if causal:
        full &= q_lo >= k_hi
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
