"""Programmable attention in the Pallas kernels: ``logit_softcap``, a value width of its own (d_v != d),
``mask_fn`` and ``score_fn``, forward and gradients, through ``ring_attention`` on a ring of 2 CPU devices.

Each kernel runs interpreted (Triton: ``interpret=True``; TPU and the fused ring: the TPU interpreter
with race detection). One call per kernel applies all four at once, in the XLA hop's order (scale,
soft-cap, ``score_fn``, then the masks), with GQA so the user functions see every query head: the
forward against the float64 oracle (``ringattn_ref.attention``), the gradients against a dense jnp
float64 autodiff of the same attention. Interpreting is slow (compiling the interpreted kernels is
most of it): one case per kernel. Beside them, which impl ``"auto"`` picks for these calls
(``dispatch.check_impl``) and where a user function that cannot lower is refused.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_fast as rf
import ringattn_ref as ref
from ringattn_fast.dispatch import check_impl
from ringattn_fast.kernels.races import races_found
from ringattn_ref import variants
from helpers import alibi_from_head, assert_close, dense_attention, examples

H, HK, SEQ = 4, 2, 32  # GQA groups of 2; 16 tokens per device, 2 x 2 tiles of 8 per hop
SOFTCAP, MASK_FN, SCORE_FN = 2.0, variants.chunked_local(8), variants.alibi(variants.alibi_slopes(H))
# (d, d_v): narrower v (GPU: 12 is padded to 16; fused: v padded to q's width), wider v (fused: q, k padded)
WIDTHS = {"pallas_gpu": (16, 12), "pallas_tpu": (16, 8), "pallas_tpu_fused": (8, 16)}


def dense(q, k, v):
    """jnp attention with the same soft-cap, score and mask functions, for autodiff (the oracle's order)."""
    b, s, h, d = q.shape
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = SOFTCAP * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, kk) * d ** -0.5 / SOFTCAP)
    pos = jnp.arange(s)
    qp, kp, head = pos[None, None, :, None], pos[None, None, None, :], jnp.arange(h)[None, :, None, None]
    logits = SCORE_FN(logits, qp, kp, head)
    logits = jnp.where(MASK_FN(qp, kp, jnp.zeros_like(qp), jnp.zeros_like(kp), head), logits, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), vv)


@pytest.mark.slow  # three interpreted kernels, fwd + bwd: ~1.5 min of CPU time
@pytest.mark.parametrize("impl", list(WIDTHS))
def test_softcap_value_width_mask_and_score_functions(impl):
    d, d_v = WIDTHS[impl]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, SEQ, H, d)).astype(np.float32)
    k = rng.standard_normal((1, SEQ, HK, d)).astype(np.float32)
    v = rng.standard_normal((1, SEQ, HK, d_v)).astype(np.float32)
    do = rng.standard_normal((1, SEQ, H, d_v)).astype(np.float32)
    run = lambda q, k, v: rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), layout="striped", impl=impl,  # noqa: E731
                                            block_q=8, block_kv=8, logit_softcap=SOFTCAP, mask_fn=MASK_FN,
                                            score_fn=SCORE_FN)
    o, pull = jax.vjp(run, q, k, v)  # one forward for o and the gradients
    got = pull(jnp.asarray(do))
    assert o.shape == (1, SEQ, H, d_v)
    want_o = ref.attention(*(x.astype(np.float64) for x in (q, k, v)), logit_softcap=SOFTCAP, mask_fn=MASK_FN,
                           score_fn=SCORE_FN)
    assert_close(o, want_o, "o", tol=2e-5)
    with jax.enable_x64(True):
        loss = lambda *a: (dense(*a) * do).sum()  # noqa: E731
        want = jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(np.float64) for x in (q, k, v)))
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == wg.shape, (what, g.shape, wg.shape)
        assert_close(g, wg, what, tol=5e-5)
    if impl != "pallas_gpu":
        assert not races_found()


# per kernel: (d, d_v) pairs it tiles (Triton wants d >= 16; the fused ring pads the narrower of q/k and v)
KERNEL_WIDTHS = {"pallas_gpu": [(16, 16), (16, 12)], "pallas_tpu": [(16, 16), (16, 8)],
                 "pallas_tpu_fused": [(8, 8), (8, 16)]}
KERNEL_MASKS = {"none": None, "chunked_local": variants.chunked_local(8), "prefix_lm": variants.prefix_lm(5)}


