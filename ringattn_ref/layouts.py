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
