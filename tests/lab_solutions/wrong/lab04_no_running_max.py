"""Wrong (lab04): its own merge of two partial results without a running max: exp of the raw lse, right
while the logits are small, NaN once exp overflows (logits past ~709 in float64).

lab: lab04
expect: failed on example large logits
"""
import jax.numpy as jnp
from jax import lax

from ringattn_fast.kernels.xla import hop_fwd
from ringattn_fast.schedule import HopConfig, KVShard, QShard


def merge(o1, lse1, o2, lse2):
    l1, l2 = jnp.exp(lse1), jnp.exp(lse2)  # (b, h, q): no max subtracted first
    l = l1 + l2
    w1, w2 = (jnp.swapaxes(x / l, 1, 2)[..., None] for x in (l1, l2))  # (b, q, h, 1)
    return jnp.nan_to_num(w1 * o1) + jnp.nan_to_num(w2 * o2), jnp.log(l)


def bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c, h, d = q.shape
    half = c // 2
    pos = jnp.broadcast_to((r * c + jnp.arange(c, dtype=jnp.int32))[None], (b, c))
    qs = QShard(q, pos)
    cfg = HopConfig(scale=d ** -0.5, causal=causal, block_q=c, block_kv=half)
    clockwise = [(i, (i + 1) % n) for i in range(n)]
    counter = [(i, (i - 1) % n) for i in range(n)]

    def attend(halves, o, lse):
        for kv in halves:
            o_hop, lse_hop = hop_fwd(qs, kv, cfg)
            o, lse = merge(o, lse, o_hop, lse_hop)
        return o, lse

    def step(_, carry):
        (cw, ccw), o, lse = carry
        sent = (lax.ppermute(cw, axis_name, clockwise), lax.ppermute(ccw, axis_name, counter))
        return (sent,) + attend((cw, ccw), o, lse)

    halves = (KVShard(k[:, :half], v[:, :half], pos[:, :half]), KVShard(k[:, half:], v[:, half:], pos[:, half:]))
    o = jnp.zeros((b, c, h, d), q.dtype)
    lse = jnp.full((b, h, c), -jnp.inf, q.dtype)
    halves, o, lse = lax.fori_loop(0, n - 1, step, (halves, o, lse))
    o, _ = attend(halves, o, lse)
    return o.astype(q.dtype)
