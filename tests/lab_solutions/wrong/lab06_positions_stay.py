"""Wrong (lab06): K/V travel but their positions do not: every hop masks the visiting keys as if they
sat at this host's own positions. Without the causal mask the positions do not matter and the gradients
are right; with it, every hop after the first applies the diagonal block's mask to the wrong keys.

lab: lab06
expect: is the oracle's
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_bwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard


def ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))  # contiguous layout
    qs = QShard(q, pos)
    cfg = HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=c)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o)  # FA-2's D = rowsum(dO * O), once, before the ring
    ring = [(i, (i + 1) % n) for i in range(n)]

    def hop(kv, dk, dv, dq):
        g = hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=delta)
        return dk + g.dk, dv + g.dv, dq + g.dq

    def step(_, carry):
        kv, dk, dv, dq = carry
        k_next, v_next = lax.ppermute((kv.k, kv.v), axis_name, ring)  # K/V on ahead, their positions stay
        kv_next = KVShard(k_next, v_next, pos)  # this host's own positions: the causal mask of the wrong keys
        dk, dv, dq = hop(kv, dk, dv, dq)
        dk, dv = lax.ppermute((dk, dv), axis_name, ring)  # the gradients follow their K/V
        return kv_next, dk, dv, dq

    carry = (KVShard(k, v, pos), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(q))
    kv, dk, dv, dq = lax.fori_loop(0, n - 1, step, carry)
    dk, dv, dq = hop(kv, dk, dv, dq)  # the last hop: K/V go nowhere
    dk, dv = lax.ppermute((dk, dv), axis_name, ring)  # the N-th move brings dK/dV home
    return dq, dk, dv
