"""Packed data: documents given as ``cu_seqlens``, segment ids, and positions that restart per document.

Long-context training packs several documents into one sequence. FlashAttention's varlen API describes
the packing by cumulative lengths ``cu_seqlens = [0, len_0, len_0 + len_1, ...]``; masks want segment
ids (``docs/design.md``, "Mask"); rotary embeddings want each token's position *inside its document*.
Example, ``cu_seqlens = [0, 3, 5]`` in a sequence of 7 tokens::

    segment ids  1 1 1 2 2 0 0      documents numbered from 1; 0 = padding (MaxText's convention)
    positions    0 1 2 0 1 0 1      restart where the id changes

With ``ring_attention(..., segment_ids=ids, padding_segment=0)`` the padding keys are masked for
everyone and the padding queries return 0. Shapes: ``cu_seqlens`` ``[n_docs + 1]`` is one packed
row and gives ids ``[1, seq]`` (a batch of one, what ``segment_ids=`` takes); ``[batch, n_docs + 1]``
gives ``[batch, seq]``. ``positions_from_segment_ids`` returns the shape it is given.
``ringattn_fast`` has the same two functions in ``jnp`` (jit-able, equal results).
"""
from __future__ import annotations

import numpy as np


def check_cu_seqlens(cu_seqlens, seq):
    """``cu_seqlens``: int ``[n + 1]`` or ``[batch, n + 1]``, non-negative, non-decreasing, at most ``seq``."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim not in (1, 2) or cu.shape[-1] < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be an int array [n_docs + 1] or [batch, n_docs + 1]; got shape "
                         f"{cu.shape}, dtype {cu.dtype}")
    if (cu < 0).any() or (np.diff(cu, axis=-1) < 0).any() or (cu > seq).any():
        raise ValueError(f"cu_seqlens must be non-negative, non-decreasing and at most seq = {seq} "
                         f"(cumulative document lengths, e.g. [0, 3, 5]); got {cu.tolist()}")
    return cu


def segment_ids_from_cu_seqlens(cu_seqlens, seq):
    """Segment ids int32 ``[batch, seq]`` from cumulative lengths, ready for ``segment_ids=``.

    cu_seqlens: int ``[batch, n_docs + 1]``, or ``[n_docs + 1]`` for one packed row, which gives
    ``[1, seq]`` (a batch of one: the attention functions take ``[batch, seq]`` segment ids).
    Token ``t`` with ``cu[d] <= t < cu[d + 1]`` belongs to document ``d + 1``; tokens before ``cu[0]`` or
    from ``cu[-1]`` on are padding, id 0. ``cu_seqlens = [0, 3, 5]``, seq 7 -> ``[[1, 1, 1, 2, 2, 0, 0]]``.
    """
    cu = check_cu_seqlens(cu_seqlens, seq)
    t = np.arange(seq)
    rows = [np.where((t >= c[0]) & (t < c[-1]), np.searchsorted(c[1:], t, side="right") + 1, 0)
            for c in np.atleast_2d(cu)]
    return np.stack(rows).astype(np.int32)  # [batch, seq]; one row for 1-D cu_seqlens


def positions_from_segment_ids(segment_ids):
    """Each token's position inside its document, int32 like ``segment_ids`` (``[seq]`` or ``[batch, seq]``).

    A document starts wherever the id changes (so two adjacent documents need different ids):
    ``[1, 1, 1, 2, 2, 0, 0] -> [0, 1, 2, 0, 1, 0, 1]``.
    """
    ids = np.asarray(segment_ids)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"segment_ids must be an int array [seq] or [batch, seq]; got shape {ids.shape}, "
                         f"dtype {ids.dtype}")
    rows = np.atleast_2d(ids)
    t = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
    start = np.ones(rows.shape, bool)
    start[:, 1:] = rows[:, 1:] != rows[:, :-1]
    pos = (t - np.maximum.accumulate(np.where(start, t, 0), axis=1)).astype(np.int32)
    return pos[0] if ids.ndim == 1 else pos
