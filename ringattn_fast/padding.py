"""Any sequence length: pad to a length the ring splits evenly, with padding no real query sees.

The ring cuts the sequence into ``N`` equal shards (``2N`` chunks for zigzag). A sequence of another
length is padded at the end with zero tokens that belong to the *padding segment*: keys of that
segment are masked for every query, and its queries see no key (their output is 0, their lse -inf),
so the real rows, and all gradients of real tokens, are exactly those of the unpadded sequence. The
same convention serves packed data whose padding is a segment id of its own (MaxText uses 0):
``ring_attention(..., segment_ids=ids, padding_segment=0)``.

What the padding costs: up to ``parts - 1`` extra tokens (``parts = N``, or ``2N`` for zigzag), so
compute grows by about ``(S'/S)**2`` and per-device memory by ``S'/S``; and with no segment ids of
its own the call gains segment masks, so the tiles that hold padding become partial tiles. With
``S = 1000`` on 8 devices: ``S' = 1000`` (no padding); zigzag needs 16 parts: ``S' = 1008``.

Two segment ids are reserved: ``NO_KEY`` (``-2**31``) is what a padding query's id becomes (no key has
it), and ``PADDING`` (``-2**31 + 1``) is the padding segment when the caller names none. Ids whose
values are known are checked (reserved ids and ``padding_segment=NO_KEY`` are a ``ValueError``); under
``jax.jit`` no value can be checked, so none may collide: ``ring_attention`` ranks traced ids into
``[0, batch * seq)`` first (:func:`rank_segment_ids`; the caller's padding segment becomes
``PADDING``), and a per-host call, which cannot rank what other hosts hold, makes a key whose traced id
is ``NO_KEY`` a bad key (:func:`reserved_keys_bad`: every row that may see it is NaN) instead of letting
the padding queries see it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ringattn_ref.validation import INT32_MAX, check_int32_values

NO_KEY = -INT32_MAX - 1
PADDING = -INT32_MAX


def ring_length(seq, n_hosts, layout="contiguous"):
    """The shortest length ``>= seq`` that ``n_hosts`` hosts split evenly under ``layout``."""
    parts = 2 * n_hosts if isinstance(layout, str) and layout == "zigzag" else n_hosts
    return -(-seq // parts) * parts


def pad_layout(layout, seq, total):
    """``layout`` for the padded sequence: a permutation gets the padding tokens at the end (in place); a
    named layout is its own name. Idempotent: a permutation already ``total`` long is returned as is."""
    if isinstance(layout, str) or len(layout) == total:
        return layout
    return np.concatenate([np.asarray(layout), np.arange(seq, total)])


def padded_bias_shape(shape, seq, total):
    """The shape :func:`pad_for_ring` gives a bias of ``shape``: its query/key dims of length ``seq`` grow
    to ``total`` (broadcast dims stay 1)."""
    return tuple(total if axis in (2, 3) and n == seq else n for axis, n in enumerate(shape))


def padding_queries(segment_ids, padding_segment):
    """The query-side segment ids: a query of the padding segment gets ``NO_KEY`` and so sees no key."""
    if padding_segment is None:
        return segment_ids
    return jnp.where(segment_ids == padding_segment, NO_KEY, segment_ids)


def check_padding_segment(padding_segment, segment_ids):
    """An int (not a bool), and it needs segment ids to mark anything."""
    if padding_segment is None:
        return None
    if not isinstance(padding_segment, (int, np.integer)) or isinstance(padding_segment, (bool, np.bool_)):
        raise ValueError(f"padding_segment must be an int segment id or None; got {padding_segment!r}")
    if segment_ids is None:
        raise ValueError("padding_segment names a segment of segment_ids; pass segment_ids too")
    check_int32_values(np.asarray([padding_segment]), "padding_segment")
    if padding_segment == NO_KEY:
        raise ValueError(f"padding_segment must not be {NO_KEY} (padding.NO_KEY, reserved: the id a padding "
                         f"query gets, so its keys would be seen by every padding query); got {padding_segment}")
    return int(padding_segment)


def rank_segment_ids(segment_ids, padding_segment):
    """Traced integer ids (any width) as int32 ranks in ``[0, batch * seq)``: ``(ids, padding_segment)``.

    Under ``jax.jit`` the ids' values cannot be checked, so an id equal to a reserved one (``NO_KEY``,
    ``PADDING``) or beyond int32 would silently merge with the padding; ranked, equal ids stay equal
    and no id can collide. The caller's padding segment becomes ``PADDING`` (ranks are >= 0). Ids that
    are not traced (checked by value) or not integers (rejected by the checks) are returned as given.
    Costs one sort of the ``batch * seq`` ids.
    """
    if (segment_ids is None or not isinstance(segment_ids, jax.core.Tracer)
            or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        return segment_ids, padding_segment
    ranks = jnp.searchsorted(jnp.sort(segment_ids.ravel()), segment_ids).astype(jnp.int32)  # (b, s)
    if padding_segment is None:
        return ranks, None
    info = np.iinfo(segment_ids.dtype)
    if not info.min <= padding_segment <= info.max:  # no id of this dtype can be it
        return ranks, PADDING
    return jnp.where(segment_ids == padding_segment, PADDING, ranks), PADDING


def reserved_keys_bad(k, k_seg, padding_segment):
    """K all-NaN for keys whose (traced) id is ``NO_KEY`` while a padding segment is in use: k [b, s, hk, d].

    Padding queries carry ``NO_KEY`` (:func:`padding_queries`) and must see no key; a key holding that
    id would be seen by all of them. A per-host call cannot rank the ids (other hosts hold the rest), so
    such a key is made *bad* (``masks.mark_bad_keys``): every row that may see it is NaN, never a
    silently wrong number. No-op without segment ids or padding segment.
    """
    if k_seg is None or padding_segment is None:
        return k
    return jnp.where((k_seg == NO_KEY)[:, :, None, None], jnp.nan, k)


class RingPadding(NamedTuple):
    """Arrays padded by :func:`pad_for_ring` (seq -> ``ring_length``), and how to undo it.

    - q, k, v: [b, seq', ...]; segment_ids: int32 [b, seq'] (the padding tokens in
      ``padding_segment``);
    - bias: padded on its sequence dims of length seq (or None);
    - layout: extended to seq' when it was a permutation.

    Pass them on with ``padding_segment=padding_segment``; :meth:`unpad` cuts outputs back.
    """
    q: object
    k: object
    v: object
    segment_ids: object
    bias: object
    padding_segment: int | None
    layout: object
    seq: int

    def unpad(self, x, axis=1):
        """``x`` cut back to the first ``seq`` entries of ``axis`` (1 for o ``[b, s, h, d]``, 2 for lse)."""
        return x if x.shape[axis] == self.seq else jnp.take(x, jnp.arange(self.seq), axis=axis)


def pad_for_ring(q, k, v, *, n_hosts, layout="contiguous", segment_ids=None, bias=None, padding_segment=None):
    """Pad global ``[b, seq, heads, dim]`` q, k, v (and segment ids, bias) for a ring of ``n_hosts``.

    For callers of ``ring_attention_shard`` (``ring_attention`` does this itself): the padding tokens
    get ``padding_segment`` (default ``PADDING``), real tokens keep their ids (0 when none were given).
    Returns a :class:`RingPadding`; no copy when ``seq`` already splits evenly.
    """
    if not isinstance(n_hosts, (int, np.integer)) or isinstance(n_hosts, bool) or n_hosts < 1:
        raise ValueError(f"n_hosts must be a positive int; got {n_hosts!r}")
    b, seq = q.shape[:2]
    total = ring_length(seq, n_hosts, layout)
    if total == seq:
        return RingPadding(q, k, v, segment_ids, bias, padding_segment, layout, seq)
    pad = total - seq
    pad_seq = lambda x, axis=1: jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
    padding_segment = PADDING if padding_segment is None else padding_segment
    ids = jnp.zeros((b, seq), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids).astype(jnp.int32)
    ids = jnp.concatenate([ids, jnp.full((b, pad), padding_segment, jnp.int32)], axis=1)
    if bias is not None:
        for axis in (2, 3):
            bias = pad_seq(bias, axis) if bias.shape[axis] == seq else bias
    layout = pad_layout(layout, seq, total)
    return RingPadding(pad_seq(q), pad_seq(k), pad_seq(v), ids, bias, padding_segment, layout, seq)
