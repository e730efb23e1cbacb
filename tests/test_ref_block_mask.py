"""The block mask (ringattn_ref.block_mask) and the ref ring's use of it: mask_fn / score_fn, cross-attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import attention, block_mask, ring_attention, ring_attention_vjp, variants
from ringattn_ref.block_mask import EMPTY, FULL, PARTIAL, ring_block_mask, tile_kinds
from ringattn_ref.masks import allowed
from helpers import examples

TOL = 1e-12
MASK_FNS = {
    "none": None,
    "chunked": variants.chunked_local(3),
    "prefix": variants.prefix_lm(4),
    "per-head": lambda q, k, qs, ks, h: (k + h) % 3 != 0,  # [1, h, 1, s]: each head its own keys
    "document": variants.document,
    "nothing": lambda q, k, qs, ks, h: q < -1,  # positions are >= 0: [b|1, 1, t, 1], no pair
}


def dense_kinds(mask_fn, q_pos, k_pos, q_seg, k_seg, *, block_q, block_kv, heads, causal, window):
    """Brute force: the whole [b, h, sq, sk] mask at once, then each tile's any / all."""
    q_pos, k_pos = np.atleast_2d(q_pos), np.atleast_2d(k_pos)
    seg = (None, None) if q_seg is None else (q_seg[:, :, None], k_seg[:, None, :])
    ok = allowed(q_pos[:, :, None], k_pos[:, None, :], *seg, causal=causal, window=window)[:, None]
    if mask_fn is not None:
        qs, ks = (np.zeros_like(q_pos), np.zeros_like(k_pos)) if q_seg is None else (q_seg, k_seg)
        ok = ok & mask_fn(q_pos[:, None, :, None], k_pos[:, None, None, :], qs[:, None, :, None],
                          ks[:, None, None, :], np.arange(heads)[None, :, None, None])
    b = max(q_pos.shape[0], k_pos.shape[0], 1 if q_seg is None else q_seg.shape[0])
    ok = np.broadcast_to(ok, (b, heads, q_pos.shape[1], k_pos.shape[1]))
    nq, nk = q_pos.shape[1] // block_q, k_pos.shape[1] // block_kv
    kinds = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            t = ok[:, :, i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
            kinds[i, j] = FULL if t.all() else PARTIAL if t.any() else EMPTY
    return kinds


@settings(max_examples=examples(25))
@given(st.data())
def test_tile_kinds_equal_a_dense_evaluation(data):
    draw = data.draw
    b, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    block_q, block_kv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sq, sk = block_q * draw(st.integers(1, 4)), block_kv * draw(st.integers(1, 4))
    rows = draw(st.sampled_from([1, b]))
    q_pos = np.array(draw(st.lists(st.integers(0, 12), min_size=rows * sq, max_size=rows * sq))).reshape(rows, sq)
    k_pos = np.array(draw(st.lists(st.integers(0, 12), min_size=rows * sk, max_size=rows * sk))).reshape(rows, sk)
    name = draw(st.sampled_from(sorted(MASK_FNS)))
    segs = name == "document" or draw(st.booleans())
    q_seg, k_seg = (None, None) if not segs else (np.array(draw(st.lists(st.integers(0, 1), min_size=b * n,
                                                                         max_size=b * n))).reshape(b, n)
                                                   for n in (sq, sk))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (2, -1), (1, 3), (-1, 0)]))
    chunk = draw(st.sampled_from([1, 7, block_mask.CHUNK_PAIRS]))  # 1: one tile per chunk
    kw = dict(block_q=block_q, block_kv=block_kv, heads=heads, causal=causal, window=window)
    old, block_mask.CHUNK_PAIRS = block_mask.CHUNK_PAIRS, chunk
    try:
        got = tile_kinds(MASK_FNS[name], q_pos, k_pos, q_seg=q_seg, k_seg=k_seg, **kw)
    finally:
        block_mask.CHUNK_PAIRS = old
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, dense_kinds(MASK_FNS[name], q_pos, k_pos, q_seg, k_seg, **kw))


