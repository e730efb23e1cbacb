"""Load-balanced sequence layouts: contiguous, striped, zigzag, or any permutation.

With a causal mask and the contiguous layout, host 0's queries see only its own keys while host N-1's
see everything: the critical path is set by the busiest host. Reordering tokens before sharding fixes
that (``docs/design.md``, "Layouts"):

- ``"striped"`` (Brandon et al. 2023, Striped Attention): host ``d`` owns tokens ``d, d+N, d+2N, ...``.
  With 4 hosts and 8 tokens: host 0 owns [0, 4], host 1 [1, 5], host 2 [2, 6], host 3 [3, 7].
- ``"zigzag"``: cut the sequence into ``2N`` chunks; host ``r`` owns chunks ``r`` and ``2N-1-r``.
  With 4 hosts and 8 tokens: host 0 owns [0, 7], host 1 [1, 6], host 2 [2, 5], host 3 [3, 4].

``perm[p]`` is the true position of the token at layout position ``p``; host ``r`` owns layout slice
``r*S/N : (r+1)*S/N``. Masks always use true positions, so every layout computes the same attention.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .validation import check_layout, check_n_hosts


def layout_permutation(layout, seq, n_hosts):
    """The permutation ``perm`` (int array [seq]) for ``layout`` with ``n_hosts`` hosts."""
    layout = check_layout(layout, seq)
    check_n_hosts(n_hosts, seq, layout)
    if not isinstance(layout, str):
        return layout.astype(np.int64)
    pos = np.arange(seq)
    if layout == "contiguous":
        return pos
    if layout == "striped":
        return pos.reshape(seq // n_hosts, n_hosts).T.reshape(-1)  # host d: d, d+N, ...
    chunks = pos.reshape(2 * n_hosts, seq // (2 * n_hosts))  # zigzag: (2N, chunk)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n_hosts - 1 - r]])
                           for r in range(n_hosts)])


def to_layout(x, layout, n_hosts):
    """Reorder axis 1 (the sequence) of ``x`` from true order into ``layout`` order.

    x: [batch, seq, ...] -> [batch, seq, ...]; host r then owns the r-th contiguous shard.
    """
    perm = layout_permutation(layout, x.shape[1], n_hosts)
    return np.take(x, perm, axis=1)


def from_layout(x, layout, n_hosts):
    """Inverse of :func:`to_layout`: bring axis 1 back to the tokens' true order."""
    perm = layout_permutation(layout, x.shape[1], n_hosts)
    return np.take(x, np.argsort(perm), axis=1)


class Layout(NamedTuple):
    """A layout as a permutation and its inverse: ``perm[p]`` is the true position of the token at layout
    position ``p`` (host ``r`` owns ``perm[r*S/N : (r+1)*S/N]``), ``inverse[t]`` the layout position of
    true position ``t`` (``x_layout = x[:, perm]``, ``x = x_layout[:, inverse]``).

    Pass ``layout=lay.perm`` to ``ring_attention`` (ref or fast: a permutation array is a layout, applied
    and undone outside the ring), or ``positions=lay.positions(batch)`` with ``ringattn_fast.to_layout``.
    Built by :func:`per_document_zigzag` and ``balance.balanced_layout``; :func:`as_layout` checks one.
    """
    perm: np.ndarray
    inverse: np.ndarray

    def positions(self, batch=1):
        """``perm`` as int32 ``[batch, seq]`` (every row the same): ``to_layout(x, positions=...)``'s form."""
        return np.broadcast_to(self.perm.astype(np.int32), (batch, self.perm.size)).copy()


def as_layout(layout, seq, n_hosts=None, *, name="layout"):
    """A :class:`Layout` from a layout name, a permutation array or a :class:`Layout` (its inverse checked).

    A permutation must hold every position of ``range(seq)`` once; a ValueError names the argument, its
    length and the positions that are missing and repeated (``[0, 2, 2]``: 1 missing, 2 twice).
    """
    if isinstance(layout, Layout):
        perm = _check_perm(layout.perm, seq, name)
        inv = np.asarray(layout.inverse)
        if inv.shape != perm.shape or not np.array_equal(inv[perm], np.arange(seq)):
            raise ValueError(f"{name}.inverse must be the inverse of {name}.perm (inverse[perm] == "
                             f"range({seq})); got shape {inv.shape}")
        return Layout(perm, inv.astype(np.int64))
    if isinstance(layout, str):
        perm = layout_permutation(layout, seq, n_hosts)
    else:
        perm = _check_perm(layout, seq, name)
        if n_hosts is not None:
            check_n_hosts(n_hosts, seq, perm)
    return Layout(perm, np.argsort(perm))


