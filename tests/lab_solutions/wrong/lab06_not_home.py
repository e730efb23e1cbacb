"""Wrong (lab06): dK/dV travel with K/V but the N-th send (home) is missing: host i returns the
gradients of shard i + 1.

lab: lab06
expect: dK/dV N times (home)
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_bwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard


def ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))
    qs, cfg = QShard(q, pos), HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=c)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
    ring = [(i, (i + 1) % n) for i in range(n)]
    kv, dk, dv, dq = KVShard(k, v, pos), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(q)
    for step in range(n):
        g = hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=delta)
        dk, dv, dq = dk + g.dk, dv + g.dv, dq + g.dq
        if step < n - 1:
            kv, (dk, dv) = lax.ppermute(kv, axis_name, ring), lax.ppermute((dk, dv), axis_name, ring)
    return dq, dk, dv
