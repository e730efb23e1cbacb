"""Masks from true token positions, and the tile/hop emptiness test used to skip work.

A query at true position ``i`` may see a key at true position ``j`` iff all of (``docs/design.md``):

- ``causal``: ``j <= i``;
- ``window=(left, right)``: ``i - left <= j <= i + right`` (``-1`` = unbounded on that side);
- ``segment_ids``: ``seg[i] == seg[j]`` (packed sequences do not see each other).

Positions are always true positions, so the same functions serve every layout: with the striped
layout host 1 of 4 owns positions ``[1, 5, 9, ...]`` and the mask is computed from those numbers.
"""
from __future__ import annotations

import numpy as np


def visible(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=False, window=None):
    """Which keys each query may see: bool ``[batch|1, sq, sk]``.

    q_pos: int [sq], k_pos: int [sk] true positions; q_seg: int [batch, sq], k_seg: int [batch, sk]
    segment ids or None; window: ``(left, right)`` already normalised by ``check_window`` or None.
    """
    i = np.asarray(q_pos)[:, None]  # (sq, 1)
    j = np.asarray(k_pos)[None, :]  # (1, sk)
    ok = np.ones((i.shape[0], j.shape[1]), dtype=bool)  # (sq, sk)
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    ok = ok[None]  # (1, sq, sk)
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == k_seg[:, None, :])  # (b, sq, sk)
    return ok


def tile_is_empty(q_pos, k_pos, *, causal=False, window=None):
    """True when the mask is provably empty for every (query, key) pair of a tile or a hop.

    Only the min/max of the positions are used, so the test is cheap, works for any layout and is
    conservative: it never skips a pair that the mask allows (segment ids are not used). Every allowed
    pair satisfies ``q - left <= k <= q + r`` with ``r = min(right, 0 if causal)``, so the tile is
    empty when ``min k > max q + r`` or ``max k < min q - left``. Example, causal contiguous, 4 hosts,
    8 tokens: host 0 (queries [0, 1]) holding K/V block 1 (keys [2, 3]) has ``2 > 1 + 0``: skip.
    """
    q_lo, q_hi = int(np.min(q_pos)), int(np.max(q_pos))
    k_lo, k_hi = int(np.min(k_pos)), int(np.max(k_pos))
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0 and k_lo > q_hi + right:
        return True
    if left >= 0 and k_hi < q_lo - left:
        return True
    return False
