"""Packed data in ``jnp`` (jit-able): ``ringattn_ref.packing``'s two functions, same results.

``segment_ids_from_cu_seqlens(cu_seqlens, seq)`` (documents numbered from 1, padding 0) and
``positions_from_segment_ids(segment_ids)`` (positions restart per document, as rotary embeddings
want). A 1-D ``cu_seqlens`` is one packed row: its ids are ``[1, seq]``, what ``segment_ids=`` takes;
positions keep the shape of the ids. ``cu_seqlens`` is checked (non-negative, non-decreasing, at most
``seq``) when its values are known; under ``jax.jit`` it cannot be, and invalid values give ids of no
meaning, never an error.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ringattn_ref.packing import check_cu_seqlens


def segment_ids_from_cu_seqlens(cu_seqlens, seq):
    """int32 ``[batch, seq]`` from ``cu_seqlens`` ``[batch, n_docs + 1]`` (``[n_docs + 1]``: one row, ids
    ``[1, seq]``): token ``t`` in ``[cu[d], cu[d + 1])`` is in document ``d + 1``; tokens before ``cu[0]``
    or from ``cu[-1]`` on are padding (0)."""
    if not isinstance(cu_seqlens, jax.core.Tracer):
        check_cu_seqlens(cu_seqlens, seq)
    cu = jnp.atleast_2d(jnp.asarray(cu_seqlens)).astype(jnp.int32)
    t = jnp.arange(seq, dtype=jnp.int32)
    doc = jax.vmap(lambda c: jnp.searchsorted(c[1:], t, side="right"))(cu) + 1  # (b, seq)
    return jnp.where((t >= cu[:, :1]) & (t < cu[:, -1:]), doc, 0).astype(jnp.int32)  # (b, seq); b = 1 for 1-D cu


def positions_from_segment_ids(segment_ids):
    """int32 shaped like ``segment_ids`` (``[seq]`` or ``[batch, seq]``): each token's position inside its
    document (a run of equal ids)."""
    ids = jnp.atleast_2d(jnp.asarray(segment_ids))
    t = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    start = jnp.concatenate([jnp.ones(ids.shape[:1] + (1,), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    pos = t - lax.cummax(jnp.where(start, t, 0), axis=1)
    return pos[0] if jnp.ndim(segment_ids) == 1 else pos
