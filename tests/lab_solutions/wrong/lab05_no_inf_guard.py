"""Wrong (lab05): no -inf guard: a row that has seen nothing computes exp(-inf - -inf) = NaN.

lab: lab05
expect: no NaN
"""
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")


def hop_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale, causal):
    """One grid point (batch bi, head hi, Q tile i, K/V tile j): fold K/V tile j into Q tile i's state."""
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s = scale * jnp.dot(q_ref[...], k_ref[...].T, preferred_element_type=jnp.float32)  # (block_q, block_kv)
    if causal:
        s = jnp.where(qp_ref[...][:, None] >= kp_ref[...][None, :], s, NEG_INF)
    m_prev = m_ref[...]  # (block_q, 1)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    m_safe = m_new
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)  # rescales the old l and acc to the new max
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...]
        empty = l == 0.0  # the row saw no key
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = jnp.where(empty, 0.0, acc_ref[...] / l_safe)
        lse_ref[...] = jnp.where(empty, NEG_INF, m_ref[...] + jnp.log(l_safe))[:, 0]


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
