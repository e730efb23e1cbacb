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
- ``ringattn_fast.hop.hop_fwd(qs, kv, cfg) -> (o, lse)``: one hop's normalised result (lse -inf
  where a row saw nothing);
- ``ringattn_fast.softmax.merge(o1, lse1, o2, lse2)``: combine two results (safe for -inf);
- ``lax.ppermute(x, axis_name, perm)`` with ``perm`` a list of ``(source, destination)`` pairs
  (a NamedTuple such as a KVShard travels in one call); ``lax.axis_index`` / ``lax.axis_size``;
  ``lax.fori_loop`` for the steps (or a Python loop).

Return this host's output, [b, c, h, d] in q's dtype. q: [b, c, h, d]; k, v: [b, c, hk, d].

Grade: ``python notebooks/labs/grade.py lab04 your_file.py``. On drawn problems (3 to 8 hosts,
float64, JAX x64 on, causal and not, GQA) the grader checks: the output shape and dtype; the
output is the float64 oracle's (to 1e-10); and, from the traced program (every ``ppermute`` in
its jaxpr), that K/V travel both ways (``i -> i + 1`` and ``i -> i - 1``, no other pattern), that
no ``ppermute`` moves more than half a shard of tokens, and that both directions carry the same
number of elements.
"""
import jax
import jax.numpy as jnp
from jax import lax

from ringattn_fast.hop import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_fast.softmax import merge


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    """This host's ring attention output [b, c, h, d]; half of each K/V shard travels each way."""
    raise NotImplementedError("lab04: write bidirectional_ring_attention_shard (see the docstring)")
