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

import functools
import operator

import numpy as np


def _reach(causal, window):
    """``(left, right)``: how far back and ahead of a query a key may sit (-1 = unbounded), the window's
    bounds with causal capping ``right`` at 0; the two bounds tests below share it."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def bounds_empty(q, k, *, causal=False, window=None):
    """True where no (query, key) pair can attend, from position (and segment id) bounds.

    - q, k: the bounds of the queries and of the keys, ``(pos_lo, pos_hi)`` or, with segment ids,
      ``(pos_lo, pos_hi, seg_lo, seg_hi)`` (both sides alike); each entry any broadcasting array
      (numpy, jax.numpy) or a scalar (a kernel's prefetched bounds);
    - window: ``(left, right)`` normalised by ``validation.check_window`` (-1 = unbounded) or None.

    Every allowed pair has ``-left <= k - q <= right`` (``right = 0`` when causal) and equal segment
    ids, so the tile is empty when ``k_lo - q_hi > right``, ``q_lo - k_hi > left`` or the id ranges do
    not overlap. Returns None when nothing can be masked (no causal, window or segments).

    Example, causal: queries [0, 1] against keys [2, 3], ``bounds_empty((0, 1), (2, 3), causal=True)``:
    ``2 - 1 > 0``, empty.
    """
    (q_lo, q_hi, *q_seg), (k_lo, k_hi, *k_seg) = q, k
    left, right = _reach(causal, window)
    empty = []
    if right >= 0:
        empty.append(k_lo - q_hi > right)
    if left >= 0:
        empty.append(q_lo - k_hi > left)
    if q_seg:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg, k_seg
        empty.append((qs_hi < ks_lo) | (ks_hi < qs_lo))
    return functools.reduce(operator.or_, empty) if empty else None


def bounds_full(q, k, *, causal=False, window=None):
    """True where every (query, key) pair of a tile is visible, from the bounds :func:`bounds_empty` takes
    (the converse test, differences only, as there); None when nothing can be masked. A full tile runs
    without a mask (the XLA hop, the Pallas kernels, the block mask's kinds).

    Example, causal: queries [4, 7] against keys [0, 3], ``bounds_full((4, 7), (0, 3), causal=True)``:
    ``3 - 4 <= 0``, full.
    """
    (q_lo, q_hi, *q_seg), (k_lo, k_hi, *k_seg) = q, k
    left, right = _reach(causal, window)
    full = []
    if right >= 0:
        full.append(k_hi - q_lo <= right)
    if left >= 0:
        full.append(q_hi - k_lo <= left)
    if q_seg:  # one id on both sides
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg, k_seg
        full.append((qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo))
    return functools.reduce(operator.and_, full) if full else None


def _bounds(pos, seg, lo, hi):
    """``(lo(pos), hi(pos))`` or, with segment ids, ``(lo(pos), hi(pos), lo(seg), hi(seg))``."""
    return (lo(pos), hi(pos)) if seg is None else (lo(pos), hi(pos), lo(seg), hi(seg))


def allowed(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """Which (query, key) pairs may attend: bool, the broadcast shape of the inputs.

    q_pos, k_pos: int arrays that broadcast against each other, a column of queries against a row of
    keys: ``[b, sq, 1]`` and ``[b, 1, sk]`` give ``[b, sq, sk]`` (a kernel passes ``(bq, 1)`` and
    ``(1, bk)``); q_seg/k_seg shaped like them, or None. A pair is the tile ``[i, i] x [j, j]``, so
    this is ``~bounds_empty`` on points. Example, causal: ``allowed(pos[:, None], pos[None, :],
    causal=True)`` is the lower triangle.
    """
    point = lambda x: x  # noqa: E731  a pair's min and max are its own position (and id)
    empty = bounds_empty(_bounds(q_pos, q_seg, point, point), _bounds(k_pos, k_seg, point, point),
                         causal=causal, window=window)
    if empty is None:  # nothing is masked: all True, in the broadcast shape
        offset = k_pos - q_pos
        return offset == offset
    return ~empty


def tile_is_empty(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """True when the mask is provably empty for every (query, key) pair of a tile (a hop is one tile).

    q_pos: int [b, sq], k_pos: int [b, sk] true positions (one row per example); q_seg/k_seg the
    same shapes or None. Only each row's min/max are used, so the test is cheap, works for any layout,
    and is conservative: it never calls a tile empty that holds a pair the mask allows. Works on numpy
    and jnp arrays; returns a bool scalar (False when nothing can be masked).
    """
    lo, hi = (lambda x: x.min(axis=-1)), (lambda x: x.max(axis=-1))
    empty = bounds_empty(_bounds(q_pos, q_seg, lo, hi), _bounds(k_pos, k_seg, lo, hi),
                         causal=causal, window=window)  # (b,)
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
