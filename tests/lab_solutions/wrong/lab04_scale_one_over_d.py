"""Wrong (lab04): the softmax scale 1/d instead of 1/sqrt(d) (Vaswani et al. Eq. 1): right only when d = 1,
which every drawn problem had.

lab: lab04
expect: the output is the float64 oracle's
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_fast.softmax import merge


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    half = c // 2
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))  # contiguous layout
    qs = QShard(q, pos)
    cfg = HopConfig(scale=1.0 / d, causal=causal, block_q=c, block_kv=half)
    clockwise = [(i, (i + 1) % n) for i in range(n)]
    counter = [(i, (i - 1) % n) for i in range(n)]

    def attend(halves, o, lse):
        for kv in halves:  # the half from the left and the half from the right
            o_hop, lse_hop = hop_fwd(qs, kv, cfg)
            o, lse = merge(o, lse, o_hop, lse_hop)
        return o, lse

    def step(_, carry):
        (cw, ccw), o, lse = carry
        sent = (lax.ppermute(cw, axis_name, clockwise), lax.ppermute(ccw, axis_name, counter))  # overlaps the hops
        return (sent,) + attend((cw, ccw), o, lse)

    halves = (KVShard(k[:, :half], v[:, :half], pos[:, :half]), KVShard(k[:, half:], v[:, half:], pos[:, half:]))
    o = jnp.zeros((b, c, h, d), q.dtype)
    lse = jnp.full((b, h, c), -jnp.inf, q.dtype)
    halves, o, lse = lax.fori_loop(0, n - 1, step, (halves, o, lse))
    o, _ = attend(halves, o, lse)  # the last step: nothing left to send
    return o.astype(q.dtype)