def _check_perm(perm, seq, name):
    perm = np.asarray(perm)
    if perm.ndim != 1 or perm.shape[0] != seq or not np.issubdtype(perm.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D int permutation of length seq = {seq}; got shape {perm.shape}, "
                         f"dtype {perm.dtype}")
    inside = perm[(perm >= 0) & (perm < seq)]
    counts = np.bincount(inside, minlength=seq)
    if inside.size != seq or (counts != 1).any():
        missing, repeated = np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)
        outside = perm[(perm < 0) | (perm >= seq)]
        raise ValueError(f"{name} is not a permutation of range({seq}): {missing.size} positions missing "
                         f"{missing[:8].tolist()}, {repeated.size} repeated {repeated[:8].tolist()}, "
                         f"{outside.size} outside {outside[:8].tolist()}")
    return perm.astype(np.int64)


def check_doc_lengths(doc_lengths, seq_len=None, *, name="doc_lengths"):
    """Document lengths: 1-D non-negative ints whose sum fits in ``seq_len`` -> ``(lengths int64, seq_len)``
    (``seq_len`` None: their sum)."""
    lengths = np.asarray(doc_lengths)
    if lengths.ndim != 1 or lengths.size < 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-D int array of document lengths; got shape "
                         f"{lengths.shape}, dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-negative; got {lengths.tolist()}")
    total = int(lengths.sum())
    if seq_len is None:
        seq_len = total
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int; got {seq_len!r}")
    if total > seq_len:
        raise ValueError(f"{name} sum to {total} tokens, past seq_len = {seq_len} ({lengths.tolist()})")
    return lengths.astype(np.int64), int(seq_len)


def per_document_zigzag(doc_lengths, n_hosts, seq_len=None):
    """Zigzag each packed document over the hosts on its own: a :class:`Layout` of the packed sequence.

    Documents lie one after the other from position 0 (``doc_lengths``, as ``cu_seqlens`` differences);
    positions from ``sum(doc_lengths)`` to ``seq_len`` (default: the sum) are padding, laid out as one more
    document. Each document is cut into ``2N`` chunks and host ``r`` gets chunks ``r`` and ``2N-1-r`` of every
    document (PyTorch context parallel's per-document head-tail balancing; ``zigzag`` is the one-document
    case), so causal work inside each document is balanced. With 2 hosts, documents [8, 4]: host 0 owns
    [0, 1, 6, 7, 8, 11], host 1 [2, 3, 4, 5, 9, 10].

    A document whose length ``L`` is not a multiple of ``2N`` gets chunks of ``L // (2N)`` tokens plus one
    token for ``L % (2N)`` of them, no padding: each such extra token goes to the host holding the fewest
    tokens so far (ties: lowest host; its front chunk first, then its back chunk), which keeps every host
    within one token of the others after each document and equal at the end (``seq_len`` must be a
    multiple of ``n_hosts``). The masks use true positions, so the attention is exact for any of these.
    """
    lengths, seq_len = check_doc_lengths(doc_lengths, seq_len)
    check_n_hosts(n_hosts, seq_len, "contiguous")
    n = int(n_hosts)
    docs = list(lengths[lengths > 0]) + ([seq_len - int(lengths.sum())] if lengths.sum() < seq_len else [])
    owned = np.zeros(n, np.int64)  # tokens per host so far
    shards = [[] for _ in range(n)]
    start = 0
    for length in docs:
        base, extra = divmod(int(length), 2 * n)
        sizes = np.full(2 * n, base)
        for _ in range(extra):  # host with the fewest tokens (and a chunk without an extra token yet)
            room = [r for r in range(n) if sizes[r] == base or sizes[2 * n - 1 - r] == base]
            r = min(room, key=lambda r: (owned[r] + sizes[r] + sizes[2 * n - 1 - r], r))
            sizes[r if sizes[r] == base else 2 * n - 1 - r] += 1
        bounds = start + np.concatenate([[0], np.cumsum(sizes)])
        for r in range(n):
            for j in (r, 2 * n - 1 - r):
                shards[r].append(np.arange(bounds[j], bounds[j + 1]))
            owned[r] += sizes[r] + sizes[2 * n - 1 - r]
        start += int(length)
    perm = np.concatenate([np.concatenate(s) for s in shards])
    assert (owned == seq_len // n).all(), owned  # the least-loaded rule evens the hosts out
    return Layout(perm, np.argsort(perm))
