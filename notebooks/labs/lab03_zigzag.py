"""Lab 3: the zigzag layout in the JAX ring.

Notebook 04 (causal load balance) and 07 (shard_map and ppermute) are the background. With a causal
mask and the contiguous layout, host 0's queries see only its own keys while host N-1's see
everything, and every ring step waits for the busiest host. The zigzag layout cuts the sequence into
``2N`` equal chunks and gives host ``r`` chunks ``r`` and ``2N - 1 - r``: with 4 hosts and 8 tokens,
host 0 owns tokens [0, 7], host 1 [1, 6], host 2 [2, 5], host 3 [3, 4]. Every host then has the
same causal work. Write the layout yourself (do not use ``layout="zigzag"`` of ringattn_fast or
``ringattn_ref.layouts``; that is the answer):

Task 1, ``zigzag_permutation(seq, n_hosts)``: the numpy int array ``perm`` [seq] with ``perm[p]`` =
the true position of the token placed at layout position ``p``; host ``r`` owns layout positions
``r*c .. (r+1)*c - 1`` (``c = seq // n_hosts``). seq is a multiple of ``2 * n_hosts``.

Task 2, ``zigzag_positions(seq_local, axis_name)``: inside ``jax.shard_map``, the true positions
(int32 [seq_local]) of this host's tokens, computed from ``lax.axis_index(axis_name)`` and
``lax.axis_size(axis_name)`` (no array larger than the shard, no table of size seq: that is the point of
computing it per host).

Task 3, ``zigzag_ring_attention(q, k, v, *, mesh, causal)``: ring attention of global arrays in true
order (q [b, seq, h, d], k, v [b, seq, hk, d]) on the 1-D ``mesh`` (axis name ``"sp"``): reorder
the tokens with your permutation, run ``ringattn_fast.ring_attention_shard(q, k, v,
axis_name="sp", causal=causal, positions=...)`` inside your own ``jax.shard_map`` with your
positions (int32 [b, seq_local]), and bring the output back to true order. Return
[b, seq, h, d] in q's dtype.

Grade: ``python notebooks/labs/grade.py lab03 your_file.py``. The grader checks: the permutation
is a permutation of range(seq); every host gets the same number of causal (query, key) pairs; host
``r`` owns chunks ``r`` and ``2N-1-r``; your positions inside shard_map (3, 5 and 8 hosts) are the
zigzag layout's, and no host holds an array of more elements than its shard has tokens to compute them; the ring's output matches the float64 oracle (float64 inputs, JAX x64 on; to 1e-10)
on 3, 5 and 8 hosts (GQA, b, d > 1, causal and not) and drawn problems; the compiled program has
ppermutes ``i -> i+1`` (a ring). Then it runs your ``zigzag_ring_attention`` once more with
``ring_attention_shard`` replaced by a probe that reports, per token, the host it was attended on and
the position it was given: every token must sit on its zigzag host with its true position (the
contiguous ring and dense attention give the same output but fail here). Call
``ring_attention_shard`` with ``positions=`` (not ``layout=``).
"""
import jax
import numpy as np
from jax import lax

from ringattn_fast import ring_attention_shard


def zigzag_permutation(seq, n_hosts):
    """int array [seq]: ``perm[p]`` is the true position of the token at layout position ``p``."""
    raise NotImplementedError("lab03: write zigzag_permutation (see the docstring)")


def zigzag_positions(seq_local, axis_name):
    """Inside shard_map: the true positions, int32 [seq_local], of this host's tokens."""
    raise NotImplementedError("lab03: write zigzag_positions (see the docstring)")


def zigzag_ring_attention(q, k, v, *, mesh, causal):
    """Ring attention in the zigzag layout on ``mesh`` (axis ``"sp"``); o [b, seq, h, d] in true order."""
    raise NotImplementedError("lab03: write zigzag_ring_attention (see the docstring)")
