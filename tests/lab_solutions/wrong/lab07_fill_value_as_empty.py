"""Wrong (lab07): never reads ``lengths``; a slot counts as empty when its K holds the grader's fill value
(50.0 everywhere). Right while every empty slot holds that value and no token does; wrong when the slots
past a row's length hold stale tokens, or a real token equals the fill value.

lab: lab07
expect: is the oracle's over the row's
"""
import jax.numpy as jnp
from jax import lax

FILL = 50.0  # what the grader used to write into every empty slot


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    b, _, h, d = q.shape
    hk = k.shape[2]
    seen = ~jnp.all(k == FILL, axis=(2, 3))  # (b, c): guessed from the contents, not from lengths
    qg = q[:, 0].reshape(b, hk, h // hk, d) * d ** -0.5
    s = jnp.where(seen[:, None, None, :], jnp.einsum("bkgd,bckd->bkgc", qg, k), -jnp.inf)
    m = s.max(axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    l = p.sum(axis=-1)
    o = jnp.einsum("bkgc,bckd->bkgd", p, v) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    top = lax.pmax(lse, axis_name)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))[..., None]
    both = lax.psum(jnp.concatenate([w * o, w], axis=-1), axis_name)
    out = both[..., :-1] / jnp.where(both[..., -1:] == 0, 1.0, both[..., -1:])
    return out.reshape(b, 1, h, d).astype(q.dtype)