def test_tile_kinds_semantics():
    pos = np.arange(4)
    np.testing.assert_array_equal(tile_kinds(None, pos, pos, block_q=2, block_kv=2, causal=True), [[2, 0], [1, 2]])
    np.testing.assert_array_equal(tile_kinds(None, pos, pos, block_q=2, block_kv=2), np.full((2, 2), FULL))
    head0 = lambda q, k, qs, ks, h: h == 0  # noqa: E731  head 0 sees everything, head 1 nothing
    assert (tile_kinds(head0, pos, pos, block_q=2, block_kv=2, heads=1) == FULL).all()
    assert (tile_kinds(head0, pos, pos, block_q=2, block_kv=2, heads=2) == PARTIAL).all()  # any head, all heads
    seg = np.array([[0, 0, 0, 0], [1, 1, 1, 1]])  # row 0 sees the keys of id 0, row 1 nothing
    assert (tile_kinds(None, pos, pos, q_seg=seg, k_seg=np.zeros((2, 4), int), block_q=2, block_kv=2)
            == PARTIAL).all()  # any batch row, all batch rows
    zeros = np.zeros((2, 4), int)
    assert (tile_kinds(None, pos, pos, q_seg=zeros, k_seg=zeros, block_q=2, block_kv=2) == FULL).all()
    assert (tile_kinds(head0, np.tile(pos, (2, 1)), pos, block_q=2, block_kv=2) == FULL).all()
    assert (tile_kinds(MASK_FNS["nothing"], pos, pos, block_q=4, block_kv=1) == EMPTY).all()


def _document(seq, n_docs=8):
    """Positions only: each of n_docs equal documents sees itself (the brief's document mask)."""
    return lambda q, k, *_: (q // (seq // n_docs)) == (k // (seq // n_docs))


def test_document_mask_skips_most_tiles_on_8_hosts():
    bm = ring_block_mask(_document(8192), 8192, 8, block_q=128, block_kv=128, causal=True)
    counts = bm.tile_counts()
    print(f"document mask, 8 docs, causal, seq 8192, 8 hosts contiguous, 128 x 128 tiles: {counts}, "
          f"{bm.skipped_fraction:.1%} of tiles and {bm.empty_hop_fraction:.1%} of hops skipped, {bm.seconds:.2f} s")
    assert bm.skipped_fraction >= 0.6
    assert bm.tiles.shape == (8, 8, 8, 8) and sum(counts.values()) == bm.tiles.size
    np.testing.assert_array_equal(bm.hops, np.tile(np.arange(8) == 0, (8, 1)))  # each host sees only its own shard
    assert bm.empty_hop_fraction == 56 / 64
    # the ring skips them too, and is exact
    seq, rng = 512, np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, seq, 1, 2)) for _ in range(3))
    o, trace = ring_attention(q, k, v, n_hosts=8, causal=True, mask_fn=_document(seq), block_q=8, block_kv=8,
                              return_trace=True)
    assert np.abs(o - attention(q, k, v, causal=True, mask_fn=_document(seq))).max() <= TOL
    skipped = trace.tiles_skipped.sum() / (trace.tiles_skipped + trace.tiles_computed).sum()
    assert skipped >= 0.6 and trace.hop_skipped.sum() == 56


@pytest.mark.parametrize("layout, t, s, causal, name", [
    ("contiguous", 32, 32, False, "chunked"), ("striped", 32, 32, True, "prefix"),
    ("zigzag", 16, 48, True, "per-head"), ("striped", 48, 16, False, "chunked"),
    (np.random.default_rng(1).permutation(32), 32, 32, False, "chunked")])
