"""Lab 1: the online softmax — fold a block into the running state, merge two partial results.

Notebook 01 (online softmax) and 02 (blockwise attention) are the background. Every ring step does
this arithmetic (FlashAttention-2, arXiv:2307.08691, §3.1.1 and Algorithm 1; Ring Attention,
arXiv:2310.01889, Algorithm 1). Write both functions in numpy, float64. Layout as everywhere in the
course: o is ``[batch, seq, heads, dim]``, the statistics m, l, lse are ``[batch, heads, seq]``.

Task 1, ``online_update(m, l, o, s, v)``: fold one block of logits ``s`` into the running
``(m, l, o)`` (``o`` kept unnormalised) and return the new ``(m, l, o)``::

    m_new = max(m, rowmax s)
    l_new = exp(m - m_new) l + rowsum exp(s - m_new)
    o_new = exp(m - m_new) o + exp(s - m_new) v

Task 2, ``merge(o1, lse1, o2, lse2)``: combine two results, each normalised over its own disjoint
set of keys, into the result over the union: ``lse = log(exp lse1 + exp lse2)`` and
``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``.

The catch, in both: a query row that has seen no key yet has ``m = -inf, l = 0`` (or ``lse = -inf``);
the textbook formulas then compute ``-inf - -inf = nan``. Your functions must never produce NaN:
a row that saw nothing stays ``m = -inf, l = 0, o = 0`` (``lse = -inf, o = 0`` in ``merge``).
They must also not overflow: ``lse`` may be 800 (``exp(800)`` is inf in float64).

Grade: ``python notebooks/labs/grade.py lab01 notebooks/labs/lab01_online_softmax.py``. The grader
folds logits block by block with your ``online_update`` (from the empty state, and from a state that
already holds keys) and checks after every block that the state is the float64 oracle's over the keys
so far (to 1e-12); it merges the oracle's results over two disjoint key sets with your ``merge``, in
both orders and with both lse + 800, and checks the union (to 1e-12); no NaN. Fixed examples: logits
near +-900 whose max rises and falls from block to block (a fold without a running max overflows),
rows that see nothing at first or at all, b, h, d > 1; then drawn problems
(``ringattn_ref.testing.attention_problems``: masks, GQA). Numpy only: calling ``ringattn_ref`` or
``ringattn_fast`` from your file (``softmax.merge`` under any name) fails the grade.
"""
import numpy as np


def online_update(m, l, o, s, v):
    """Fold one block of masked logits into the online-softmax state.

    - m, l: float64 [b, h, q] running max and running denominator (m = -inf, l = 0: nothing seen);
    - o: float64 [b, q, h, d] unnormalised output;
    - s: float64 [b, h, q, k] logits of this block, -inf where masked;
    - v: float64 [b, k, h, d] values of this block (kv heads already repeated to q heads).

    Returns the new ``(m, l, o)``, same shapes, float64.
    """
    raise NotImplementedError("lab01: write online_update (see the docstring)")


def merge(o1, lse1, o2, lse2):
    """Combine two partial results over disjoint key sets.

    o1, o2: float64 [b, q, h, d] (each normalised over its own keys); lse1, lse2: float64 [b, h, q]
    (-inf for a row that saw no key in that part). Returns ``(o, lse)`` over the union, float64.
    """
    raise NotImplementedError("lab01: write merge (see the docstring)")
