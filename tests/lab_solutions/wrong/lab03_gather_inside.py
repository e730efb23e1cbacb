"""Wrong (lab03): every host all-gathers the whole K/V inside the shard_map (O(S) memory per host) and
rings the gathered copies: each key counted N times leaves the softmax unchanged, so the output is
exact and the ring call is there, but K/V did not travel by ppermute alone.

lab: lab03
expect: K/V travel inside the shard_map by ppermute only
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
    n, seq = mesh.shape["sp"], q.shape[1]
    perm = zigzag_permutation(seq, n)
    q, k, v = (x[:, perm] for x in (q, k, v))  # layout order: host r owns the r-th shard

    def per_host(q, k, v):
        pos = jnp.broadcast_to(zigzag_positions(q.shape[1], "sp")[None], q.shape[:2])
        r, c = lax.axis_index("sp"), q.shape[1]
        q_all, k_all, v_all, pos_all = (lax.all_gather(x, "sp", axis=1, tiled=True) for x in (q, k, v, pos))
        o = ring_attention_shard(q_all, k_all, v_all, axis_name="sp", causal=causal, positions=pos_all)
        return lax.dynamic_slice_in_dim(o, r * c, c, axis=1)  # my queries' rows

    spec = jax.P(None, "sp")
    o = jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    return o[:, np.argsort(perm)]  # back to true order
