"""ringattn_fast.blockwise_feedforward equals the FFN applied to the whole sequence, and so do its
gradients (with and without remat); remat keeps the [block, 4*hidden] intermediate per chunk."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_fast as rf
import ringattn_ref
from ringattn_ref.feedforward import relu_ffn
from helpers import examples


def make_ffn(rng, hidden, ffn_hidden):
    w1, w2 = rng.standard_normal((hidden, ffn_hidden)), rng.standard_normal((ffn_hidden, hidden))
    b1, b2 = rng.standard_normal(ffn_hidden), rng.standard_normal(hidden)
    params = tuple(jnp.asarray(p) for p in (w1, b1, w2, b2))

    def ffn(params, x):  # BPT §3: max(0, x W1 + b1) W2 + b2
        w1, b1, w2, b2 = params
        return jnp.maximum(0.0, x @ w1 + b1) @ w2 + b2

    return ffn, params, (w1, b1, w2, b2)


@settings(max_examples=examples(6))
@given(st.integers(1, 2), st.sampled_from([(8, 1), (8, 4), (12, 3), (16, 16)]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_equals_whole_sequence_ffn_and_its_gradients(batch, seq_block, remat, seed):
    seq, block = seq_block
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        ffn, params, numpy_params = make_ffn(rng, 4, 16)
        x = jnp.asarray(rng.standard_normal((batch, seq, 4)))
        cot = jnp.asarray(rng.standard_normal((batch, seq, 4)))

        def blockwise(params, x):
            return rf.blockwise_feedforward(lambda c: ffn(params, c), x, block=block, remat=remat)

        out = jax.jit(blockwise)(params, x)
        want = ffn(params, x)
        grads = jax.jit(jax.grad(lambda p, x: jnp.vdot(blockwise(p, x), cot), argnums=(0, 1)))(params, x)
        want_grads = jax.jit(jax.grad(lambda p, x: jnp.vdot(ffn(p, x), cot), argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-12, rtol=0)
    numpy_ffn = relu_ffn(*numpy_params)
    ref = ringattn_ref.blockwise_feedforward(numpy_ffn, np.asarray(x), block)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-12, rtol=0)
    for got, exp in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=1e-12, rtol=0)


def test_remat_recomputes_the_intermediate_per_block():
    """fwd+bwd temp memory: with remat the [seq, 4*hidden] activation is not stored for the backward."""
    rng = np.random.default_rng(0)
    ffn, params, _ = make_ffn(rng, 64, 256)
    x = jax.ShapeDtypeStruct((1, 2048, 64), jnp.float32)
    params = tuple(jnp.asarray(p, jnp.float32) for p in params)

    def temp(remat):
        def loss(params, x):
            return rf.blockwise_feedforward(lambda c: ffn(params, c), x, block=128, remat=remat).sum()
        grad = jax.jit(jax.grad(loss))
        return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    hidden_bytes = 2048 * 256 * 4  # the whole-sequence intermediate, float32
    with_remat, without = temp(True), temp(False)
    print(f"fwd+bwd temp bytes: remat {with_remat}, no remat {without}, full intermediate {hidden_bytes}")
    assert without - with_remat >= hidden_bytes // 2


def test_errors():
    x = jnp.zeros((2, 8, 4))
    with pytest.raises(ValueError, match="ffn must be a callable"):
        rf.blockwise_feedforward(3, x, block=4)
    with pytest.raises(ValueError, match=r"block \(3\) must divide the sequence length \(x.shape\[1\] = 8\)"):
        rf.blockwise_feedforward(jnp.tanh, x, block=3)
    with pytest.raises(ValueError, match="block must be a positive int; got 0"):
        rf.blockwise_feedforward(jnp.tanh, x, block=0)
    with pytest.raises(ValueError, match=r"x must be an array \[batch, seq, hidden\]"):
        rf.blockwise_feedforward(jnp.tanh, jnp.zeros(8), block=4)
    with pytest.raises(ValueError, match=r"ffn must keep \[batch, block\] = \(2, 4\) in front"):
        rf.blockwise_feedforward(lambda c: c[:, :1], x, block=4)
