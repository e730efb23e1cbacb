"""Lab 6: the ring backward -- dQ stays on its host, dK/dV travel with their K/V and come home.

Notebook 05 (the ring backward) is the background; ``ringattn_fast/backward.py`` is the full
version (do not call it, nor differentiate ``ring_attention_shard``: that is the answer). The forward
kept only ``o`` and ``lse``; the backward runs the ring again (Ring Attention, arXiv:2310.01889; the
authors' code rotates k, v, dk, dv together while dq stays) with FlashAttention-2's backward
(arXiv:2307.08691, Algorithm 2) as the per-hop work:

1. once, before the ring: ``delta = rowsum(do * o)`` ([b, h, c], FA-2's D);
2. at step ``t`` host ``i`` holds K/V shard ``(i - t) % N`` and its gradient accumulators dK, dV; it
   adds this hop's contribution (``hop_bwd``) to them and to its own dQ, then sends K/V and dK/dV on
   to host ``i + 1`` (K/V not after the last step);
3. after the last hop host ``i`` holds the accumulators of shard ``i + 1``: one more send brings
   every shard's dK/dV home. K/V move ``N - 1`` times, dK/dV ``N`` times, dQ never.

Write ``ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal)``, the per-host function
inside ``jax.shard_map`` (the grader wraps it: ``in_specs`` ``P(None, "sp")`` for q, k, v, o, do and
``P(None, None, "sp")`` for lse, ``out_specs`` ``P(None, "sp")``, ``check_vma=False``) for the
contiguous layout: host ``r`` owns tokens ``r*c .. (r+1)*c - 1``. q, o, do: [b, c, h, d]; k, v:
[b, c, hk, d]; lse: [b, h, c] (the forward's, over all keys). Return ``(dq, dk, dv)`` of this host's
own tokens, shaped and typed like q, k, v. Building blocks:

- ``ringattn_fast.schedule.QShard(q, pos)``, ``KVShard(k, v, pos)``, ``HopConfig(scale=d ** -0.5,
  causal=causal, block_q=..., block_kv=...)`` (positions: int32 [b, c], the true ones);
- ``ringattn_fast.kernels.xla.hop_bwd(qs, kv, cfg, *, do, lse, delta) -> HopGrads(dq, dk, dv, dbias)``: one
  hop's gradients (dk, dv summed over the GQA group);
- ``lax.ppermute(x, axis_name, perm)`` (a tuple or NamedTuple travels in one call),
  ``lax.axis_index`` / ``lax.axis_size``, ``lax.fori_loop`` with Python int bounds (or a Python loop).

Grade: ``python notebooks/labs/grade.py lab06 your_file.py``. The grader exports your function,
compiles and runs the program itself on 3, 5 and 8 hosts (GQA, b and d > 1, causal and not, float64,
JAX x64 on) and checks: dq, dk, dv match ``ringattn_ref.ring_attention_vjp`` (to 1e-10); from the
compiled program, every collective is a ``ppermute`` ``i -> i+1`` (an autodiff of a forward ring
sends the cotangents ``i -> i-1``), the ppermutes move ``N - 1`` K/V shards and ``N`` dK/dV shards in
all (bytes counted from their operands, times the loop's trip count; positions may travel too), and
the per-device scratch memory stays within 6 of one host's ``q, o, do, k, v`` (+ 16 KiB).
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_bwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard


def ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal):
    """This host's (dq, dk, dv); dK/dV travel with their K/V shard and come home."""
    raise NotImplementedError("lab06: write ring_backward_shard (see the docstring)")
