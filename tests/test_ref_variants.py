"""The oracle's programmable attention (``ringattn_ref.attention`` with ``logit_softcap``, ``sinks``, a
value width of its own, ``t != s``, ``mask_fn``, ``score_fn``; ``ringattn_ref.variants``) against a
slow second oracle written pair by pair from the definitions, and against the built-in keywords."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import attention, variants

from helpers import examples


def slow_attention(q, k, v, *, allow, score=None, softcap=None, sinks=None, q_pos, k_pos):
    """Row by row from the definitions: ``allow(b, h, i, j)``, positions ``q_pos[i]``, ``k_pos[j]``."""
    b, t, h, d = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    o, lse = np.zeros((b, t, h, dv)), np.full((b, h, t), -np.inf)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hk)
            for i in range(t):
                logits = []
                for j in range(s):
                    x = float(q[bi, i, hi] @ k[bi, j, g]) / math.sqrt(d)
                    x = x if softcap is None else softcap * math.tanh(x / softcap)
                    x = x if score is None else score(x, q_pos[i], k_pos[j], hi)
                    logits.append(x if allow(bi, hi, i, j) else -math.inf)
                logits = np.array(logits + ([] if sinks is None else [sinks[hi]]))
                if np.isneginf(logits).all():
                    continue
                w = np.exp(logits - logits.max())
                lse[bi, hi, i] = logits.max() + math.log(w.sum())
                o[bi, i, hi] = (w[:s] / w.sum()) @ v[bi, :, g]
    return o, lse


def qkv(t, s, h=4, hk=2, d=4, dv=None, b=2, seed=0, size=1.0):
    rng = np.random.default_rng(seed)
    return (size * rng.standard_normal((b, t, h, d)), rng.standard_normal((b, s, hk, d)),
            rng.standard_normal((b, s, hk, dv or d)))


MASKS = {  # name -> (mask_fn, the same as a function of (i_pos, j_pos, head))
    "causal": (variants.causal, lambda i, j, h: j <= i),
    "window": (variants.window(3, 1), lambda i, j, h: i - 3 <= j <= i + 1),
    "prefix_lm": (variants.prefix_lm(5), lambda i, j, h: j < 5 or j <= i),
    "chunked_local": (variants.chunked_local(4), lambda i, j, h: i // 4 == j // 4 and j <= i),
    "streaming": (variants.streaming(2, 3), lambda i, j, h: j <= i and (j < 2 or i - j <= 3)),
    "per_head": (lambda qp, kp, qs, ks, head: (kp <= qp) | (head % 2 == 1), lambda i, j, h: j <= i or h % 2 == 1),
}


@pytest.mark.parametrize("name", MASKS)
def test_mask_functions_equal_the_pairwise_definition(name):
    q, k, v = qkv(12, 12)
    mask_fn, pair = MASKS[name]
    o, lse = attention(q, k, v, mask_fn=mask_fn, return_lse=True)
    want = slow_attention(q, k, v, allow=lambda b, h, i, j: pair(i, j, h), q_pos=np.arange(12), k_pos=np.arange(12))
    np.testing.assert_allclose(o, want[0], atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))


def test_mask_functions_equal_the_keywords_bitwise():
    q, k, v = qkv(16, 16)
    seg = np.repeat(np.array([[0, 1, 1, 2]]), 4, axis=1).repeat(2, axis=0)
    for kw, fn in ((dict(causal=True), variants.causal), (dict(window=(3, 1)), variants.window(3, 1))):
        np.testing.assert_array_equal(attention(q, k, v, mask_fn=fn), attention(q, k, v, **kw))
    pad = dict(segment_ids=seg)
    np.testing.assert_array_equal(attention(q, k, v, mask_fn=variants.document, **pad), attention(q, k, v, **pad))
    np.testing.assert_array_equal(attention(q, k, v, score_fn=variants.softcap(2.0)),
                                  attention(q, k, v, logit_softcap=2.0))


def test_alibi_is_a_distance_bias():
    q, k, v = qkv(10, 10, h=4)
    slopes = variants.alibi_slopes(4)
    pos = np.arange(10)
    bias = -slopes[None, :, None, None] * np.abs(pos[:, None] - pos[None, :])[None, None]
    np.testing.assert_allclose(attention(q, k, v, score_fn=variants.alibi(slopes), causal=True),
                               attention(q, k, v, bias=bias, causal=True), atol=1e-13)


def test_softcap_caps_before_the_bias_and_the_other_order_is_a_score_fn():
    """``logit_softcap`` caps the scaled logits before the bias is added (Gemma 2): a -inf bias still
    masks exactly. Tokamax's order (bias first, then the cap) is the score function the docstrings
    give, ``c tanh((s + b) / c)``; the two differ wherever the bias is not 0 (issue 31, item 9)."""
    q, k, v = qkv(10, 10, h=4, hk=4)
    c, slopes = 2.0, variants.alibi_slopes(4)
    pos = np.arange(10)
    bias = -slopes[None, :, None, None] * np.abs(pos[:, None] - pos[None, :])[None, None]  # (1, h, t, s)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])

    def dense(logits):
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)

    ours = attention(q, k, v, bias=bias, logit_softcap=c)
    np.testing.assert_allclose(ours, dense(c * np.tanh(s / c) + bias), atol=1e-13)
    after = attention(q, k, v, score_fn=lambda s, qp, kp, h: c * np.tanh(
        (s - slopes[h] * np.abs(qp - kp)) / c))  # the bias of positions and heads, capped with the logits
    np.testing.assert_allclose(after, dense(c * np.tanh((s + bias) / c)), atol=1e-13)
    assert np.abs(ours - after).max() > 1e-3
    masked = np.where(pos[None, None, :, None] >= pos[None, None, None, :], 0.0, -np.inf)  # causal as a bias
    np.testing.assert_allclose(attention(q, k, v, bias=masked, logit_softcap=c),
                               attention(q, k, v, causal=True, logit_softcap=c), atol=1e-13)


def test_cross_attention_defaults_to_the_last_queries():
    """``t < s`` with no positions: the queries are the last t of the s positions (causal bottom-right)."""
    q, k, v = qkv(12, 12)
    full, full_lse = attention(q, k, v, causal=True, return_lse=True)
    o, lse = attention(q[:, -5:], k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(o, full[:, -5:], atol=1e-13)
    np.testing.assert_allclose(lse, full_lse[..., -5:], atol=1e-13)
    given_pos = attention(q[:, :5], k, v, causal=True, positions=np.arange(5)[None].repeat(2, 0))
    np.testing.assert_allclose(given_pos, full[:, :5], atol=1e-13)


@given(st.data())
@settings(max_examples=examples(30))
def test_every_variant_and_combination_against_the_pairwise_oracle(data):
    t, s = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 9))
    h, hk = data.draw(st.sampled_from([(2, 1), (2, 2), (4, 2)]))
    d, dv = data.draw(st.sampled_from([4, 8])), data.draw(st.sampled_from([4, 2, 6]))
    softcap = data.draw(st.sampled_from([None, 1.5, 30.0]))
    sinks = data.draw(st.sampled_from([None, np.array([0.5, -1.0, 2.0, 0.0])[:h]]))
    mask = data.draw(st.sampled_from([None, *MASKS]))
    use_score = data.draw(st.booleans())
    q, k, v = qkv(t, s, h, hk, d, dv, seed=data.draw(st.integers(0, 99)), size=data.draw(st.sampled_from([1.0, 20.0])))
    slopes = variants.alibi_slopes(h)
    kw = dict(logit_softcap=softcap, sinks=sinks, mask_fn=None if mask is None else MASKS[mask][0],
              score_fn=variants.alibi(slopes) if use_score else None)
    o, lse = attention(q, k, v, return_lse=True, **kw)
    q_pos, k_pos = np.arange(t) + s - t, np.arange(s)
    pair = (lambda i, j, h: True) if mask is None else MASKS[mask][1]
    want_o, want_lse = slow_attention(
        q, k, v, allow=lambda b, hh, i, j: pair(q_pos[i], k_pos[j], hh), softcap=softcap, sinks=sinks,
        score=(lambda x, i, j, hh: x - slopes[hh] * abs(i - j)) if use_score else None, q_pos=q_pos, k_pos=k_pos)
    assert o.shape == (2, t, h, dv)
    np.testing.assert_allclose(o, want_o, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, atol=1e-10)


def test_a_row_that_sees_nothing_is_zero_with_the_sink_alone_in_lse():
    q, k, v = qkv(4, 4)
    sinks = np.array([0.25, -2.0, 1.0, 3.0])
    nothing = lambda qp, kp, qs, ks, head: kp > 100  # noqa: E731
    o, lse = attention(q, k, v, mask_fn=nothing, sinks=sinks, return_lse=True)
    assert (o == 0).all() and np.array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))
    o, lse = attention(q, k, v, mask_fn=nothing, return_lse=True)
    assert (o == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("kw, match", [
    (dict(logit_softcap=0.0), "logit_softcap must be a positive finite number"),
    (dict(logit_softcap=float("nan")), "logit_softcap must be a positive finite number"),
    (dict(logit_softcap=True), "logit_softcap must be a positive finite real number"),
    (dict(logit_softcap="2"), "logit_softcap must be a positive finite real number"),
    (dict(sinks=np.zeros(3)), r"sinks must be a floating-point array of shape \[heads\] = \(4,\)"),
    (dict(sinks=np.zeros(4, np.int32)), "sinks must be a floating-point array"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: kp - qp), r"mask_fn must return a bool array .* got int64"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: np.ones((3, 3), bool)), r"mask_fn must return a bool array"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: 1 / 0), r"mask_fn raised ZeroDivisionError.*shapes \(1, 1, 6, 1\)"),
    (dict(score_fn=lambda s, qp, kp, h: s[..., :1]), r"score_fn must return the shape of s, \(2, 4, 6, 6\)"),
])
def test_bad_variant_arguments_are_value_errors_naming_them(kw, match):
    q, k, v = qkv(6, 6)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kw)


def test_cross_attention_segments_need_both_sides():
    q, k, v = qkv(4, 6)
    with pytest.raises(ValueError, match="pass kv_segment_ids"):
        attention(q, k, v, segment_ids=np.zeros((2, 4), np.int32))
    o = attention(q, k, v, segment_ids=np.zeros((2, 4), np.int32), kv_segment_ids=np.zeros((2, 6), np.int32))
    np.testing.assert_allclose(o, attention(q, k, v), atol=1e-14)


def test_the_ref_ring_and_its_backward_take_a_value_width_of_their_own():
    """MLA-like widths (d = 8, d_v = 4): the ring equals the oracle and its backward the dense gradient."""
    import jax
    import jax.numpy as jnp

    from ringattn_ref import blockwise_attention, ring_attention, ring_attention_vjp

    q, k, v = qkv(16, 16, h=4, hk=2, d=8, dv=4)
    want = attention(q, k, v, causal=True)
    assert want.shape == (2, 16, 4, 4)
    np.testing.assert_allclose(ring_attention(q, k, v, n_hosts=4, causal=True, layout="zigzag"), want, atol=1e-12)
    np.testing.assert_allclose(blockwise_attention(q, k, v, causal=True, block_q=4), want, atol=1e-12)
    do = np.random.default_rng(9).standard_normal(want.shape)

    def dense(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / 8 ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), s, -jnp.inf)
        return (jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), jnp.repeat(v, 2, axis=2)) * do).sum()

    with jax.enable_x64(True):
        grads = jax.grad(dense, argnums=(0, 1, 2))(q, k, v)
    for got, wg in zip(ring_attention_vjp(q, k, v, do, n_hosts=4, causal=True, layout="striped"), grads):
        np.testing.assert_allclose(got, wg, atol=1e-12)


def test_documents_is_the_packed_mask_of_static_lengths():
    p, doc = np.arange(8), np.repeat(np.arange(3), [3, 1, 4])  # documents of 3, 1 and 4 positions
    same, causal = doc[:, None] == doc[None, :], p[None, :] <= p[:, None]
    assert np.array_equal(variants.documents([3, 1, 4])(p[:, None], p[None, :], 0, 0, 0), same & causal)
    assert np.array_equal(variants.documents([3, 1, 4], causal=False)(p[:, None], p[None, :], 0, 0, 0), same)
