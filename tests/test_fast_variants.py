"""Programmable attention on the mesh (issue 22): attention sinks (``sinks``: every strategy and impl,
forward and every gradient, the sinks' own included) and logit soft-capping (``logit_softcap``: the
XLA hop, every strategy, mask and layout), against the float64 oracle (``ringattn_ref.attention``,
``ring_attention_vjp``) and a dense jnp float64 autodiff reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_fast as rf
import ringattn_ref as ref
from ringattn_ref import variants

from helpers import assert_close, dense_attention, examples

pytestmark = pytest.mark.slow  # hypothesis over strategies x devices x masks, fwd + grads in float64: ~1 min

STRATEGIES = {"ring": rf.ring_attention, "allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention}


def dense_with_sinks(q, k, v, sinks, causal):
    """jnp, float64: the sink as one more key column whose value is 0 (gpt-oss's formulation)."""
    b, s, h, d = q.shape
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * d ** -0.5
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    logits = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None], (b, h, s, 1))], axis=-1)
    p = jax.nn.softmax(logits, axis=-1)[..., :s]
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


# One example per strategy under the ci profile: the first one hypothesis tries takes the first item of
# every list, so each list starts with its richest case (8 devices, GQA, causal, zigzag); the other
# combinations with sinks are tests/test_fast_programmable.py's draws (and the thorough profile's).
@pytest.mark.parametrize("name", sorted(STRATEGIES))
@given(st.data())
@settings(max_examples=examples(1), deadline=None)
def test_every_strategy_with_sinks_equals_the_oracle_and_its_gradients(name, data):
    n = data.draw(st.sampled_from([8, 4, 2, 1]))
    h, hk = data.draw(st.sampled_from([(8, 2), (8, 8), (8, 1)]))
    causal = data.draw(st.sampled_from([True, False]))
    layout = data.draw(st.sampled_from(["zigzag", "striped", "contiguous"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    q = rng.standard_normal((2, 32, h, 8))
    k, v = rng.standard_normal((2, 2, 32, hk, 8))
    sinks = rng.standard_normal(h) * 2
    fn = STRATEGIES[name]
    with jax.enable_x64(True):
        o, lse = fn(q, k, v, mesh=rf.make_mesh(n), causal=causal, layout=layout, sinks=jnp.asarray(sinks),
                    return_lse=True)
        want_o, want_lse = ref.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
        assert_close(o, want_o, "o", tol=1e-10)
        assert_close(lse, want_lse, "lse", tol=1e-10)
        w = rng.standard_normal(o.shape)
        loss = lambda q, k, v, s: (fn(q, k, v, mesh=rf.make_mesh(n), causal=causal, layout=layout,  # noqa: E731
                                      sinks=s) * w).sum()
        dense = lambda q, k, v, s: (dense_with_sinks(q, k, v, s, causal) * w).sum()  # noqa: E731
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(sinks))
        want = jax.grad(dense, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(sinks))
    for what, g, wg in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close(g, wg, what, tol=1e-9)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "pallas_tpu_fused"])
def test_every_kernel_takes_sinks(impl):
    """The kernels compute o and lse; the sink joins after them (``softmax.add_sinks``): float32,
    interpreted, fwd and grads."""
    q, k, v = (np.random.default_rng(1).standard_normal((1, 64, 4, 16)).astype(np.float32) for _ in range(3))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    run = lambda q, s: rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), causal=True, impl=impl,  # noqa: E731
                                         block_q=16, block_kv=16, sinks=s)
    assert_close(run(q, sinks), ref.attention(q, k, v, causal=True, sinks=np.asarray(sinks)), "o", tol=2e-5)
    got = jax.grad(lambda q, s: run(q, s).sum(), argnums=(0, 1))(q, sinks)
    with jax.enable_x64(True):
        want = jax.grad(lambda q, s: dense_with_sinks(q, k.astype(np.float64), v.astype(np.float64), s,
                                                      True).sum(), argnums=(0, 1))(q.astype(np.float64),
                                                                                    np.asarray(sinks, np.float64))
    assert_close(got[0], want[0], "dq", tol=5e-5)
    assert_close(got[1], want[1], "dsinks", tol=5e-5)