def test_block_mask_hops_are_the_rings_empty_hops(layout, t, s, causal, name):
    n, rng = 4, np.random.default_rng(0)
    mask_fn = MASK_FNS[name]
    q, k, v = rng.standard_normal((1, t, 2, 2)), rng.standard_normal((1, s, 1, 2)), rng.standard_normal((1, s, 1, 2))
    kw = dict(n_hosts=n, layout=layout, causal=causal, mask_fn=mask_fn, block_q=2, block_kv=2)
    o, trace = ring_attention(q, k, v, return_trace=True, **kw)
    assert np.abs(o - attention(q, k, v, causal=causal, mask_fn=mask_fn)).max() <= TOL
    bm = ring_block_mask(mask_fn, t, n, layout=layout, kv_seq_len=s, block_q=2, block_kv=2, heads=2, causal=causal)
    np.testing.assert_array_equal(bm.hops, ~trace.hop_skipped)
    np.testing.assert_array_equal(bm.tiles, trace.block_mask.tiles)
    kv_idx = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n
    empty = (bm.tiles == EMPTY).sum(axis=(2, 3))[np.arange(n)[:, None], kv_idx]  # (host, step)
    np.testing.assert_array_equal(trace.tiles_skipped, empty)  # every empty tile, and only those, skipped


def jnp_attention(q, k, v, *, causal, mask_fn=None, score_fn=None, bias=None):
    """Dense attention with t != s (queries the last t positions), in jnp, for jax.vjp."""
    t, s, h = q.shape[1], k.shape[1], q.shape[2]
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[3] ** -0.5
    q_pos, k_pos = (jnp.arange(t) + s - t)[None, None, :, None], jnp.arange(s)[None, None, None, :]
    head = jnp.arange(h)[None, :, None, None]
    if score_fn is not None:
        logits = score_fn(logits, q_pos, k_pos, head)
    if bias is not None:
        logits = logits + bias
    mask = jnp.broadcast_to((k_pos <= q_pos) | (not causal), logits.shape)
    if mask_fn is not None:
        mask = mask & mask_fn(q_pos, k_pos, 0 * q_pos, 0 * k_pos, head)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m) - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v)


@pytest.mark.parametrize("layout, t, s, causal, hk, fns", [
    ("contiguous", 8, 24, True, 1, None), ("striped", 24, 8, True, 2, None),
    ("zigzag", 16, 32, False, 1, "alibi+chunked"), ("striped", 16, 16, True, 2, "softcap+prefix")])
def test_cross_attention_ring_and_grads_equal_the_oracle(layout, t, s, causal, hk, fns):
    rng = np.random.default_rng(t + s)
    b, h, d, d_v = 2, 2, 3, 4
    q, do = rng.standard_normal((b, t, h, d)), rng.standard_normal((b, t, h, d_v))
    k, v = rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d_v))
    bias = rng.standard_normal((1, h, t, s))
    fn = {None: {}, "alibi+chunked": dict(score_fn=variants.alibi(variants.alibi_slopes(h)),
                                          mask_fn=variants.chunked_local(6)),
          "softcap+prefix": dict(score_fn=variants.softcap(1.5), mask_fn=variants.prefix_lm(5))}[fns]
    kw = dict(causal=causal, bias=bias, **fn)
    o = ring_attention(q, k, v, n_hosts=4, layout=layout, block_q=2, block_kv=2, **kw)
    assert o.shape == (b, t, h, d_v)
    assert np.abs(o - attention(q, k, v, **kw)).max() <= TOL
    grads = ring_attention_vjp(q, k, v, do, n_hosts=4, layout=layout, block_q=2, block_kv=2, **kw)
    with jax.enable_x64(True):
        @jax.jit  # one compile is cheaper than op-by-op dispatch here
        def fwd_bwd(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: jnp_attention(q, k, v, **kw), q, k, v)
            return o, vjp(do)
        o_jax, want = fwd_bwd(*(jnp.asarray(x) for x in (q, k, v, do)))
    assert np.abs(np.asarray(o_jax) - o).max() <= TOL
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.shape == w.shape and np.abs(g - np.asarray(w)).max() <= TOL, name


