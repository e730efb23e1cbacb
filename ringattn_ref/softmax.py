"""The online softmax state ``(m, l, o)`` and ``merge`` — the arithmetic every ring step performs.

FlashAttention-2 (arXiv:2307.08691, §3.1.1, Algorithm 1), also the blockwise update of BPT
(arXiv:2305.19370) and Ring Attention (arXiv:2310.01889, Algorithm 1). For one block of logits ``S``::

    m_new = max(m, rowmax S)                    running max          [b, h, q]
    P     = exp(S - m_new)                                           [b, h, q, k]
    l_new = exp(m - m_new) * l + rowsum P       running denominator  [b, h, q]
    o_new = exp(m - m_new) * o + P V            unnormalised output  [b, q, h, d]

``o`` stays unnormalised until the end (one division instead of one per block); the final result is
``o / l`` and ``lse = m + log l``. A row that has seen no key keeps ``m = -inf, l = 0``; every step is
written so that this state never produces NaN, and finalises to ``o = 0, lse = -inf``.
"""
from __future__ import annotations

import numpy as np


def _rows_to_o(x):
    """Stats ``[b, h, q]`` -> ``[b, q, h, 1]`` so they scale ``o`` rows."""
    return np.transpose(x, (0, 2, 1))[..., None]


def _finite_or_zero(m):
    """Replace -inf (a row that saw nothing yet) by 0, so ``x - m`` never computes ``-inf - -inf``."""
    return np.where(np.isfinite(m), m, 0.0)


def init_state(batch, heads, seq, dim):
    """The empty state: ``m = -inf``, ``l = 0`` ([b, h, q]) and ``o = 0`` ([b, q, h, d])."""
    m = np.full((batch, heads, seq), -np.inf)
    l = np.zeros((batch, heads, seq))
    o = np.zeros((batch, seq, heads, dim))
    return m, l, o


def online_update(m, l, o, s, v, keep=None):
    """Fold one block of masked logits into the state (FA-2 Algorithm 1, lines 8-10).

    m, l: [b, h, q]; o: [b, q, h, d]; s: [b, h, q, k] logits with -inf where masked;
    v: [b, k, h, d] (kv heads already repeated to q heads); keep: the dropout multiplier
    ``M / (1 - rate)`` [b, h, q, k] or None (``dropout.py``: it scales ``P`` in ``P V`` only, not ``l``).
    Returns the new ``(m, l, o)``.
    """
    m_new = np.maximum(m, s.max(axis=-1))  # (b, h, q); -inf if the row saw nothing so far
    m_safe = _finite_or_zero(m_new)
    alpha = np.exp(m - m_safe)  # (b, h, q): rescales the old state; exp(-inf) = 0 when m was -inf
    p = np.exp(s - m_safe[..., None])  # (b, h, q, k); 0 where masked
    l_new = alpha * l + p.sum(axis=-1)
    o_new = _rows_to_o(alpha) * o + np.einsum("bhqk,bkhd->bqhd", p if keep is None else p * keep, v)
    return m_new, l_new, o_new


def finalize(m, l, o):
    """Normalise: ``(o / l, m + log l)``; rows with ``l = 0`` give ``o = 0`` and ``lse = -inf``."""
    seen = l != 0  # (b, h, q); NaN (a row that saw a bad key) stays NaN
    with np.errstate(divide="ignore"):
        lse = np.where(seen, _finite_or_zero(m) + np.log(np.where(seen, l, 1.0)), -np.inf)
    o = o / _rows_to_o(np.where(seen, l, 1.0))
    return o, lse


def merge(o1, lse1, o2, lse2):
    """Combine two normalised partial results over disjoint key sets: the blockwise merge of Rabe &
    Staats (arXiv:2112.05682, §3) on Milakov & Gimelshein's online normaliser (arXiv:1805.02867).
    FlashAttention-2 never merges two normalised partials (its one pass rescales a running sum).

    o1, o2: [b, q, h, d]; lse1, lse2: [b, h, q]. Returns ``(o, lse)`` with
    ``lse = logaddexp(lse1, lse2)`` and ``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``.
    Associative and commutative (up to rounding); when both sides saw nothing (``lse = -inf``) the
    naive formula is ``0/0``: here it gives ``o = 0, lse = -inf``.
    """
    lse = np.logaddexp(lse1, lse2)  # (b, h, q); -inf only when both are -inf
    lse_safe = _finite_or_zero(lse)
    w1 = np.exp(lse1 - lse_safe)  # 0 when lse1 = -inf
    w2 = np.exp(lse2 - lse_safe)
    return _rows_to_o(w1) * o1 + _rows_to_o(w2) * o2, lse