def test_a_row_that_sees_nothing_has_the_sink_alone_and_finite_grads():
    q, k, v = (np.random.default_rng(2).standard_normal((1, 16, 2, 8)) for _ in range(3))
    seg = np.repeat(np.array([[0, 1]]), 8, axis=1)  # query i of segment 0 sees keys of segment 0
    sinks = jnp.asarray([0.25, -2.0])
    with jax.enable_x64(True):
        o, lse = rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=seg, padding_segment=1,
                                   sinks=sinks, return_lse=True)
        g = jax.grad(lambda s: rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=seg,
                                                 padding_segment=1, sinks=s).sum())(sinks)
    assert (np.asarray(o)[:, 8:] == 0).all()  # the padding segment's queries see nothing
    np.testing.assert_array_equal(np.asarray(lse)[:, :, 8:], np.broadcast_to(np.asarray(sinks)[None, :, None],
                                                                             (1, 2, 8)))
    assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("sinks, match", [(jnp.zeros(3), r"sinks must be a floating-point array of shape \[heads\]"),
                                          (jnp.zeros(4, jnp.int32), "sinks must be a floating-point array")])
def test_bad_sinks_are_value_errors(sinks, match):
    q, k, v = (np.zeros((1, 8, 4, 8), np.float32) for _ in range(3))
    for fn in STRATEGIES.values():
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, mesh=rf.make_mesh(2), sinks=sinks)


@given(st.data())
@settings(max_examples=examples(4), deadline=None)  # tests/test_fast_programmable.py draws soft-cap with the rest
def test_softcap_on_every_strategy_equals_the_oracle_and_the_ref_ring_backward(data):
    name = data.draw(st.sampled_from(sorted(STRATEGIES)))
    n = data.draw(st.sampled_from([1, 2, 4, 8]))
    h, hk = data.draw(st.sampled_from([(8, 8), (8, 2), (8, 1)]))
    mask = data.draw(st.sampled_from([dict(causal=True), dict(window=(5, 2)), dict(), dict(causal=True, seg=True)]))
    layout = data.draw(st.sampled_from(["contiguous", "striped", "zigzag"]))
    cap = data.draw(st.sampled_from([0.5, 2.0, 30.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    q = 3 * rng.standard_normal((2, 32, h, 8))  # large logits: the cap matters
    k, v = 3 * rng.standard_normal((2, 2, 32, hk, 8))
    seg = np.repeat(np.array([[0, 1, 1, 2]]), 8, axis=1).repeat(2, axis=0) if mask.pop("seg", False) else None
    do = rng.standard_normal(q.shape)
    kw = dict(segment_ids=seg, logit_softcap=cap, **mask)
    fn = STRATEGIES[name]
    with jax.enable_x64(True):
        run = lambda q, k, v: fn(q, k, v, mesh=rf.make_mesh(n), layout=layout, block_q=4, block_kv=4, **kw)  # noqa: E731
        o = run(q, k, v)
        got = jax.grad(lambda q, k, v: (run(q, k, v) * do).sum(), argnums=(0, 1, 2))(q, k, v)
    assert_close(o, ref.attention(q, k, v, **kw), "o", tol=1e-10)
    want = ref.ring_attention_vjp(q, k, v, do, n_hosts=2, **kw)
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, wg, what, tol=1e-9)


def test_softcap_and_sinks_together_in_float32():
    q, k, v = (3 * np.random.default_rng(3).standard_normal((1, 64, 4, 16)).astype(np.float32) for _ in range(3))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    o = rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), causal=True, logit_softcap=5.0, sinks=sinks)
    assert_close(o, ref.attention(q, k, v, causal=True, logit_softcap=5.0, sinks=np.asarray(sinks)), "o", tol=2e-5)


