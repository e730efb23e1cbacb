"""Lab 7 reference solution: decode over a striped KV cache, local attention then one pmax and one psum."""
import jax.numpy as jnp
from jax import lax


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, _, h, d = q.shape
    c, hk = k.shape[1], k.shape[2]
    seen = (jnp.arange(c) * n + r)[None] < lengths[:, None]  # (b, c): slot i holds position i * N + r
    qg = q[:, 0].reshape(b, hk, h // hk, d) * d ** -0.5  # (b, hk, g, d)
    s = jnp.einsum("bkgd,bckd->bkgc", qg, k)
    s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1)  # (b, hk, g) this host's max
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    l = p.sum(axis=-1)
    o = jnp.einsum("bkgc,bckd->bkgd", p, v) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    top = lax.pmax(lse, axis_name)  # all-reduce 1: the global max, so no exp overflows
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))[..., None]  # 0 for a host that saw nothing
    both = lax.psum(jnp.concatenate([w * o, w], axis=-1), axis_name)  # all-reduce 2: numerator and denominator
    out = both[..., :-1] / jnp.where(both[..., -1:] == 0, 1.0, both[..., -1:])
    return out.reshape(b, 1, h, d).astype(q.dtype)
