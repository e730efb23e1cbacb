"""Wrong (lab07): the ring schedule for one query: the cache shards travel N - 1 times per token.

lab: lab07
expect: no ppermute, no gather of the cache
"""
import jax.numpy as jnp
from jax import lax


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, _, h, d = q.shape
    c, hk = k.shape[1], k.shape[2]
    qg = q[:, 0].reshape(b, hk, h // hk, d) * d ** -0.5
    m = jnp.full((b, hk, h // hk), -jnp.inf)
    l, o = jnp.zeros((b, hk, h // hk)), jnp.zeros((b, hk, h // hk, d))
    for step in range(n):
        src = (r - step) % n  # the host whose shard is here now
        seen = (jnp.arange(c) * n + src)[None] < lengths[:, None]
        s = jnp.where(seen[:, None, None, :], jnp.einsum("bkgd,bckd->bkgc", qg, k), -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p, alpha = jnp.exp(s - m_safe[..., None]), jnp.exp(m - m_safe)
        l, o, m = alpha * l + p.sum(-1), alpha[..., None] * o + jnp.einsum("bkgc,bckd->bkgd", p, v), m_new
        if step < n - 1:
            k, v = lax.ppermute((k, v), axis_name, [(i, (i + 1) % n) for i in range(n)])
    return (o / l[..., None]).reshape(b, 1, h, d).astype(q.dtype)
