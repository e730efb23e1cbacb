"""Lab 5: a Pallas hop kernel -- one ring hop as a FlashAttention-2 kernel (TPU interpreter on CPU).

Notebook 08 (Pallas hop kernels) is the background; ``ringattn_fast/kernels/pallas_tpu.py`` is the
full kernel (segments, windows, tile skipping, the backward). Here: the forward of one hop, causal
or not. ``hop_fwd`` below is complete: it lays q, k, v out heads-major and calls ``pl.pallas_call``
on the grid ``(batch, heads, sq // block_q, sk // block_kv)``, the K/V-tile axis last and
"arbitrary" (run in order), so three VMEM scratch buffers carry the running statistics from one
K/V tile to the next. Write ``hop_kernel``, the body run at every grid point ``(bi, hi, i, j)``:

- at ``j == 0`` (``pl.program_id(3)``): initialise ``m_ref`` to -inf, ``l_ref`` and ``acc_ref`` to 0;
- every ``j``: fold this (Q tile i, K/V tile j) pair in (FA-2, arXiv:2307.08691, Algorithm 1):
  ``s = scale * q @ k.T`` (float32), -inf where ``causal`` and ``q_pos < k_pos``; then the online
  softmax update of ``(m, l, acc)`` (lab 1), without NaN for a row that saw nothing yet;
- at the last ``j`` (``pl.num_programs(3) - 1``): write ``o = acc / l`` and ``lse = m + log l``;
  a row that saw no key writes ``o = 0`` and ``lse = -inf``.

Refs (blocks of the current grid point; read with ``ref[...]``, write with ``ref[...] = x``):
q_ref [block_q, d], k_ref, v_ref [block_kv, d], qp_ref int32 [block_q], kp_ref int32 [block_kv]
(true positions), o_ref [block_q, d], lse_ref [block_q], and the scratch m_ref, l_ref
[block_q, 1], acc_ref [block_q, d], all float32. Use ``jnp`` and ``lax`` inside; ``pl.when(cond)``
runs a function only where ``cond`` holds.

Grade: ``python notebooks/labs/grade.py lab05 your_file.py``. The grader puts your ``hop_kernel``
into its own copy of ``hop_fwd`` (the one below; changing ``hop_fwd`` changes nothing, so the kernel
inside ``pallas_call`` is yours and it alone computes the output). It runs two hops in the TPU
interpreter with its race detector on, then every hop with ``interpret=True``: a host's query shard
against one K/V shard (fixed: causal hops whose host is not the block's, so positions are the true
ones, not tile indices; a hop where no row sees anything and one where a single row does not; logits
past float32's ``exp`` range; GQA, b, d > 1, tiles smaller than the shard; plus drawn hops of every
layout). It checks: the shapes and dtypes of o and lse; no NaN; rows that see nothing give o = 0 and
lse = -inf; o and lse match the float64 per-hop oracle ``ringattn_ref.hop_attention`` to 2e-5; and
the race detector reports nothing. The detector watches DMAs and semaphores: a kernel pipelined by
BlockSpecs like this one has none of its own, but if you double-buffer K/V yourself with
``pltpu.make_async_copy`` (as the fused ring kernel of notebook 09 does), reading a buffer before its
copy's ``wait()`` is a race the grader reports.
"""
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")


def hop_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale, causal):
    """One grid point (batch bi, head hi, Q tile i, K/V tile j): fold K/V tile j into Q tile i's state."""
    raise NotImplementedError("lab05: write hop_kernel (see the docstring)")


def hop_fwd(q, k, v, q_pos, k_pos, *, scale, causal, block_q, block_kv, interpret):
    """One hop: o float32 [b, sq, h, d] (normalised within the hop), lse float32 [b, h, sq].

    q: float32 [b, sq, h, d]; k, v: float32 [b, sk, hk, d] (h % hk == 0: query head hi reads kv head
    hi // (h // hk)); q_pos int32 [sq], k_pos int32 [sk]: true positions; block_q / block_kv divide
    sq / sk; interpret: what ``pl.pallas_call(interpret=...)`` gets.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    qt, kt, vt = (x.swapaxes(1, 2) for x in (q, k, v))  # heads-major: (b, heads, s, d)
    q_tile = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    kv_tile = pl.BlockSpec((None, None, block_kv, d), lambda bi, hi, i, j: (bi, hi // group, j, 0))
    o, lse = pl.pallas_call(
        partial(hop_kernel, scale=scale, causal=causal),
        grid=(b, h, sq // block_q, sk // block_kv),
        in_specs=[q_tile, kv_tile, kv_tile, pl.BlockSpec((block_q,), lambda bi, hi, i, j: (i,)),
                  pl.BlockSpec((block_kv,), lambda bi, hi, i, j: (j,))],
        out_specs=[q_tile, pl.BlockSpec((None, None, block_q), lambda bi, hi, i, j: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct((b, h, sq, d), jnp.float32), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                        pltpu.VMEM((block_q, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(qt, kt, vt, q_pos, k_pos)
    return o.swapaxes(1, 2), lse
