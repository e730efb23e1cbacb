"""Wrong (lab03): the contiguous library ring passed as the zigzag ring: no reordering, contiguous
positions (exact output: every layout gives the same attention).

lab: lab03
expect: every token is attended on its zigzag host
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
    def per_host(q, k, v):
        c = q.shape[1]
        pos = lax.axis_index("sp") * c + jnp.arange(c, dtype=jnp.int32)
        return ring_attention_shard(q, k, v, axis_name="sp", causal=causal,
                                    positions=jnp.broadcast_to(pos[None], q.shape[:2]))

    spec = jax.P(None, "sp")
    return jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
