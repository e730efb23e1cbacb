"""Invalid input raises ValueError naming the argument, what was received and what is needed."""
import numpy as np
import pytest

from ringattn_ref import (attention, blockwise_attention, from_layout, ring_attention,
                          ring_attention_vjp, to_layout)

B, S, H, KH, D = 2, 16, 4, 2, 3
rng = np.random.default_rng(0)
Q, K, V = rng.normal(size=(B, S, H, D)), rng.normal(size=(B, S, KH, D)), rng.normal(size=(B, S, KH, D))


def ring(q, k, v, **kw):
    return ring_attention(q, k, v, **{"n_hosts": 4, **kw})


def vjp(q, k, v, **kw):
    return ring_attention_vjp(q, k, v, np.ones(q.shape), **{"n_hosts": 4, **kw})


def blockwise(q, k, v, **kw):
    return blockwise_attention(q, k, v, **kw)


ALL = [attention, blockwise, ring, vjp]
RING = [ring, vjp]
SELF = [blockwise]  # the oracle and the ring also take t != s and a value width of its own (test_ref_variants,
# test_ref_block_mask)

CASES = [  # (functions, q, k, v, kwargs, message pattern)
    (SELF, Q, K[:, :8], V[:, :8], {}, r"k/v shape \(2, 8, 2, 3\) does not match q shape"),
    (SELF, Q, K, V[:, :, :1], {}, r"k and v must have the same \[batch, seq, kv_heads\]"),
    (RING, Q, K, V[:, :, :1], {}, r"need q \[batch=2, t, heads, dim=3\], .* \(v like k but its width\)"),
    ([attention, *RING], Q, K[:, :, :, :2], V, {},
     r"need q \[batch=2, t, heads, dim=3\], k \[batch=2, s, kv_heads, dim=3\]"),
    (ALL, Q[0], K, V, {}, r"q must be 4-D \[batch, seq, heads, dim\]; got shape \(16, 4, 3\)"),
    (ALL, Q, rng.normal(size=(B, S, 3, D)), rng.normal(size=(B, S, 3, D)), {},
     r"q heads \(4\) must be divisible by k/v heads \(3\)"),
    (ALL, Q.astype(np.int64), K, V, {}, r"q must be a floating-point array; got dtype int64"),
    (ALL, Q, K, V.astype(np.int32), {}, r"v must be a floating-point array; got dtype int32"),
    (ALL, Q, K, V, {"window": (3,)}, r"window must be a pair \(left, right\)"),
    (ALL, Q, K, V, {"window": (-2, 1)}, r"window must be a pair .*got \(-2, 1\)"),
    (ALL, Q, K, V, {"segment_ids": np.zeros((B, S - 1), int)},
     r"segment_ids must have shape \[batch, seq\] = \(2, 16\); got \(2, 15\)"),
    (ALL, Q, K, V, {"segment_ids": np.zeros((B, S))}, r"segment_ids must be an integer array"),
    (ALL, Q, K, V, {"bias": np.zeros((B, H, S, S - 1))},
     r"bias must be broadcastable to \[batch, heads, seq, seq\] = \(2, 4, 16, 16\).*got shape "
     r"\(2, 4, 16, 15\)"),
    (ALL, Q, K, V, {"bias": np.zeros((H, S, S))}, r"bias must be broadcastable.*got shape \(4, 16, 16\)"),
    (ALL, Q, K, V, {"scale": -1.0}, r"scale must be a positive finite number; got -1.0"),
    ([blockwise], Q, K, V, {"block_q": 5}, r"block_q \(5\) must divide the per-host shard length \(16\)"),
    ([blockwise], Q, K, V, {"block_kv": 0}, r"block_kv must be a positive int; got 0"),
    (RING, Q, K, V, {"n_hosts": 3}, r"seq \(16\) must be divisible by n_hosts = 3"),
    (RING, Q, K, V, {"n_hosts": 0}, r"n_hosts must be a positive int; got 0"),
    (RING, Q, K, V, {"n_hosts": 16, "layout": "zigzag"},
     r"seq \(16\) must be divisible by 2\*n_hosts = 32 \(zigzag layout\)"),
    (RING, Q, K, V, {"block_q": 3}, r"block_q \(3\) must divide the per-host shard length \(4\)"),
    (RING, Q, K, V, {"block_kv": 8}, r"block_kv \(8\) must divide the per-host shard length \(4\)"),
    (RING, Q, K, V, {"layout": "diagonal"}, r"layout must be one of \('contiguous', 'striped', "
                                             r"'zigzag'\) or a permutation array; got 'diagonal'"),
    (RING, Q, K, V, {"layout": np.arange(S - 1)},
     r"layout permutation must be a 1-D int array of length seq = 16; got shape \(15,\)"),
    (RING, Q, K, V, {"layout": np.zeros(S, int)}, r"layout array must be a permutation of range\(16\)"),
]


@pytest.mark.parametrize("case", [(fn, *rest) for fns, *rest in CASES for fn in fns],
                         ids=lambda c: f"{c[0].__name__}-{c[-1][:30]}")
def test_bad_input_message(case):
    fn, q, k, v, kwargs, pattern = case
    with pytest.raises(ValueError, match=pattern):
        fn(q, k, v, **kwargs)


def test_vjp_checks_the_cotangent():
    with pytest.raises(ValueError, match=r"do must have the shape of the output \(2, 16, 4, 3\); got \(2, 16, 4\)"):
        ring_attention_vjp(Q, K, V, np.ones((B, S, H)), n_hosts=4)
    with pytest.raises(ValueError, match=r"do must be a floating-point array; got dtype int64"):
        ring_attention_vjp(Q, K, V, np.ones(Q.shape, dtype=np.int64), n_hosts=4)


def test_layout_helpers_check_their_arguments():
    with pytest.raises(ValueError, match=r"seq \(16\) must be divisible by 2\*n_hosts = 12"):
        to_layout(Q, "zigzag", 6)
    with pytest.raises(ValueError, match=r"layout must be one of"):
        from_layout(Q, "spiral", 4)


def test_ml_dtypes_floats_are_floats_and_ints_are_not():
    """bfloat16 / float8 (ml_dtypes) pass the float check that numpy's np.floating would fail."""
    import ml_dtypes

    from ringattn_ref.validation import is_float_dtype

    assert is_float_dtype(ml_dtypes.bfloat16) and is_float_dtype(ml_dtypes.float8_e4m3fn)
    assert is_float_dtype(np.float16) and is_float_dtype(np.float64)
    assert not any(is_float_dtype(t) for t in (np.int32, np.bool_, np.complex64, np.uint8))
