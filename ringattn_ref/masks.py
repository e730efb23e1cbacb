"""Masks from true token positions, and the empty-tile test used to skip work: one vocabulary.

A query at true position ``i`` may see a key at true position ``j`` iff all of (``docs/design.md``):

- ``causal``: ``j <= i``;
- ``window=(left, right)``: ``i - left <= j <= i + right`` (``-1`` = unbounded on that side);
- ``segment_ids``: ``seg[i] == seg[j]`` (packed sequences do not see each other).

Positions are always true positions, so the same functions serve every layout: with the striped
layout host 1 of 4 owns positions ``[1, 5, 9, ...]`` and the mask is computed from those numbers.

Everything rests on one test, :func:`bounds_empty`: given the min/max of the query positions (and
segment ids) of a tile and those of its keys, can *no* pair of the tile attend? A single pair is a
tile whose min equals its max, so :func:`allowed` (pairs) and :func:`tile_is_empty` (tiles) are the
same test, and ``ringattn_fast`` and the Pallas kernels call it too (on jnp arrays, or on the
scalars a kernel prefetched). It uses only comparisons of *differences* of positions
(``k_lo - q_hi > right``, never ``q_hi + right``), so int32 positions in ``[0, 2**31)`` never overflow.
"""
from __future__ import annotations

import numpy as np


def bounds_empty(q_lo, q_hi, k_lo, k_hi, qs_lo=None, qs_hi=None, ks_lo=None, ks_hi=None, *,
                 causal=False, window=None):
    """True where no (query, key) pair can attend, from position (and segment id) bounds.

    - q_lo/q_hi: min/max query position; k_lo/k_hi: min/max key position;
    - ``qs_*`` / ``ks_*``: min/max segment ids or None;
    - any broadcasting arrays (numpy, jax.numpy) or scalars;
    - window: ``(left, right)`` normalised by ``validation.check_window`` (-1 = unbounded) or None.

    Every allowed pair has
    ``-left <= k - q <= right`` (``right = 0`` when causal) and equal segment ids, so the tile is
    empty when ``k_lo - q_hi > right``, ``q_lo - k_hi > left`` or the id ranges do not overlap.
    Returns None when nothing can be masked (no causal, window or segments).

    Example, causal: queries [0, 1] against keys [2, 3] give ``2 - 1 > 0``: empty.
    """
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    empty = []
    if right >= 0:
        empty.append(k_lo - q_hi > right)
    if left >= 0:
        empty.append(q_lo - k_hi > left)
    if qs_lo is not None:
        empty.append((qs_hi < ks_lo) | (ks_hi < qs_lo))
    if not empty:
        return None
    out = empty[0]
    for e in empty[1:]:
        out = out | e
    return out


def allowed(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """Which (query, key) pairs may attend: bool, the broadcast shape of the inputs, or None.

    q_pos, k_pos: int arrays that broadcast against each other, a column of queries against a row of
    keys: ``[b, sq, 1]`` and ``[b, 1, sk]`` give ``[b, sq, sk]`` (a kernel passes ``(bq, 1)`` and
    ``(1, bk)``); q_seg/k_seg shaped like them, or None. A pair is the tile ``[i, i] x [j, j]``, so
    this is ``~bounds_empty`` on points. Example, causal: ``allowed(pos[:, None], pos[None, :],
    causal=True)`` is the lower triangle.
    """
    empty = bounds_empty(q_pos, q_pos, k_pos, k_pos, q_seg, q_seg, k_seg, k_seg, causal=causal,
                         window=window)
    if empty is None:  # nothing is masked: all True, in the broadcast shape
        offset = k_pos - q_pos
        return offset == offset
    return ~empty


def tile_is_empty(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """True when the mask is provably empty for every (query, key) pair of a tile or a hop.

    q_pos: int [b, sq], k_pos: int [b, sk] true positions (one row per example); q_seg/k_seg the
    same shapes or None. Only each row's min/max are used, so the test is cheap, works for any layout,
    and is conservative: it never skips a pair that the mask allows. Works on numpy and jnp arrays;
    returns a bool scalar (False when nothing can be masked).
    """
    seg = () if q_seg is None else (q_seg.min(axis=-1), q_seg.max(axis=-1),
                                    k_seg.min(axis=-1), k_seg.max(axis=-1))
    empty = bounds_empty(q_pos.min(axis=-1), q_pos.max(axis=-1), k_pos.min(axis=-1),
                         k_pos.max(axis=-1), *seg, causal=causal, window=window)  # (b,)
    return False if empty is None else empty.all()


def can_be_empty(causal, window, has_segments):
    """Whether any pair can be masked at all; when not, callers emit no mask and no skip test."""
    return bool(causal or has_segments or (window is not None and max(window) >= 0))


def mark_bad_keys(k, v):
    """Non-finite keys, made harmless to every query that may not see them: ``(k, v)`` float64.

    k, v: [b, s, kv_heads, d]. A key whose K or V holds a nan/inf is *bad*: its V is set to 0 (so
    ``0 * nan`` never reaches a query that gives it weight 0) and its K to all-NaN (so exactly the
    queries that may attend to it get a NaN logit, hence a NaN row, while the mask turns every other
    pair's logit into -inf). A masked key therefore contributes nothing, whatever it holds, and how
    many rows a visible NaN reaches never depends on the tiling (``docs/design.md``).
    """
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    bad = ~(np.isfinite(k).all(-1) & np.isfinite(v).all(-1))[..., None]  # (b, s, hk, 1)
    return np.where(bad, np.nan, k), np.where(bad, 0.0, v)


def as_rows(pos, batch):
    """Positions as per-example rows: int ``[seq]`` or ``[1|batch, seq]`` -> ``[batch, seq]``."""
    pos = np.asarray(pos)
    return np.broadcast_to(pos if pos.ndim == 2 else pos[None], (batch, pos.shape[-1]))