@pytest.mark.slow  # each example interprets a forward and a backward kernel: ~10-40 s
@given(st.data())
@settings(max_examples=examples(6), deadline=None)
def test_kernels_in_any_combination_equal_the_oracle(data):
    """Every Pallas kernel (interpreted) on 1, 2, 4 or 8 devices with soft-cap x sinks x d_v x T != S x
    mask_fn x score_fn x layouts x GQA x segments, through the ring or the all-gather, in float32: the
    forward against the float64 oracle (2e-5), the gradients (sinks' too) against a dense float64
    autodiff (5e-5)."""
    impl = data.draw(st.sampled_from(sorted(KERNEL_WIDTHS)), "impl")
    name = data.draw(st.sampled_from(["ring", "allgather"]) if impl != "pallas_tpu_fused" else st.just("ring"),
                     "strategy")
    n = data.draw(st.sampled_from([1, 2, 4, 8]), "devices")
    t, s = data.draw(st.sampled_from([(32, 32), (16, 32), (32, 16)]), "t, s")
    hk = data.draw(st.sampled_from([4, 2, 1]), "kv heads")
    d, d_v = data.draw(st.sampled_from(KERNEL_WIDTHS[impl]), "d, d_v")
    layout = data.draw(st.sampled_from(["contiguous", "striped", "zigzag"]), "layout")
    causal, segments, use_sinks = (data.draw(st.booleans(), x) for x in ("causal", "segments", "sinks"))
    cap = data.draw(st.sampled_from([None, 4.0]), "logit_softcap")
    mask_fn = KERNEL_MASKS[data.draw(st.sampled_from(sorted(KERNEL_MASKS)), "mask_fn")]
    score_fn = alibi_from_head(H) if data.draw(st.booleans(), "alibi") else None
    rng = np.random.default_rng(data.draw(st.integers(0, 99), "seed"))
    q = rng.standard_normal((1, t, H, d)).astype(np.float32)
    k = rng.standard_normal((1, s, hk, d)).astype(np.float32)
    v = rng.standard_normal((1, s, hk, d_v)).astype(np.float32)
    do = rng.standard_normal((1, t, H, d_v)).astype(np.float32)
    seg = dict(segment_ids=np.sort(rng.integers(0, 3, (1, t)), axis=1).astype(np.int32),
               kv_segment_ids=np.sort(rng.integers(0, 3, (1, s)), axis=1).astype(np.int32)) if segments else {}
    if segments and t == s:
        seg["kv_segment_ids"] = None
    sinks = rng.standard_normal(H).astype(np.float32) if use_sinks else None
    kw = dict(causal=causal, logit_softcap=cap, mask_fn=mask_fn, score_fn=score_fn, **seg)
    fn = {"ring": rf.ring_attention, "allgather": rf.allgather_attention}[name]
    run = lambda q, k, v, sk: fn(q, k, v, mesh=rf.make_mesh(n), layout=layout, impl=impl, sinks=sk,  # noqa: E731
                                 block_q=min(8, t // n), block_kv=min(8, s if name == "allgather" else s // n),
                                 **kw)
    sk = None if sinks is None else jnp.asarray(sinks)
    o, pull = jax.vjp(run, q, k, v, sk)  # sinks None: no leaf, no gradient
    got = [g for g in pull(jnp.asarray(do)) if g is not None]
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    s64 = None if sinks is None else sinks.astype(np.float64)
    with jax.enable_x64(True):  # the oracle too: the score function computes its slope with jnp
        assert_close(o, ref.attention(*x64, sinks=s64, **kw), "o", tol=2e-5)
        s64 = None if s64 is None else jnp.asarray(s64)
        argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
        want = jax.grad(lambda *a: (dense_attention(*a[:3], sinks=a[3], **kw) * do).sum(), argnums=argnums)(
            *x64, s64)
    for what, g, wg in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close(g, wg, what, tol=5e-5)
    if impl != "pallas_gpu":
        assert not races_found()


@pytest.mark.slow  # the fused ring interpreted, fwd + bwd, twice: ~30 s
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fused_ring_cross_attention_with_x64_enabled(layout):
    """The fused ring with 16 queries against 32 keys, causal (contiguous: hosts disagree on which hops
    are empty), float32 inputs with jax_enable_x64 on: forward vs the float64 oracle, gradients vs dense
    float64 autodiff."""
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((1, 16, H, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 32, HK, 8)).astype(np.float32) for _ in range(2))
    with jax.enable_x64(True):
        run = lambda q, k, v: rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), layout=layout, causal=True,  # noqa: E731
                                                impl="pallas_tpu_fused", block_q=8, block_kv=8)
        o, pull = jax.vjp(run, q, k, v)
        got = pull(jnp.asarray(do))
        x64 = [x.astype(np.float64) for x in (q, k, v)]
        assert o.dtype == np.float32
        assert_close(o, ref.attention(*x64, causal=True), "o", tol=2e-5)
        want = jax.grad(lambda *a: (dense_attention(*a, causal=True) * do).sum(), argnums=(0, 1, 2))(*x64)
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, wg, what, tol=5e-5)
    assert not races_found()


def test_auto_picks_the_kernels_for_them_unless_a_function_gathers():
    """On a GPU or TPU mesh ``"auto"`` picks the platform's kernel for a soft-cap, d_v != d, a mask and a
    score function; a function that indexes an array by head (``variants.alibi``: a gather, which
    neither Mosaic nor Triton lowers) goes to the XLA hop, and asking a compiled kernel for it is a
    ValueError; interpreted (CPU) the kernels take it."""
    q, k = np.zeros((2, 1, 8, H, 16), np.float32)
    v = np.zeros((1, 8, H, 8), np.float32)
    arith = lambda s, qp, kp, head: s - (head + 1).astype(s.dtype) * jnp.abs(qp - kp).astype(s.dtype)  # noqa: E731
    kw = dict(logit_softcap=SOFTCAP, mask_fn=MASK_FN, score_fn=arith)
    assert [check_impl("auto", p, q, k, v, **kw) for p in ("cpu", "gpu", "tpu")] == ["xla", "pallas_gpu",
                                                                                    "pallas_tpu_fused"]
    assert [check_impl("auto", p, q, k, v, score_fn=SCORE_FN) for p in ("gpu", "tpu")] == ["xla", "xla"]
    for impl, platform in (("pallas_gpu", "gpu"), ("pallas_tpu", "tpu"), ("pallas_tpu_fused", "tpu")):
        with pytest.raises(ValueError, match=rf"impl='{impl}': score_fn indexes an array \(a gather"):
            check_impl(impl, platform, q, k, v, score_fn=SCORE_FN)
        assert check_impl(impl, "cpu", q, k, v, logit_softcap=SOFTCAP, mask_fn=MASK_FN, score_fn=SCORE_FN) == impl