def test_the_ref_ring_and_its_backward_soft_cap_as_the_oracle():
    """The float64 simulation (``ringattn_ref.ring_attention`` / ``ring_attention_vjp``) against the
    oracle and a dense autodiff reference."""
    rng = np.random.default_rng(4)
    q, k, v, do = (3 * rng.standard_normal((2, 16, 4, 8)) for _ in range(4))
    for layout in ("contiguous", "zigzag"):
        o = ref.ring_attention(q, k, v, n_hosts=4, causal=True, layout=layout, logit_softcap=1.5, block_q=2)
        assert_close(o, ref.attention(q, k, v, causal=True, logit_softcap=1.5), "o", tol=1e-12)

    def dense(q, k, v):
        s = 1.5 * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5 / 1.5)
        s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), s, -jnp.inf)
        return (jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v) * do).sum()

    with jax.enable_x64(True):
        want = jax.grad(dense, argnums=(0, 1, 2))(q, k, v)
    got = ref.ring_attention_vjp(q, k, v, do, n_hosts=4, causal=True, layout="zigzag", logit_softcap=1.5)
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, wg, what, tol=1e-12)


@pytest.mark.parametrize("kw, match", [
    (dict(logit_softcap=0.0), "logit_softcap must be a positive finite number"),
    (dict(logit_softcap=True), "logit_softcap must be a positive finite real number"),
])
def test_bad_softcap_is_a_value_error(kw, match):
    q, k, v = (np.zeros((1, 8, 4, 8), np.float32) for _ in range(3))
    for fn in STRATEGIES.values():
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, mesh=rf.make_mesh(2), **kw)


def test_the_jax_nn_twin_takes_softcap_and_sinks():
    """Keywords beyond ``jax.nn``'s: the twin equals the oracle with them (and with a padded query and a
    query whose mask leaves it no key, o = 0 with sinks)."""
    rng = np.random.default_rng(5)
    q, k, v = (3 * rng.standard_normal((2, 16, 4, 8)).astype(np.float32) for _ in range(3))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    o = rf.dot_product_attention(q, k, v, is_causal=True, logit_softcap=4.0, sinks=sinks, mesh=rf.make_mesh(4))
    assert_close(o, ref.attention(q, k, v, causal=True, logit_softcap=4.0, sinks=np.asarray(sinks)), "o", tol=2e-5)
    lengths = jnp.asarray([16, 10])
    o = rf.dot_product_attention(q, k, v, is_causal=True, sinks=sinks, query_seq_lengths=lengths,
                                 key_value_seq_lengths=lengths, mesh=rf.make_mesh(4))
    want = ref.attention(q, k, v, causal=True, sinks=np.asarray(sinks))
    want[1] = ref.attention(q[1:, :10], k[1:, :10], v[1:, :10], causal=True, sinks=np.asarray(sinks))[0].tolist() + \
        np.zeros((6, 4, 8)).tolist()
    assert_close(o, want, "o with lengths", tol=2e-5)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@given(st.data())
@settings(max_examples=examples(1), deadline=None)  # one per strategy: see the sinks test above
def test_a_value_width_of_its_own_on_every_strategy(name, data):
    """MLA-like widths (d_qk = 12, d_v = 8, and wider values): fwd and grads in float64 vs the oracle and
    the ref ring's backward, every strategy, GQA, masks, layouts; ``comm_dtype`` on the ring. The first
    example (the ci profile's only one) is 4 devices, GQA, values wider than q/k, a window, striped."""
    n = data.draw(st.sampled_from([4, 8, 2, 1]))
    h, hk = data.draw(st.sampled_from([(8, 2), (8, 8), (8, 1)]))
    d, dv = data.draw(st.sampled_from([(4, 16), (12, 8)]))
    mask = data.draw(st.sampled_from([dict(window=(5, 2)), dict(causal=True), dict()]))
    layout = data.draw(st.sampled_from(["striped", "zigzag", "contiguous"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    q, k, v = rng.standard_normal((2, 32, h, d)), rng.standard_normal((2, 32, hk, d)), rng.standard_normal((2, 32, hk, dv))
    do = rng.standard_normal((2, 32, h, dv))
    fn = STRATEGIES[name]
    with jax.enable_x64(True):
        run = lambda q, k, v: fn(q, k, v, mesh=rf.make_mesh(n), layout=layout, block_q=4, block_kv=4, **mask)  # noqa: E731
        o = run(q, k, v)
        got = jax.grad(lambda q, k, v: (run(q, k, v) * do).sum(), argnums=(0, 1, 2))(q, k, v)
    assert o.shape == (2, 32, h, dv)
    assert_close(o, ref.attention(q, k, v, **mask), "o", tol=1e-10)
    for what, g, wg in zip(("dq", "dk", "dv"), got, ref.ring_attention_vjp(q, k, v, do, n_hosts=2, **mask)):
        assert_close(g, wg, what, tol=1e-9)


def test_a_value_width_in_float32_with_comm_dtype():
    """(The Pallas kernels' value width: tests/test_kernels_variants.py.)"""
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 1, 32, 4, 16)).astype(np.float32)
    v = rng.standard_normal((1, 32, 4, 8)).astype(np.float32)
    o = rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), causal=True, comm_dtype="bfloat16")
    assert_close(o, ref.attention(q, k, v, causal=True), "o", tol=2e-2)