def test_plot_block_mask():
    from ringattn_ref.viz_blocks import plot_block_mask
    fig = plot_block_mask(ring_block_mask(_document(64), 64, 4, layout="zigzag", block_q=4, block_kv=4, causal=True))
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match="bm must be a BlockMask"):
        plot_block_mask(block_mask.BlockMask(np.zeros((2, 3, 1, 1), np.int8), np.zeros((2, 2), bool), 0.0))


@pytest.mark.parametrize("call, match", [
    (lambda: tile_kinds(None, np.arange(4), np.arange(4), block_q=3, block_kv=2), r"block_q must .* dividing .* \(4\)"),
    (lambda: tile_kinds(None, np.arange(4.0), np.arange(4), block_q=2, block_kv=2), "q_pos must be a non-empty int"),
    (lambda: tile_kinds(None, np.arange(4), np.arange(4), q_seg=np.zeros(4, int), block_q=2, block_kv=2),
     "q_seg and k_seg go together"),
    (lambda: tile_kinds(None, np.arange(4), np.arange(4), heads=0, block_q=2, block_kv=2), "heads must be"),
    (lambda: tile_kinds(lambda *a: 1.0, np.arange(4), np.arange(4), block_q=2, block_kv=2), "mask_fn must return"),
    (lambda: tile_kinds("causal", np.arange(4), np.arange(4), block_q=2, block_kv=2), "mask_fn must be a function"),
    (lambda: ring_block_mask(None, 16, 4, layout=np.arange(16), kv_seq_len=8, block_q=1, block_kv=1), "layout"),
    (lambda: ring_block_mask(None, 16, 4, kv_seq_len=6, block_q=1, block_kv=1), r"kv_seq_len \(6\) must be divisible"),
    (lambda: ring_block_mask(None, 12, 4, layout="zigzag", block_q=1, block_kv=1),
     r"seq_len \(12\) must be divisible by 2\*n_hosts = 8"),
    (lambda: ring_block_mask(None, 12, 0, block_q=1, block_kv=1), "n_hosts must be a positive int"),
    (lambda: ring_block_mask(None, 16, 4, kv_seq_len=8, block_q=1, block_kv=4), "block_kv must .* K/V shard"),
    (lambda: ring_block_mask(None, 0, 4, block_q=1, block_kv=1), "seq_len must be a positive int"),
    (lambda: ring_block_mask(None, 16, 4, kv_seq_len=2.0, block_q=1, block_kv=1), "kv_seq_len must be"),
])
def test_block_mask_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ring_cross_attention_errors():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 8, 2, 2)), rng.standard_normal((1, 16, 1, 2))
    with pytest.raises(ValueError, match="layout: a permutation array"):
        ring_attention(q, k, k, n_hosts=2, layout=np.arange(8))
    with pytest.raises(ValueError, match=r"k and v \(s = 8 keys.*divisible by 2\*n_hosts = 16"):
        ring_attention(k, q[:, :, :1], q[:, :, :1], n_hosts=8, layout="zigzag")  # 16 queries, 8 keys
    with pytest.raises(ValueError, match="pass kv_segment_ids"):
        ring_attention(q, k, k, n_hosts=2, segment_ids=np.zeros((1, 8), int))
    with pytest.raises(ValueError, match="bias must be broadcastable"):
        ring_attention(q, k, k, n_hosts=2, bias=np.zeros((1, 1, 16, 16)))
    with pytest.raises(ValueError, match="score_fn must be a function"):
        ring_attention(q, k, k, n_hosts=2, score_fn=3)
    real_only = lambda s, q, k, h: np.maximum(s.real, 0.0)  # noqa: E731  drops the complex step
    with pytest.raises(ValueError, match="complex step"):
        ring_attention_vjp(q, k, k, q, n_hosts=2, score_fn=real_only)
