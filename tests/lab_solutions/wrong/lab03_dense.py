"""Wrong (lab03): dense attention in jnp, returned as the zigzag ring's output.

lab: lab03
expect: is it attention on one device?
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_fast import ring_attention_shard


def zigzag_permutation(seq, n_hosts):
    chunks = np.arange(seq).reshape(2 * n_hosts, seq // (2 * n_hosts))  # (2N, chunk)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n_hosts - 1 - r]]) for r in range(n_hosts)])


def zigzag_positions(seq_local, axis_name):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    c = seq_local // 2  # one chunk
    i = jnp.arange(seq_local, dtype=jnp.int32)
    return jnp.where(i < c, r * c + i, (2 * n - 1 - r) * c + i - c).astype(jnp.int32)


def zigzag_ring_attention(q, k, v, *, mesh, causal):
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    k, v = (jnp.repeat(x, h // hk, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
