"""Attention you can program: mask and score functions of true positions, and the built-ins as such.

A **mask function** ``mask_fn(q_pos, k_pos, q_seg, k_seg, head) -> bool`` says which (query, key) pairs
may attend; a **score function** ``score_fn(s, q_pos, k_pos, head) -> s`` rewrites the scaled logits
(FlexAttention's ``mask_mod`` / ``score_mod``, Dong et al. 2024). Both see *true* positions, so every
layout gives the same answer, and both are called on arrays that broadcast to ``[batch, heads, q, k]``:

- ``q_pos``, ``q_seg``: ``[b|1, 1, q, 1]``; ``k_pos``, ``k_seg``: ``[b|1, 1, 1, k]`` (int; segment ids are
  0 everywhere when the call has none); ``head``: ``[1, heads, 1, 1]`` (int: the query head);
- ``s``: ``[b, heads, q, k]`` float, after the scale (and ``logit_softcap``) and before the mask.

The oracle (:func:`ringattn_ref.attention.attention`) calls them once on the whole ``[T, S]`` grid; the
ring and the kernels call them per tile, with tile-shaped arrays of the same rank, so a function must
be **elementwise in the (query, key) pairs**: only operations that broadcast, and no value at one pair
that depends on another (no reduction such as ``q_pos.max()`` or ``s.max(-1)``, no cumulative op, sort,
matmul, or slice or gather across pairs; no shape of its own). Reading a constant table at indices
computed from positions (``table[k_pos]``) is elementwise and fine. ``ringattn_fast`` refuses a
function that breaks the rule before any compute (``ringattn_fast.elementwise``), and a ``score_fn`` must
return floating-point logits. jax.numpy functions are fine, and the way to write your own, e.g.
``lambda q_pos, k_pos, q_seg, k_seg, head: jnp.logical_or(k_pos <= q_pos, k_pos < 8)`` or
``lambda s, q_pos, k_pos, head: jnp.where(k_pos < 8, s, s - 0.1 * jnp.abs(q_pos - k_pos))``: the ring's
block mask evaluates them on concrete positions even under ``jit``.
Written with operators and ``x.__array_namespace__()`` (numpy >= 2 and jax.numpy both have it), each
function here runs on numpy in the oracle and on jax.numpy in a hop or a kernel.

The built-ins below equal the keywords where one exists (``causal=True`` is :func:`causal`, ``window``
is :func:`window`, ``segment_ids`` is :func:`document`, ``logit_softcap=c`` is :func:`softcap`); the
others are what models use: prefix-LM (T5, PaLI), chunked local attention (Llama 4), StreamingLLM's
sink tokens plus a window (Xiao et al. 2023), ALiBi (Press et al. 2022).
"""
from __future__ import annotations

import numpy as np


def causal(q_pos, k_pos, q_seg, k_seg, head):
    """A key at or before the query: ``k <= q``."""
    return k_pos <= q_pos


def window(left, right):
    """``q - left <= k <= q + right`` (-1: unbounded on that side), the ``window=(left, right)`` keyword."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        ok = (k_pos - q_pos) == (k_pos - q_pos)  # all True, broadcast
        if left >= 0:
            ok = ok & (q_pos - k_pos <= left)
        if right >= 0:
            ok = ok & (k_pos - q_pos <= right)
        return ok
    return mask_fn


def document(q_pos, k_pos, q_seg, k_seg, head):
    """Packed documents see only their own: equal segment ids (the ``segment_ids`` keyword)."""
    return q_seg == k_seg


def documents(lengths, causal=True):
    """Packed documents of static ``lengths`` as a function of positions alone: a query sees the keys of
    its own document (and, ``causal``, only those at or before it). Document ``i`` covers positions
    ``sum(lengths[:i]) .. sum(lengths[:i+1]) - 1``; e.g. ``documents([3, 2])``: position 4 sees 3 and 4,
    position 2 sees 0, 1, 2. Unlike :func:`document` it needs no segment ids, so the ring can build a
    static block mask from it (``ringattn_fast.block_mask``); positions past the end form one more document.
    """
    ends = np.cumsum(np.asarray(lengths, np.int64))  # document i ends before ends[i]

    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        xp = q_pos.__array_namespace__()
        bounds = xp.asarray(ends, dtype=q_pos.dtype)
        same = xp.searchsorted(bounds, q_pos, side="right") == xp.searchsorted(bounds, k_pos, side="right")
        return same & (k_pos <= q_pos) if causal else same
    return mask_fn


def prefix_lm(prefix):
    """Bidirectional over the first ``prefix`` positions, causal after them."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        return (k_pos < prefix) | (k_pos <= q_pos)
    return mask_fn


def chunked_local(chunk):
    """Causal inside chunks of ``chunk`` positions, nothing across them (Llama 4's local layers)."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        return (q_pos // chunk == k_pos // chunk) & (k_pos <= q_pos)
    return mask_fn


def streaming(n_sinks, recent):
    """StreamingLLM: causal, each query sees the first ``n_sinks`` positions and the ``recent`` before it."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        return (k_pos <= q_pos) & ((k_pos < n_sinks) | (q_pos - k_pos <= recent))
    return mask_fn


def both(*mask_fns):
    """The pairs every one of ``mask_fns`` allows."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        ok = mask_fns[0](q_pos, k_pos, q_seg, k_seg, head)
        for fn in mask_fns[1:]:
            ok = ok & fn(q_pos, k_pos, q_seg, k_seg, head)
        return ok
    return mask_fn


def softcap(c):
    """Gemma 2's logit soft-capping as a score function: ``c * tanh(s / c)`` (the ``logit_softcap`` keyword).

    Order: the cap acts on the scaled logits ``s = scale q k`` before the bias and the mask are added
    (a score function runs before them; ``logit_softcap`` runs first of all), as Gemma 2 caps its
    attention logits. So a ``-inf`` masking bias still masks (capped after, it would become ``-c``, a
    finite logit: weight ``e^-c`` against a logit of 0, not 0) and a position bias (ALiBi) keeps its
    range. Tokamax caps after the bias; that order, for a bias ``b`` of positions and heads, is
    ``score_fn = lambda s, qp, kp, h: c * tanh((s + b(qp, kp, h)) / c)`` with no ``bias`` argument.
    """
    def score_fn(s, q_pos, k_pos, head):
        return c * s.__array_namespace__().tanh(s / c)
    return score_fn


def alibi_slopes(heads):
    """ALiBi's per-head slopes ``2 ** (-8 (i + 1) / heads)`` (Press et al. 2022, Sec. 3), float64 ``[heads]``."""
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


def alibi(slopes):
    """ALiBi: ``s - slope[head] * |q - k|``, a linear penalty on distance; ``slopes`` float ``[heads]``."""
    slopes = np.asarray(slopes, np.float64)

    def score_fn(s, q_pos, k_pos, head):
        xp = s.__array_namespace__()
        slope = xp.asarray(slopes, dtype=s.dtype)[head]  # (1, h, 1, 1)
        return s - slope * xp.abs(q_pos - k_pos).astype(s.dtype)
    return score_fn
