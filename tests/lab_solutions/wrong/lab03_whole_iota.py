"""Wrong (lab03): zigzag_positions computes (no constant table) an iota over the whole sequence on every
host, cuts it into the 2N chunks and picks its two: the right positions, but a sequence-sized array per host.

lab: lab03
expect: no sequence-sized array on a host
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
    chunks = jnp.arange(seq_local * n, dtype=jnp.int32).reshape(2 * n, c)  # every position, on every host
    mine = jnp.stack([chunks[r], chunks[2 * n - 1 - r]])
    return mine.reshape(seq_local)


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
