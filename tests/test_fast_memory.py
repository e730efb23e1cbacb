"""Per-device temp memory of the ring is linear in the local sequence and flat in the device count.

Measured by XLA itself: ``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`` of
the per-device SPMD program (compile only, nothing runs). Tiles are fixed (64 x 64), so only O(S/N)
buffers can grow: q, K/V being used and K/V being received, o, lse, dq, travelling dK/dV.
"""
import jax
import jax.numpy as jnp
import pytest

import ringattn_fast as rf

HEADS, DIM, TILE = 4, 32, 64


def temp_bytes(f, seq):
    x = jax.ShapeDtypeStruct((1, seq, HEADS, DIM), jnp.float32)
    return jax.jit(f).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def fwd_and_bwd(attn):
    def fwd_bwd(q, k, v):
        return jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    return {"fwd": attn, "fwd+bwd": fwd_bwd}


def ring(n_devices):
    mesh = rf.make_mesh(n_devices)
    return fwd_and_bwd(lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, causal=True, block_q=TILE,
                                                         block_kv=TILE))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
def test_flat_in_devices_and_linear_in_local_sequence(which):
    local = 256
    by_devices = {n: temp_bytes(ring(n)[which], n * local) for n in (2, 4, 8)}
    print(which, "temp bytes at local seq 256 for 2/4/8 devices:", by_devices)
    assert max(by_devices.values()) <= 1.10 * min(by_devices.values())

    doubled = temp_bytes(ring(4)[which], 4 * 2 * local)
    dense = fwd_and_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))[which]
    dense_ratio = temp_bytes(dense, 2 * local) / temp_bytes(dense, local)
    ring_ratio = doubled / by_devices[4]
    print(which, f"doubling the local sequence: ring x{ring_ratio:.2f}, dense x{dense_ratio:.2f}")
    assert ring_ratio <= 2.1
    assert dense_ratio >= 3.5  # the quadratic [s, s] logits the ring never materialises
