"""Attention dropout (issue 12): the mask is a function of (key, batch, head, true query and key
position), so the ring gives the same result for every ring size, layout and block size; the
backward is exact against dense attention with the same mask; bad arguments are ValueErrors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
from helpers import rel_err
import ringattn_ref as ref
from ringattn_ref.dropout import check_dropout, dropout_mask, keep_bits, row_hash
from ringattn_ref.masks import allowed

RATE = 0.3
KEY = jax.random.key(7)
WORDS = np.asarray(jax.random.key_data(KEY))


def arrays(b=2, s=32, h=4, hk=2, d=8, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((2, b, s, h, d)).astype(dtype)
    k, v = rng.standard_normal((2, b, s, hk, d)).astype(dtype)
    return q, k, v, do


def test_hash_is_the_same_in_numpy_and_jnp_and_keeps_one_minus_rate():
    """One definition serves both: identical bits; the keep fraction is 1 - rate, and the mask changes
    with the key, the batch row, the head and either position (no structure left)."""
    b, h, s = 2, 3, 64
    args = (np.arange(b)[:, None, None], np.arange(h)[None, :, None], np.arange(s)[None, None, :])
    bits_np = keep_bits(row_hash(WORDS, *args)[..., None], np.arange(s)[None, None, None, :])
    bits_jnp = keep_bits(row_hash(jnp.asarray(WORDS), *(jnp.asarray(a) for a in args))[..., None],
                         jnp.arange(s)[None, None, None, :])
    assert bits_np.dtype == np.uint32 and np.array_equal(bits_np, np.asarray(bits_jnp))
    keep = dropout_mask(WORDS, RATE, b, h, np.arange(s)[None], np.arange(s)[None]) > 0  # (b, h, q, k)
    assert abs(keep.mean() - (1 - RATE)) < 0.01
    other = dropout_mask(WORDS + np.uint32(1), RATE, b, h, np.arange(s)[None], np.arange(s)[None]) > 0
    for a, c in [(keep, other), (keep[0], keep[1]), (keep[:, 0], keep[:, 1]), (keep[..., :-1, :], keep[..., 1:, :]),
                 (keep[..., :-1], keep[..., 1:])]:  # another key, row, head, query, key position
        assert abs((a == c).mean() - (RATE ** 2 + (1 - RATE) ** 2)) < 0.03  # independent masks agree this often


@pytest.mark.parametrize("n_hosts, layout, block", [(1, "contiguous", 8), (2, "striped", 4), (4, "zigzag", 2)])
def test_ref_ring_matches_dense_with_the_same_mask(n_hosts, layout, block):
    q, k, v, do = arrays()
    kw = dict(causal=True, window=(9, -1), dropout_rate=RATE, dropout_key=WORDS)
    want = ref.attention(q, k, v, **kw)
    got = ref.ring_attention(q, k, v, n_hosts=n_hosts, layout=layout, block_q=block, block_kv=block // 2 or 1, **kw)
    assert np.abs(got - want).max() <= 1e-12
    assert np.abs(want - ref.attention(q, k, v, causal=True, window=(9, -1))).max() > 0.1  # dropout did something


def test_ref_backward_is_the_derivative_of_dense_dropout_attention():
    """ring_attention_vjp with dropout against central differences of the dense oracle (float64)."""
    q, k, v, do = (x.astype(np.float64) for x in arrays())
    kw = dict(causal=True, dropout_rate=RATE, dropout_key=11)
    grads = ref.ring_attention_vjp(q, k, v, do, n_hosts=4, layout="zigzag", block_q=2, block_kv=4, **kw)
    rng, eps = np.random.default_rng(1), 1e-5
    for name, g in zip("qkv", grads):
        t = rng.standard_normal(g.shape)
        plus = {"q": q, "k": k, "v": v, name: {"q": q, "k": k, "v": v}[name] + eps * t}
        minus = {"q": q, "k": k, "v": v, name: {"q": q, "k": k, "v": v}[name] - eps * t}
        fd = ((ref.attention(**plus, **kw) - ref.attention(**minus, **kw)) * do).sum() / (2 * eps)
        assert abs(fd - (g * t).sum()) <= 1e-7 * max(1.0, abs(fd))


@pytest.fixture(scope="module")
def fast_dropout():
    """The fast ring with dropout on several meshes, layouts and blocks (one compile each)."""
    q, k, v, _ = arrays()
    kw = dict(causal=True, window=(9, -1), dropout_rate=RATE, dropout_key=KEY)
    return {cfg: np.asarray(rf.ring_attention(q, k, v, mesh=rf.make_mesh(cfg[0]), layout=cfg[1], block_q=cfg[2],
                                              block_kv=cfg[2], **kw))
            for cfg in [(1, "contiguous", None), (4, "zigzag", 2), (8, "striped", 4)]}


@pytest.mark.slow
def test_fast_matches_ref_for_every_ring_size_layout_and_block(fast_dropout):
    q, k, v, _ = arrays()
    want = ref.attention(q, k, v, causal=True, window=(9, -1), dropout_rate=RATE, dropout_key=WORDS)
    first = next(iter(fast_dropout.values()))
    for cfg, got in fast_dropout.items():
        assert rel_err(got, want) <= 2e-6, cfg
        assert rel_err(got, first) <= 2e-6, cfg  # ring-size, layout and block independent


def test_fast_dropout_with_the_batch_split_and_an_int_seed():
    """A (data, sp) mesh: each host offsets its batch index, so the mask is the global one."""
    q, k, v, _ = arrays(b=4, s=16)
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    got = rf.ring_attention(q, k, v, mesh=mesh, causal=True, dropout_rate=RATE, dropout_key=12345)
    want = ref.attention(q, k, v, causal=True, dropout_rate=RATE, dropout_key=12345)
    assert rel_err(got, want) <= 2e-6


def dense_dropout64(q, k, v, seed, *, causal=True):
    """Dense float64 attention in jnp with the dropout multiplier of ringattn_ref.dropout: a jax.vjp oracle."""
    b, s, h, _ = q.shape
    pos = np.arange(s)[None]
    mask = jnp.asarray(allowed(pos[:, :, None], pos[:, None, :], causal=causal))[:, None]
    keep = jnp.asarray(dropout_mask(seed, RATE, b, h, pos, pos))
    g = h // k.shape[2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, 2)) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1) * keep
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, g, 2))


@pytest.mark.slow
def test_fast_gradients_equal_dense_attention_with_the_same_mask():
    """jax.vjp of the ring (float64, 2 hosts, zigzag, 2 x 1 tiles) against jax.vjp of dense attention."""
    q, k, v, do = arrays(s=8)
    with jax.enable_x64(True):
        q, k, v, do = (jnp.asarray(x, jnp.float64) for x in (q, k, v, do))
        kw = dict(mesh=rf.make_mesh(2), causal=True, layout="zigzag", block_q=2, block_kv=1, dropout_rate=RATE,
                  dropout_key=KEY)
        ring = lambda q, k, v: rf.ring_attention(q, k, v, **kw)  # noqa: E731
        o, vjp = jax.vjp(ring, q, k, v)
        o_want, vjp_want = jax.vjp(lambda q, k, v: dense_dropout64(q, k, v, WORDS), q, k, v)
        assert rel_err(o, o_want) <= 1e-12
        for got, want in zip(vjp(do), vjp_want(do)):
            assert rel_err(got, want) <= 1e-12


def test_dropout_errors():
    q, k, v, _ = arrays(s=16)
    mesh = rf.make_mesh(2)
    for rate in (-0.1, 1.0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\)"):
            rf.ring_attention(q, k, v, mesh=mesh, dropout_rate=rate, dropout_key=KEY)
        with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\)"):
            ref.attention(q, k, v, dropout_rate=rate, dropout_key=1)
    with pytest.raises(ValueError, match="dropout_key is required when dropout_rate > 0"):
        rf.ring_attention(q, k, v, mesh=mesh, dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout_key is required when dropout_rate > 0"):
        ref.ring_attention(q, k, v, n_hosts=2, dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout_key must be"):
        rf.ring_attention(q, k, v, mesh=mesh, dropout_rate=0.1, dropout_key=jnp.zeros(3, jnp.uint32))
    with pytest.raises(ValueError, match="dropout_key must be"):
        ref.attention(q, k, v, dropout_rate=0.1, dropout_key=np.zeros(3))
    for impl in ("pallas_gpu", "pallas_tpu"):
        with pytest.raises(ValueError, match=rf"impl='{impl}' does not support dropout_rate > 0"):
            rf.ring_attention(q, k, v, mesh=mesh, impl=impl, dropout_rate=0.1, dropout_key=KEY)
    assert check_dropout(0.0, None) == (0.0, None)  # rate 0 needs no key
