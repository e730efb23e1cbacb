"""blockwise_feedforward: exactly ffn(x), block by block (BPT §3); bad inputs raise."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_ref
from ringattn_ref.feedforward import blockwise_feedforward, relu_ffn
from helpers import examples


def _weights(rng, hidden, ffn_hidden):
    return (rng.standard_normal((hidden, ffn_hidden)), rng.standard_normal(ffn_hidden),
            rng.standard_normal((ffn_hidden, hidden)), rng.standard_normal(hidden))


@st.composite
def ffn_problems(draw):
    batch = draw(st.integers(1, 3))
    n_blocks = draw(st.integers(1, 6))
    block = draw(st.integers(1, 8))
    hidden = draw(st.integers(1, 12))
    ffn_hidden = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, n_blocks * block, block, hidden, ffn_hidden, seed


@settings(max_examples=examples(60))
@given(ffn_problems())
def test_blockwise_equals_whole_sequence(problem):
    batch, seq, block, hidden, ffn_hidden, seed = problem
    rng = np.random.default_rng(seed)
    ffn = relu_ffn(*_weights(rng, hidden, ffn_hidden))
    x = rng.standard_normal((batch, seq, hidden))
    out = blockwise_feedforward(ffn, x, block)
    full = ffn(x)
    assert out.shape == full.shape == (batch, seq, hidden)
    np.testing.assert_array_equal(out, full)  # bit for bit: same row-wise operations


@settings(max_examples=examples(30))
@given(ffn_problems())
def test_blas_matmul_ffn_agrees_to_rounding(problem):
    # A BLAS matmul may choose another kernel for another row count: equal up to the last bits.
    batch, seq, block, hidden, ffn_hidden, seed = problem
    rng = np.random.default_rng(seed)
    w1, b1, w2, b2 = _weights(rng, hidden, ffn_hidden)
    ffn = lambda t: np.maximum(0.0, t @ w1 + b1) @ w2 + b2  # noqa: E731
    x = rng.standard_normal((batch, seq, hidden))
    full = ffn(x)
    np.testing.assert_allclose(blockwise_feedforward(ffn, x, block), full,
                               rtol=0, atol=1e-13 * max(1.0, np.abs(full).max()))


@settings(max_examples=examples(30))
@given(st.integers(1, 5), st.sampled_from([1, 2, 3, 4, 6, 12]))
def test_elementwise_ffn_is_bit_exact(batch, block):
    x = np.random.default_rng(batch).standard_normal((batch, 12, 5))
    ffn = lambda t: np.tanh(t) * 3.0 - t  # noqa: E731  position-wise, no reductions
    np.testing.assert_array_equal(blockwise_feedforward(ffn, x, block), ffn(x))


def test_each_block_seen_once_in_order():
    seen = []

    def ffn(t):
        seen.append(t[0, :, 0].copy())
        return t * 2

    x = np.arange(2 * 6 * 1, dtype=float).reshape(2, 6, 1)
    out = blockwise_feedforward(ffn, x, 2)
    np.testing.assert_array_equal(out, 2 * x)
    assert [list(s) for s in seen] == [[0, 1], [2, 3], [4, 5]]


def test_output_width_may_differ_and_jax_arrays_work():
    import jax.numpy as jnp

    w = np.random.default_rng(0).standard_normal((4, 7))
    x = np.random.default_rng(1).standard_normal((2, 8, 4))
    out = blockwise_feedforward(lambda t: jnp.asarray(t) @ w, jnp.asarray(x), 4)
    assert out.shape == (2, 8, 7) and hasattr(out, "device")  # stayed a JAX array
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-5)


def test_lazy_export():
    assert ringattn_ref.blockwise_feedforward is blockwise_feedforward


@pytest.mark.parametrize("ffn, x, block, match", [
    (None, np.zeros((1, 4, 2)), 2, "ffn must be a callable"),
    (np.tanh, np.zeros((1, 4, 2)), 0, r"block must be a positive int; got 0"),
    (np.tanh, np.zeros((1, 4, 2)), -2, r"block must be a positive int; got -2"),
    (np.tanh, np.zeros((1, 4, 2)), 2.0, r"block must be a positive int; got 2.0"),
    (np.tanh, np.zeros((1, 4, 2)), True, r"block must be a positive int; got True"),
    (np.tanh, np.zeros((1, 6, 2)), 4, r"block \(4\) must divide the sequence length \(x.shape\[1\] = 6\)"),
    (np.tanh, np.zeros(4), 2, r"x must be an array \[batch, seq, hidden\].*got shape \(4,\)"),
    (np.tanh, [[1.0, 2.0]], 1, r"x must be an array"),
    (lambda t: t[:, :1], np.zeros((1, 4, 2)), 2, r"ffn must keep \[batch, block\] = \(1, 2\).*\(1, 1, 2\)"),
])
def test_bad_inputs_raise(ffn, x, block, match):
    with pytest.raises(ValueError, match=match):
        blockwise_feedforward(ffn, x, block)


@pytest.mark.parametrize("shapes, match", [
    (((3,), (4,), (4, 3), (3,)), "w1 and w2 must be 2-D"),
    (((3, 4), (5,), (4, 3), (3,)), r"b1 must have shape \(4,\)"),
    (((3, 4), (4,), (4, 2), (3,)), r"w2 must have shape \(4, 3\)"),
    (((3, 4), (4,), (4, 3), (2,)), r"b2 must have shape \(3,\)"),
])
def test_relu_ffn_checks_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        relu_ffn(*(np.zeros(s) for s in shapes))


def test_relu_ffn_is_the_bpt_formula():
    w1, b1, w2, b2 = _weights(np.random.default_rng(3), 3, 5)
    x = np.random.default_rng(4).standard_normal((2, 4, 3))
    want = np.maximum(0.0, x @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(relu_ffn(w1, b1, w2, b2)(x), want, rtol=1e-12, atol=1e-12)
