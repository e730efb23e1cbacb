"""Wrong (lab03): zigzag_positions builds two half-sequence iotas on every host (the first and the second
half of the positions) and picks its chunk from each: the right positions, and no array as long as the
sequence, but each half is N / 2 shards long, O(S) memory per host all the same.

lab: lab03
expect: none larger than its shard
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
    c = seq_local // 2
    lo = jnp.arange(n * c, dtype=jnp.int32).reshape(n, c)            # the first half of the sequence
    hi = jnp.arange(n * c, 2 * n * c, dtype=jnp.int32).reshape(n, c)  # the second half
    return jnp.concatenate([lo[r], hi[n - 1 - r]])


def zigzag_ring_attention(q, k, v, *, mesh, causal):
    n, seq = mesh.shape["sp"], q.shape[1]
    perm = zigzag_permutation(seq, n)
    q, k, v = (x[:, perm] for x in (q, k, v))  # layout order: host r owns the r-th shard

    def per_host(q, k, v):
        pos = jnp.broadcast_to(zigzag_positions(q.shape[1], "sp")[None], q.shape[:2])
        return ring_attention_shard(q, k, v, axis_name="sp", causal=causal, positions=pos)

    spec = jax.P(None, "sp")
    o = jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    return o[:, np.argsort(perm)]  # back to true order