def dense_programmed(q, k, v, do, mask_fn, score_fn, seg=None):
    """jnp float64 autodiff reference for mask_fn / score_fn (the oracle's conventions)."""
    b, s, h, d = q.shape
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * d ** -0.5
    pos = jnp.arange(s)
    qp, kp, head = pos[None, None, :, None], pos[None, None, None, :], jnp.arange(h)[None, :, None, None]
    qs = jnp.zeros_like(qp) if seg is None else jnp.asarray(seg)[:, None, :, None]
    ks = jnp.zeros_like(kp) if seg is None else jnp.asarray(seg)[:, None, None, :]
    if score_fn is not None:
        logits = score_fn(logits, qp, kp, head)
    if mask_fn is not None:
        logits = jnp.where(jnp.broadcast_to(mask_fn(qp, kp, qs, ks, head), logits.shape), logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # a row that sees nothing: 0
    return (jnp.einsum("bhqk,bkhd->bqhd", p, vv) * do).sum()


USER_FNS = {
    "chunked_local": (variants.chunked_local(8), None),
    "prefix_lm": (variants.prefix_lm(5), None),
    "streaming": (variants.streaming(2, 4), None),
    "document": (variants.document, None),
    "alibi": (None, variants.alibi(variants.alibi_slopes(8))),
    "streaming+softcap": (variants.streaming(2, 4), variants.softcap(3.0)),
    "per-head mask+alibi": (lambda qp, kp, qs, ks, head: (kp <= qp) | (head % 2 == 1),
                            variants.alibi(variants.alibi_slopes(8))),
}


@given(st.data())
@settings(max_examples=examples(4), deadline=None)  # tests/test_fast_programmable.py draws them with the rest
def test_mask_and_score_functions_on_the_ring_and_all_gather(data):
    """mask_fn / score_fn evaluated per tile in the XLA hop: fwd vs the float64 oracle, grads vs dense
    autodiff, every layout (true positions), GQA, with the built-in masks alongside."""
    name = data.draw(st.sampled_from(["ring", "allgather"]))
    fns = data.draw(st.sampled_from(sorted(USER_FNS)))
    n = data.draw(st.sampled_from([1, 2, 4, 8]))
    hk = data.draw(st.sampled_from([8, 2, 1]))
    layout = data.draw(st.sampled_from(["contiguous", "striped", "zigzag"]))
    mask_fn, score_fn = USER_FNS[fns]
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    q = rng.standard_normal((2, 32, 8, 8))
    k, v = rng.standard_normal((2, 2, 32, hk, 8))
    seg = np.repeat(np.array([[0, 1, 1, 2]]), 8, axis=1).repeat(2, axis=0) if fns == "document" else None
    do = rng.standard_normal(q.shape)
    fn = STRATEGIES[name]
    with jax.enable_x64(True):
        run = lambda q, k, v: fn(q, k, v, mesh=rf.make_mesh(n), layout=layout, block_q=4, block_kv=4,  # noqa: E731
                                 segment_ids=seg, mask_fn=mask_fn, score_fn=score_fn)
        o = run(q, k, v)
        got = jax.grad(lambda q, k, v: (run(q, k, v) * do).sum(), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(dense_programmed, argnums=(0, 1, 2))(q, k, v, do, mask_fn, score_fn, seg)
    assert_close(o, ref.attention(q, k, v, segment_ids=seg, mask_fn=mask_fn, score_fn=score_fn), "o", tol=1e-10)
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, wg, what, tol=1e-9)


def test_mask_functions_equal_the_built_ins_on_the_ring():
    q, k, v = (np.random.default_rng(7).standard_normal((1, 32, 4, 8)).astype(np.float32) for _ in range(3))
    mesh = rf.make_mesh(4)
    for kw, mask_fn in ((dict(causal=True), variants.causal), (dict(window=(5, 2)), variants.window(5, 2))):
        np.testing.assert_allclose(rf.ring_attention(q, k, v, mesh=mesh, layout="zigzag", mask_fn=mask_fn),
                                   rf.ring_attention(q, k, v, mesh=mesh, layout="zigzag", **kw), atol=2e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(mask_fn=lambda qp, kp, qs, ks, h: kp - qp), r"mask_fn must return a bool array .* got int32"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: np.asarray(kp) <= 3), r"mask_fn is not traceable by jax"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: jnp.ones((5, 5), bool)), r"mask_fn must return a bool array"),
    (dict(score_fn=lambda s, qp, kp, h: s.sum(-1)), r"score_fn must be elementwise .* found 'reduce_sum'"),
    (dict(score_fn=lambda s, qp, kp, h: s[..., None]), r"score_fn must return the shape of s, \(1, 4, 2, 3\)"),
    (dict(score_fn=3), r"score_fn must be a function"),
])
def test_bad_user_functions_are_value_errors(kw, match):
    q, k, v = (np.zeros((1, 8, 4, 8), np.float32) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), **kw)


