"""Lab 9: programming attention -- a mask function, its block mask, and the hops a ring skips.

Notebook 14 (programming attention) is the background, with 02 (tiles) and 04 (layouts). A *mask
function* ``mask_fn(q_pos, k_pos, q_seg, k_seg, head) -> bool`` says which (query, key) pairs may attend,
from the pairs' *true* positions (FlexAttention's ``mask_mod``, Dong et al. 2024, arXiv:2412.05496); the
ring and the oracle call it on arrays that broadcast to ``[batch, heads, q, k]``: ``q_pos`` ``[b|1, 1, q, 1]``,
``k_pos`` ``[b|1, 1, 1, k]`` (int), ``q_seg`` / ``k_seg`` alike (0 when the call has none), ``head``
``[1, heads, 1, 1]``. The ring calls it once per *tile*, so it must be elementwise in the pairs: no
reduction (``q_pos.min()``), no sort, no shape of its own; indexing a constant table with positions is fine.

Part 1. Write ``prefix_lm_documents(lengths, prefix) -> mask_fn``: documents of the static ``lengths``
packed one after another (document ``i`` covers positions ``sum(lengths[:i]) .. sum(lengths[:i+1]) - 1``;
the lengths add up to the sequence), each a prefix-LM (T5, arXiv:1910.10683, §3.2.1): the first ``prefix``
tokens of a document (all of it if it is shorter) attend to each other both ways, every later token
attends causally -- to the keys of its own document at or before it, the prefix included. Nothing crosses a
document boundary. Example, ``lengths = [4, 3]``, ``prefix = 2``: position 0 sees 0 and 1; position 3 sees
0 .. 3; position 4 (document 1's first) sees 4 and 5; position 6 sees 4, 5, 6.

Part 2. Write ``block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv) -> (kinds, hops)``,
the block mask of a self-attention ring: the sequence is laid out with ``layout`` (``"contiguous"``,
``"striped"`` or ``"zigzag"``; ``ringattn_ref.layouts.layout_permutation(layout, seq_len, n_hosts)``
gives the true position at each layout index, host ``r`` owning indices ``r c .. (r + 1) c - 1``, ``c =
seq_len / n_hosts``) and every host's queries meet every K/V shard. Evaluate ``mask_fn`` (one head,
segment ids 0) on the true positions and return

- ``kinds``: int8 ``[n_hosts, n_hosts, c / block_q, c / block_kv]``, indexed (query host, K/V shard, query
  tile, key tile): 0 when no pair of the tile attends (EMPTY: skipped), 1 when all do (FULL: no mask
  needed), 2 otherwise (PARTIAL);
- ``hops``: bool ``[n_hosts, n_hosts]``, indexed (host ``i``, ring step ``t``): True when the K/V shard host
  ``i`` holds at step ``t``, ``(i - t) % n_hosts``, has at least one pair that attends -- False is a hop
  the ring skips whole.

Do not call ``ringattn_ref.block_mask``, ``ringattn_ref.variants`` or ``ringattn_fast`` (the grader
compares with them); numpy and ``layout_permutation`` are what you need.

Grade: ``python notebooks/labs/grade.py lab09 your_file.py``. The grader (numpy, float64) checks: your
mask is the definition above on the whole grid (fixed: a document shorter than the prefix, prefix 0, one
document, a prefix longer than every document; plus draws); the library's ring run with your mask gives
the float64 oracle's output (1e-12) on 2 to 4 hosts, contiguous, striped and zigzag, and skips exactly
the hops the true mask leaves empty (the ring calls your function per tile: a function that is not
elementwise fails here); your ``kinds`` and ``hops`` are the library's block mask
(``ringattn_ref.ring_block_mask``) for your mask and for masks of the grader's own, some of which attend
only inside a tile, never at its corners.
"""
import numpy as np

from ringattn_ref.layouts import layout_permutation


def prefix_lm_documents(lengths, prefix):
    """A mask function: packed documents of ``lengths``, each bidirectional over its first ``prefix``
    tokens and causal after them, nothing across documents."""
    raise NotImplementedError("lab09: write prefix_lm_documents (see the docstring)")


def block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv):
    """``(kinds int8 [N, N, nq, nk], hops bool [N, N])``: the tile kinds and the non-empty hops of ``mask_fn``
    on a self-attention ring of ``n_hosts`` hosts laid out with ``layout``."""
    raise NotImplementedError("lab09: write block_mask (see the docstring)")
