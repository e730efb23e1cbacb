"""Wrong (lab03): the whole permutation table on every host, as lab03_whole_table.py, but built inside a
``jax.jit`` of its own that the shard_map body only calls (the table lives in the called function).

lab: lab03
expect: no sequence-sized array on a host
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_fast import ring_attention_shard


def zigzag_permutation(seq, n_hosts):
    chunks = np.arange(seq).reshape(2 * n_hosts, seq // (2 * n_hosts))  # (2N, chunk)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n_hosts - 1 - r]]) for r in range(n_hosts)])


@partial(jax.jit, static_argnums=(1, 2))
def _my_shard(r, seq_local, n):
    """The whole layout's table, sliced: inside a jit of its own, so the shard_map body only calls it."""
    table = jnp.asarray(zigzag_permutation(seq_local * n, n), jnp.int32)
    return lax.dynamic_slice_in_dim(table, r * seq_local, seq_local)


def zigzag_positions(seq_local, axis_name):
    return _my_shard(lax.axis_index(axis_name), seq_local, lax.axis_size(axis_name))


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
