"""Wrong (lab06): jax.vjp through a forward ring built from hop_fwd. The gradients are right, but
autodiff transposes each ppermute: the cotangents travel i -> i-1, and every step's K/V are saved.

lab: lab06
expect: travel i -> i+1 (the forward's way)
"""
import jax
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_fast.softmax import merge


def ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))
    cfg = HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=c)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def forward(q, k, v):
        kv, o_acc = KVShard(k, v, pos), jnp.zeros_like(q)
        lse_acc = jnp.full((b, h, c), -jnp.inf, q.dtype)
        for step in range(n):
            o_hop, lse_hop = hop_fwd(QShard(q, pos), kv, cfg)
            o_acc, lse_acc = merge(o_acc, lse_acc, o_hop, lse_hop)
            if step < n - 1:
                kv = lax.ppermute(kv, axis_name, ring)
        return o_acc

    _, vjp = jax.vjp(forward, q, k, v)
    return vjp(do)
