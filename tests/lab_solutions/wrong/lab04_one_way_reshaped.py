"""Wrong (lab04): a one-way ring that sends the whole shard, reshaped so that axis 1 looks like half a
shard ([b, 2, c/2, ...]), plus a small decoy ppermute the other way.

lab: lab04
expect: no ppermute moves more than half a shard
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_fast.softmax import merge


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))
    cfg = HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=c)
    qs = QShard(q, pos)
    fold = lambda x: x.reshape(b, 2, c // 2, *x.shape[2:])  # noqa: E731 - shape[1] is 2 now
    unfold = lambda x: x.reshape(b, c, *x.shape[3:])  # noqa: E731
    o = jnp.zeros((b, c, h, d), q.dtype)
    lse = jnp.full((b, h, c), -jnp.inf, q.dtype)
    kv = (fold(k), fold(v), fold(pos))
    decoy = k[:, :1]
    for step in range(n):
        o_hop, lse_hop = hop_fwd(qs, KVShard(*(unfold(x) for x in kv)), cfg)
        o, lse = merge(o, lse, o_hop, lse_hop)
        if step < n - 1:
            kv = lax.ppermute(kv, axis_name, [(i, (i + 1) % n) for i in range(n)])
            decoy = lax.ppermute(decoy, axis_name, [(i, (i - 1) % n) for i in range(n)])
    return (o + 0 * jnp.sum(decoy)).astype(q.dtype)
