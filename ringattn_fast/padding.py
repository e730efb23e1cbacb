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


def padded_bias_shape(shape, seq, total, kv_seq=None, kv_total=None):
    """The shape :func:`pad_for_ring` gives a bias of ``shape``: its query dim of length ``seq`` grows to
    ``total`` and its key dim of length ``kv_seq`` (default ``seq``) to ``kv_total`` (broadcast dims stay 1)."""
    kv_seq, kv_total = (seq, total) if kv_seq is None else (kv_seq, kv_total)
    grow = {2: (seq, total), 3: (kv_seq, kv_total)}
    return tuple(grow[axis][1] if axis in grow and n == grow[axis][0] else n for axis, n in enumerate(shape))


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


def rank_segment_ids(segment_ids, padding_segment, kv_segment_ids=None):
    """Traced integer ids (any width) as int32 ranks in ``[0, batch * seq)``: ``(ids, padding_segment)``,
    or ``(ids, padding_segment, kv_ids)`` when ``kv_segment_ids`` (the keys' ids of a cross-attention) is
    given: both ranked together, so equal ids stay equal across the two.

    Under ``jax.jit`` the ids' values cannot be checked, so an id equal to a reserved one (``NO_KEY``,
    ``PADDING``) or beyond int32 would silently merge with the padding; ranked, equal ids stay equal
    and no id can collide. The caller's padding segment becomes ``PADDING`` (ranks are >= 0). Ids that
    are not traced (checked by value) or not integers (rejected by the checks) are returned as given.
    Costs one sort of the ``batch * seq`` ids.
    """
    if kv_segment_ids is not None:
        if segment_ids is None or not any(isinstance(x, jax.core.Tracer) for x in (segment_ids, kv_segment_ids)):
            return segment_ids, padding_segment, kv_segment_ids
        t, wide = segment_ids.shape[1], jnp.result_type(segment_ids.dtype, kv_segment_ids.dtype)
        both = jnp.concatenate([segment_ids.astype(wide), kv_segment_ids.astype(wide)], axis=1)  # (b, t + s)
        ids, padding_segment = rank_segment_ids(both, padding_segment)
        return ids[:, :t], padding_segment, ids[:, t:]
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

    - q: [b, t', ...]; k, v: [b, s', ...]; segment_ids: int32 [b, t'] (the padding tokens in
      ``padding_segment``), kv_segment_ids: int32 [b, s'] or None (then the keys' ids are
      ``segment_ids``: self-attention);
    - bias: padded on its query dim of length t and key dim of length s (or None);
    - layout: extended to seq' when it was a permutation.

    Pass them on with ``padding_segment=padding_segment``; :meth:`unpad` cuts outputs back to ``seq``
    (the queries' length t).
    """
    q: object
    k: object
    v: object
    segment_ids: object
    bias: object
    padding_segment: int | None
    layout: object
    seq: int
    kv_segment_ids: object = None

    def unpad(self, x, axis=1):
        """``x`` cut back to the first ``seq`` entries of ``axis`` (1 for o ``[b, s, h, d]``, 2 for lse)."""
        return x if x.shape[axis] == self.seq else jnp.take(x, jnp.arange(self.seq), axis=axis)


def pad_for_ring(q, k, v, *, n_hosts, layout="contiguous", segment_ids=None, bias=None, padding_segment=None,
                 kv_segment_ids=None):
    """Pad global ``[b, seq, heads, dim]`` q, k, v (and segment ids, bias) for a ring of ``n_hosts``.

    For callers of ``ring_attention_shard`` (``ring_attention`` does this itself): the padding tokens
    get ``padding_segment`` (default ``PADDING``), real tokens keep their ids (0 when none were given).
    Cross-attention (q of length t, k and v of length s): each side is padded on its own, and the keys
    get ids of their own (``kv_segment_ids``, zeros when none were given). Returns a
    :class:`RingPadding`; no copy when both lengths already split evenly.
    """
    if not isinstance(n_hosts, (int, np.integer)) or isinstance(n_hosts, bool) or n_hosts < 1:
        raise ValueError(f"n_hosts must be a positive int; got {n_hosts!r}")
    b, t = q.shape[:2]
    s = k.shape[1]
    if t != s and segment_ids is not None and kv_segment_ids is None:
        raise ValueError(f"segment_ids has the queries' length t = {t}; with keys of another length s = {s} pass "
                         f"kv_segment_ids [batch, s] too")
    t_ring, s_ring = ring_length(t, n_hosts, layout), ring_length(s, n_hosts, layout)
    if (t_ring, s_ring) == (t, s):
        return RingPadding(q, k, v, segment_ids, bias, padding_segment, layout, t, kv_segment_ids)
    padding_segment = PADDING if padding_segment is None else padding_segment

    def pad_to(x, total, axis=1):
        pad = total - x.shape[axis]
        return jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])

    def ids(x, n, total):
        x = jnp.zeros((b, n), jnp.int32) if x is None else jnp.asarray(x).astype(jnp.int32)
        return jnp.concatenate([x, jnp.full((b, total - n), padding_segment, jnp.int32)], axis=1)

    q_ids = ids(segment_ids, t, t_ring)
    kv_ids = None if t == s and kv_segment_ids is None else ids(kv_segment_ids, s, s_ring)
    if bias is not None:
        bias = pad_to(bias, t_ring, 2) if bias.shape[2] == t else bias
        bias = pad_to(bias, s_ring, 3) if bias.shape[3] == s else bias
    layout = pad_layout(layout, t, t_ring)
    return RingPadding(pad_to(q, t_ring), pad_to(k, s_ring), pad_to(v, s_ring), q_ids, bias, padding_segment,
                       layout, t, kv_ids)
