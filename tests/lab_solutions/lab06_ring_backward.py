"""Lab 6 reference solution: the ring backward, dQ stays, dK/dV travel with K/V and come home."""
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
        kv_next = lax.ppermute(kv, axis_name, ring)  # K/V on ahead: overlaps the hop
        dk, dv, dq = hop(kv, dk, dv, dq)
        dk, dv = lax.ppermute((dk, dv), axis_name, ring)  # the gradients follow their K/V
        return kv_next, dk, dv, dq

    carry = (KVShard(k, v, pos), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(q))
    kv, dk, dv, dq = lax.fori_loop(0, n - 1, step, carry)
    dk, dv, dq = hop(kv, dk, dv, dq)  # the last hop: K/V go nowhere
    dk, dv = lax.ppermute((dk, dv), axis_name, ring)  # the N-th move brings dK/dV home
    return dq, dk, dv
