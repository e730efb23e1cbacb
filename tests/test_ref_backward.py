"""The ring backward (ringattn_ref.backward) against jax.vjp of a float64 jnp attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ringattn_ref import attention, ring_attention_vjp
from ringattn_ref.testing import attention_problems
from helpers import examples

TOL = 1e-12


def jnp_attention(q, k, v, *, causal, segment_ids, bias, window, scale):
    """Plain attention in jnp, written so that its gradients are finite for rows that see nothing."""
    b, s, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        logits = logits + bias
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    mask = jnp.ones((s, s), bool)[None, None]
    if causal:
        mask = mask & (j <= i)
    if window is not None:
        left, right = window
        mask = mask & ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    mask = mask & (logits > -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m) - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v)


def jax_grads(p):
    kw = p.mask_kwargs()
    with jax.enable_x64(True):
        @jax.jit  # one compile per example is cheaper than op-by-op dispatch here
        def fwd_bwd(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: jnp_attention(q, k, v, **kw), q, k, v)
            return o, vjp(do)
        o, grads = fwd_bwd(*(jnp.asarray(x) for x in (p.q, p.k, p.v, p.do)))
        assert o.dtype == jnp.float64
        return np.asarray(o), [np.asarray(g) for g in grads]


@settings(max_examples=examples(20))  # each example compiles a jax function
@given(attention_problems(max_hosts=8, max_shard=6))
def test_ring_vjp_equals_jax_vjp(p):
    o_jax, grads_jax = jax_grads(p)
    assert np.abs(o_jax - attention(p.q, p.k, p.v, **p.mask_kwargs())).max() <= TOL
    grads = ring_attention_vjp(p.q, p.k, p.v, p.do, **p.ring_kwargs())
    for name, g, want in zip(("dq", "dk", "dv"), grads, grads_jax):
        assert g.shape == want.shape, name
        assert np.isfinite(g).all(), name
        assert np.abs(g - want).max() <= TOL, name


def test_fully_masked_rows_give_zero_finite_gradients():
    rng = np.random.default_rng(0)
    q, do = (rng.normal(size=(2, 16, 4, 3)) for _ in range(2))
    k, v = (rng.normal(size=(2, 16, 2, 3)) for _ in range(2))
    bias = np.zeros((1, 1, 16, 16))
    rows = [1, 6, 11]
    bias[..., rows, :] = -np.inf
    dq, dk, dv = ring_attention_vjp(q, k, v, do, n_hosts=4, bias=bias, causal=True,
                                    layout="striped", block_q=2, block_kv=2)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert np.all(dq[:, rows] == 0)
    # the masked rows contribute nothing to dk/dv: dropping their do changes nothing
    do_zeroed = do.copy()
    do_zeroed[:, rows] = 0
    _, dk0, dv0 = ring_attention_vjp(q, k, v, do_zeroed, n_hosts=4, bias=bias, causal=True,
                                     layout="striped", block_q=2, block_kv=2)
    assert np.abs(dk - dk0).max() <= TOL and np.abs(dv - dv0).max() <= TOL


def test_large_logits_give_finite_gradients():
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.normal(size=(1, 16, 2, 4)) for _ in range(4))
    for layout in ("contiguous", "zigzag"):
        grads = ring_attention_vjp(q * 1e3, k, v, do, n_hosts=4, causal=True, layout=layout,
                                   block_q=2, block_kv=2)
        assert all(np.isfinite(g).all() for g in grads)


def test_gqa_gradients_are_summed_over_the_group():
    """MQA with every head identical equals MHA with one head times the group."""
    rng = np.random.default_rng(2)
    q1, k, v, do1 = (rng.normal(size=(1, 8, 1, 3)) for _ in range(4))
    q4, do4 = np.repeat(q1, 4, axis=2), np.repeat(do1, 4, axis=2)
    dq4, dk4, dv4 = ring_attention_vjp(q4, k, v, do4, n_hosts=2, causal=True)
    dq1, dk1, dv1 = ring_attention_vjp(q1, k, v, do1, n_hosts=2, causal=True)
    assert np.abs(dk4 - 4 * dk1).max() <= TOL and np.abs(dv4 - 4 * dv1).max() <= TOL
    assert np.abs(dq4 - dq1).max() <= TOL


def _trace_pair(dtype, *, causal=False, layout="contiguous", n_hosts=4, dim=8, dim_v=8, kv_heads=1, mask_fn=None):
    """The forward and backward ring traces of one problem (block 4 on shards of 8 tokens)."""
    from ringattn_ref import ring_attention

    rng = np.random.default_rng(0)
    seq, heads = 8 * n_hosts, 2
    q = rng.standard_normal((1, seq, heads, dim)).astype(dtype)
    k = rng.standard_normal((1, seq, kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((1, seq, kv_heads, dim_v)).astype(dtype)
    do = rng.standard_normal((1, seq, heads, dim_v))
    kw = dict(n_hosts=n_hosts, causal=causal, layout=layout, block_q=4, block_kv=4, mask_fn=mask_fn)
    _, fwd = ring_attention(q, k, v, return_trace=True, **kw)
    *grads, bwd = ring_attention_vjp(q, k, v, do, return_trace=True, **kw)
    want = ring_attention_vjp(q, k, v, do, **kw)
    assert all(np.array_equal(g, w) for g, w in zip(grads, want))  # the trace changes no gradient
    return fwd, bwd, (q, k, v)


def test_backward_trace_counts_five_matmuls_per_tile_and_the_forwards_tiles():
    """Per computed tile the backward does Q K^T, dV, dP, dQ, dK: 2 b h Br Bc (3 d + 2 d_v) FLOPs, 2.5x the
    forward's at d_v = d; and it computes exactly the tiles the forward computes (causal, zigzag, mask_fn)."""
    for causal, layout, mask_fn in ((False, "contiguous", None), (True, "contiguous", None), (True, "zigzag", None),
                                    (False, "contiguous", lambda q, k, qs, ks, h: (q // 8) == (k // 8))):
        fwd, bwd, _ = _trace_pair(np.float64, causal=causal, layout=layout, mask_fn=mask_fn)
        assert np.array_equal(bwd.kv_idx, fwd.kv_idx)
        assert np.array_equal(bwd.tiles_computed, fwd.tiles_computed)
        assert np.array_equal(bwd.tiles_skipped, fwd.tiles_skipped)
        assert np.array_equal(bwd.hop_skipped, fwd.hop_skipped)
        done = fwd.flops > 0
        assert np.allclose(bwd.flops[done] / fwd.flops[done], 2.5, rtol=0, atol=1e-12)
        assert (bwd.flops[~done] == 0).all()
    fwd, bwd, _ = _trace_pair(np.float64, dim=8, dim_v=4)
    assert np.allclose(bwd.flops / fwd.flops, (3 * 8 + 2 * 4) / (8 + 4))  # 2 (3d + 2d_v) vs 2 (d + d_v)


def test_backward_trace_sends_kv_and_their_float32_gradients_then_the_gradients_home():
    """bf16-sized K/V (float16 stands in: same itemsize) travel with float32 dK/dV: 3x the forward's bytes
    per step, and the last step sends the gradients home (2x); float64 inputs keep float64 gradients (2x)."""
    for dtype, ratio, last in ((np.float16, 3.0, 2.0), (np.float32, 2.0, 1.0), (np.float64, 2.0, 1.0)):
        fwd, bwd, (_, k, v) = _trace_pair(dtype, kv_heads=2)
        kv_bytes = (k.size + v.size) // 4 * np.dtype(dtype).itemsize  # one shard of 4
        assert (fwd.bytes_sent[:, :-1] == kv_bytes).all()
        assert np.array_equal(bwd.bytes_sent[:, :-1], ratio * fwd.bytes_sent[:, :-1])
        assert (bwd.bytes_sent[:, -1] == last * kv_bytes).all()
        assert np.array_equal(bwd.meta_bytes_sent, fwd.meta_bytes_sent)
    fwd, bwd, _ = _trace_pair(np.float16, n_hosts=1)
    assert (bwd.bytes_sent == 0).all() and (fwd.bytes_sent == 0).all()  # a ring of one sends nothing


def test_backward_factors_are_measured_from_the_traces():
    """bf16: 2.5x the FLOPs for 3x the bytes, so a backward hop hides its send from c >= 1.2 F/B; float32
    inputs send gradients as wide as K/V (2x); a narrower d_v changes the FLOP ratio to (3d + 2d_v)/(d + d_v)."""
    from ringattn_ref import backward_factors

    assert backward_factors(2) == (2.5, 3.0)
    assert backward_factors(4) == (2.5, 2.0) and backward_factors(8) == (2.5, 2.0)
    assert np.isclose(backward_factors(2, dim=8, dim_v=4)[0], (24 + 8) / 12)
    with pytest.raises(ValueError, match="itemsize"):
        backward_factors(3)
