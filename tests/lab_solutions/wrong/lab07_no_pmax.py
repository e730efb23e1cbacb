"""Wrong (lab07): one psum of exp(lse) o and exp(lse), without the pmax: exp overflows for large logits.

lab: lab07
expect: is the oracle's over the row's
"""
import jax.numpy as jnp
from jax import lax


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, _, h, d = q.shape
    c, hk = k.shape[1], k.shape[2]
    seen = (jnp.arange(c) * n + r)[None] < lengths[:, None]
    s = jnp.einsum("bkgd,bckd->bkgc", q[:, 0].reshape(b, hk, h // hk, d) * d ** -0.5, k)
    p = jnp.where(seen[:, None, None, :], jnp.exp(s), 0.0)  # no max: exp(s) of the raw logits
    both = lax.psum(jnp.concatenate([jnp.einsum("bkgc,bckd->bkgd", p, v), p.sum(-1)[..., None]], -1), axis_name)
    return (both[..., :-1] / both[..., -1:]).reshape(b, 1, h, d).astype(q.dtype)
