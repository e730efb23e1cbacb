"""Lab 4: a bidirectional ring -- half of each K/V shard travels each way.

Notebooks 03 (the ring), 06 (overlap) and 07 (shard_map and ppermute) are the background. A ring
link is usually full duplex, but the ring of the paper (arXiv:2310.01889, Algorithm 1) sends one
way only: host ``i -> i + 1``, a whole K/V shard per step. Send half each way instead: split this
host's K/V shard (``c`` tokens, c even) into its first half, which travels clockwise
(``i -> i + 1``), and its second half, which travels counter-clockwise (``i -> i - 1``). At step
``t`` host ``i`` holds the first half of shard ``(i - t) % N`` and the second half of shard
``(i + t) % N``; after ``N`` steps it has seen every key once. Each link carries half the bytes per
direction per step, so a send takes half as long: the condition for hiding it behind the compute
(notebook 06) is halved.

Write ``bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal)``, the per-host function
inside ``jax.shard_map`` (the grader wraps it: ``in_specs=out_specs=P(None, "sp")``,
``check_vma=False``) for the contiguous layout: host ``r`` owns tokens ``r*c .. (r+1)*c - 1``.
Building blocks (use them; do not call ``ringattn_fast.ring_attention_shard``):

- ``ringattn_fast.schedule.QShard(q, pos)``, ``KVShard(k, v, pos)``: a shard and the true positions
  of its tokens, int32 [b, tokens]; ``HopConfig(scale=d ** -0.5, causal=causal, block_q=...,
  block_kv=...)`` (blocks dividing the query shard and the half);
- ``ringattn_fast.kernels.xla.hop_fwd(qs, kv, cfg) -> (o, lse)``: one hop's normalised result (lse -inf
  where a row saw nothing);
- ``ringattn_fast.softmax.merge(o1, lse1, o2, lse2)``: combine two results (safe for -inf);
- ``lax.ppermute(x, axis_name, perm)`` with ``perm`` a list of ``(source, destination)`` pairs
  (a NamedTuple such as a KVShard travels in one call); ``lax.axis_index`` / ``lax.axis_size``;
  ``lax.fori_loop`` for the steps (or a Python loop).

Return this host's output, [b, c, h, d] in q's dtype. q: [b, c, h, d]; k, v: [b, c, hk, d].

Grade: ``python notebooks/labs/grade.py lab04 your_file.py``. The grader exports your function in
its shard_map, compiles and runs the program itself on 3, 5 and 8 hosts (float64, JAX x64 on, causal
and not, GQA, b and d > 1; shards of 4 to 32 tokens) and checks: the output shape and dtype; the
output is the float64 oracle's (to 1e-10); and, from the compiled program: every collective is a
``ppermute`` to a neighbour (no all-gather); no array a ppermute moves is larger than half a shard of
K; each direction moves ``N - 1`` halves of K and V in all (bytes counted from the operands, times
the loop's trip count: use ``lax.fori_loop`` with Python int bounds or a Python loop; positions may
travel too); the per-device scratch memory is at most 5 x one host's q, k, v, o (+ 16 KiB).
"""
import jax
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_fast.softmax import merge


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    """This host's ring attention output [b, c, h, d]; half of each K/V shard travels each way."""
    raise NotImplementedError("lab04: write bidirectional_ring_attention_shard (see the docstring)")
