"""Wrong (lab04): all-gather K/V (O(S) memory per host) and attend once; a decoy ppermute each way.

lab: lab04
expect: has an all-gather
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))
    decoy = [lax.ppermute(x[:, : c // 2], axis_name, [(i, (i + s) % n) for i in range(n)])
             for x, s in ((k, 1), (k, -1))]
    k_all, v_all, pos_all = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v, pos))
    k_all = k_all + 0 * jnp.sum(decoy[0]) + 0 * jnp.sum(decoy[1])
    cfg = HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=c)
    o, _ = hop_fwd(QShard(q, pos), KVShard(k_all, v_all, pos_all), cfg)
    return o.astype(q.dtype)