def test_user_functions_see_global_heads_where_heads_are_split():
    """Ulysses and a ``head_axis`` split the heads over hosts; ``score_fn`` / ``mask_fn`` still see global
    head indices (a per-head ALiBi slope and a mask that differs per head), forward and grads, in the XLA
    hop; a Pallas impl asked for explicitly is a ValueError (its kernels number local heads)."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 16, 8, 8)) for _ in range(3))
    kw = dict(score_fn=variants.alibi(variants.alibi_slopes(8)),
              mask_fn=lambda qp, kp, qs, ks, h: (kp <= qp) | (h % 3 == 0), causal=False)
    mesh3 = jax.make_mesh((2, 2, 2), ("data", "sp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    runs = {"ulysses": lambda q: rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(4), **kw),
            "ring, head_axis": lambda q: rf.ring_attention(q, k, v, mesh=mesh3, head_axis="tp", **kw)}
    with jax.enable_x64(True):
        want = ref.attention(q, k, v, **kw)
        want_dq = jax.grad(lambda q: (dense_attention(q, k, v, **kw) ** 2).sum())(q)
        for what, run in runs.items():
            assert_close(run(q), want, what, tol=1e-10)
            assert_close(jax.grad(lambda q: (run(q) ** 2).sum())(q), want_dq, f"{what} dq", tol=1e-9)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match="kernels give mask_fn / score_fn local head indices"):
        rf.ulysses_attention(q32, k32, v32, mesh=rf.make_mesh(2), mask_fn=variants.causal, impl="pallas_gpu")


def test_the_bias_gradient_skips_the_softcap_and_score_fn():
    """The bias is added after the soft-cap and ``score_fn``, so dbias is dS of the final logits, not
    multiplied by the soft-cap's ``1 - t^2`` nor pulled back through ``score_fn`` (float64, vs dense autodiff)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
    bias = rng.standard_normal((1, 2, 16, 16))
    kw = dict(logit_softcap=2.0, score_fn=variants.alibi(variants.alibi_slopes(2)), causal=True)
    with jax.enable_x64(True):
        got = jax.grad(lambda b: (rf.ring_attention(q, k, v, bias=b, mesh=rf.make_mesh(2), impl="xla", **kw) ** 2)
                       .sum())(bias)
        want = jax.grad(lambda b: (dense_attention(q, k, v, bias=b, **kw) ** 2).sum())(bias)
    assert_close(got, want, "dbias", tol=1e-9)
