"""Wrong (lab07): all-gather the whole cache onto every host and attend there.

lab: lab07
expect: no ppermute, no gather of the cache
"""
import jax.numpy as jnp
from jax import lax


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    n = lax.axis_size(axis_name)
    b, _, h, d = q.shape
    k, v = (lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (k, v))  # (b, S, hk, d), striped
    S, hk = k.shape[1], k.shape[2]
    pos = (jnp.arange(S) % (S // n)) * n + jnp.arange(S) // (S // n)
    s = jnp.einsum("bkgd,bckd->bkgc", q[:, 0].reshape(b, hk, h // hk, d) * d ** -0.5, k)
    s = jnp.where((pos[None] < lengths[:, None])[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    o = jnp.einsum("bkgc,bckd->bkgd", p, v) / p.sum(-1)[..., None]
    return o.reshape(b, 1, h, d).astype(q.dtype)
