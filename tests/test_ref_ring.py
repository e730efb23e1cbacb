"""The ring simulation (ringattn_ref.ring): exactness, invariants and trace facts."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import (attention, blockwise_attention, from_layout, hop_attention, merge,
                          ring_attention, to_layout, variants)
from ringattn_ref.blockwise import bias_tile
from ringattn_ref.layouts import layout_permutation
from ringattn_ref.shards import HopConfig, KVShard, QShard
from ringattn_ref.testing import attention_problems, max_abs_error as max_err
from helpers import examples

TOL = 1e-12


@settings(max_examples=examples(60))
@given(attention_problems(max_hosts=8))
def test_ring_equals_attention(p):
    o, trace = ring_attention(p.q, p.k, p.v, return_trace=True, **p.ring_kwargs())
    assert not np.isnan(o).any()
    assert max_err(o, attention(p.q, p.k, p.v, **p.mask_kwargs())) <= TOL
    n = p.n_hosts
    assert trace.n_steps == n and trace.kv_idx.shape == (n, n)
    c = p.q.shape[1] // n
    assert np.all(trace.tiles_computed + trace.tiles_skipped
                  == (c // p.block_q) * (c // p.block_kv))


@settings(max_examples=examples(20))
@given(attention_problems(max_hosts=1, layouts=("contiguous",)))
def test_one_host_equals_blockwise(p):
    o = ring_attention(p.q, p.k, p.v, **p.ring_kwargs())
    o_bw = blockwise_attention(p.q, p.k, p.v, block_q=p.block_q, block_kv=p.block_kv,
                               **p.mask_kwargs())
    assert max_err(o, o_bw) <= TOL


@settings(max_examples=examples(25))
@given(attention_problems(max_hosts=6), st.randoms(use_true_random=False))
def test_result_independent_of_hop_order(p, random):
    """Each host's per-hop partials, merged in a random order, give the same attention."""
    seq = p.q.shape[1]
    n, c = p.n_hosts, seq // p.n_hosts
    kw = p.mask_kwargs()
    scale = p.q.shape[3] ** -0.5 if kw["scale"] is None else kw["scale"]
    perm = layout_permutation(p.layout, seq, n)
    lay = [to_layout(x, p.layout, n) for x in (p.q, p.k, p.v)]
    seg = None if kw["segment_ids"] is None else to_layout(kw["segment_ids"], p.layout, n)
    outs = []
    for my_idx in range(n):
        qs = slice(my_idx * c, (my_idx + 1) * c)
        hops = list(range(n))
        random.shuffle(hops)
        o, lse = None, None
        for kv_idx in hops:
            ks = slice(kv_idx * c, (kv_idx + 1) * c)
            bias = bias_tile(kw["bias"], perm[None, qs], perm[None, ks])  # this hop's block, by true positions
            part = hop_attention(QShard(lay[0][:, qs], perm[qs], None if seg is None else seg[:, qs]),
                                 KVShard(lay[1][:, ks], lay[2][:, ks], perm[ks], None if seg is None else seg[:, ks],
                                         bias),
                                 HopConfig(scale=scale, causal=kw["causal"], window=kw["window"], block_q=p.block_q,
                                           block_kv=p.block_kv))
            o, lse = part if o is None else merge(o, lse, *part)
        outs.append(o)
    o = from_layout(np.concatenate(outs, axis=1), p.layout, n)
    assert max_err(o, attention(p.q, p.k, p.v, **kw)) <= TOL


@given(st.integers(1, 8), st.integers(1, 4), st.sampled_from(["contiguous", "striped", "zigzag",
                                                             "permutation"]), st.integers(0, 99))
def test_layout_round_trip_and_ownership(n, per, layout, seed):
    seq = 2 * n * per
    if layout == "permutation":
        layout = np.random.default_rng(seed).permutation(seq)
    x = np.random.default_rng(seed).normal(size=(2, seq, 3))
    assert np.array_equal(from_layout(to_layout(x, layout, n), layout, n), x)
    perm = layout_permutation(layout, seq, n)
    shards = perm.reshape(n, seq // n)  # host r owns layout slice r
    if isinstance(layout, str) and layout == "striped":
        assert all(np.array_equal(shards[d], np.arange(d, seq, n)) for d in range(n))
    if isinstance(layout, str) and layout == "zigzag":
        chunks = np.arange(seq).reshape(2 * n, per)
        assert all(np.array_equal(shards[r], np.concatenate([chunks[r], chunks[2 * n - 1 - r]]))
                   for r in range(n))


def test_large_logits_stay_finite():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(1, 16, 2, 4)) for _ in range(3))
    for layout in ("contiguous", "striped", "zigzag"):
        o = ring_attention(q * 1e3, k, v, n_hosts=4, causal=True, layout=layout, block_q=2,
                           block_kv=2)
        assert np.isfinite(o).all()
        assert max_err(o, attention(q * 1e3, k, v, causal=True)) <= TOL


def test_fully_masked_rows_give_zeros():
    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(2, 16, 2, 4)) for _ in range(3))
    bias = np.zeros((1, 1, 16, 16))
    bias[..., [0, 7, 12], :] = -np.inf
    o = ring_attention(q, k, v, n_hosts=4, bias=bias, layout="zigzag", causal=True)
    assert np.all(o[:, [0, 7, 12]] == 0) and not np.isnan(o).any()


def _trace(n, c, layout, *, causal=True, block=1, b=1, h=1, d=2, kv_heads=1, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, n * c, h, d))
    k, v = (rng.normal(size=(b, n * c, kv_heads, d)) for _ in range(2))
    return ring_attention(q, k, v, n_hosts=n, causal=causal, layout=layout, block_q=block,
                          block_kv=block, return_trace=True)[1]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_schedule_and_bytes_sent_per_step(n):
    b, c, kv_heads, d = 2, 4, 2, 3
    t = _trace(n, c, "contiguous", causal=False, block=2, b=b, h=4, d=d, kv_heads=kv_heads)
    hosts, steps = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    assert np.array_equal(t.kv_idx, (hosts - steps) % n)  # kv_idx = (my_idx - step) % N
    kv_bytes = 2 * b * c * kv_heads * d * 8  # K and V shards, float64
    assert np.all(t.bytes_sent[:, :-1] == kv_bytes)
    assert np.all(t.bytes_sent[:, -1] == 0)  # no wasted final send
    assert np.all(t.meta_bytes_sent[:, :-1] == c * 8) and np.all(t.meta_bytes_sent[:, -1] == 0)
    assert not t.hop_skipped.any()


def test_causal_contiguous_skips_exactly_upper_hops():
    n = 8
    t = _trace(n, 4, "contiguous", block=2)
    assert np.array_equal(t.hop_skipped, t.kv_idx > np.arange(n)[:, None])
    assert np.all(t.flops[t.hop_skipped] == 0) and np.all(t.flops[~t.hop_skipped] > 0)


@pytest.mark.parametrize("tiles", [2, 4, 8])
def test_critical_path_matches_tile_count_formulas(tiles):
    """Causal, 8 hosts, T tiles per shard side (block = 1 token): contiguous costs
    T(T+1)/2 + (N-1)T^2 tiles on the critical path, striped N*T(T+1)/2, zigzag N*T^2/2 + T/2."""
    n, tile_flops = 8, 4 * 1 * 1 * 1 * 1 * 2
    cp = {lay: _trace(n, tiles, lay).critical_path() / tile_flops
          for lay in ("contiguous", "striped", "zigzag")}
    assert cp["contiguous"] == tiles * (tiles + 1) / 2 + (n - 1) * tiles ** 2
    assert cp["striped"] == n * tiles * (tiles + 1) / 2
    assert cp["zigzag"] == n * tiles ** 2 / 2 + tiles / 2


@pytest.mark.slow
def test_striped_and_zigzag_halve_the_critical_path():
    """<= 0.55 x contiguous at 8 hosts, causal. Zigzag gets there with 4 tiles per shard side
    (0.541); striped skips only whole tiles, so it needs 32 (ratio 4(T+1)/(7.5T+0.5) = 0.549)."""
    n = 8
    contiguous4 = _trace(n, 4, "contiguous").critical_path()
    assert _trace(n, 4, "zigzag").critical_path() <= 0.55 * contiguous4
    assert _trace(n, 4, "striped").critical_path() > 0.55 * contiguous4
    contiguous32 = _trace(n, 32, "contiguous").critical_path()
    assert _trace(n, 32, "striped").critical_path() <= 0.55 * contiguous32


@pytest.mark.parametrize("layout", ["contiguous", "striped", "zigzag"])
def test_peak_bytes_constant_when_hosts_and_seq_grow_together(layout):
    c, b, h, kv_heads, d, block = 4, 2, 4, 2, 3, 2
    peaks = [_trace(n, c, layout, block=block, b=b, h=h, d=d, kv_heads=kv_heads).peak_bytes
             for n in (2, 4, 8)]
    assert all(np.all(p == peaks[0][0]) for p in peaks)
    # q, k/v shard, k/v receive buffer, o, m, l, one score tile; float64
    want = 8 * (b * c * h * d + 4 * b * c * kv_heads * d + b * c * h * d + 2 * b * h * c
                + b * h * block * block)
    assert peaks[0][0] == want


def test_trace_work_per_host_and_flops():
    t = _trace(4, 4, "contiguous", block=2, b=2, h=3, d=5)
    assert np.array_equal(t.flops, t.tiles_computed * 4 * 2 * 3 * 2 * 2 * 5)
    assert np.array_equal(t.work_per_host(), t.flops.sum(axis=1))
    assert t.layout == "contiguous" and (t.block_q, t.block_kv) == (2, 2)


PROGRAMS = [  # mask_fn / score_fn pairs of ringattn_ref.variants, and a per-head mask
    dict(mask_fn=variants.prefix_lm(3)), dict(mask_fn=variants.chunked_local(4)),
    dict(mask_fn=variants.streaming(1, 2), score_fn=variants.alibi(variants.alibi_slopes(8))),
    dict(mask_fn=lambda q, k, qs, ks, h: (q + k + h) % 3 != 1), dict(score_fn=variants.softcap(1.5))]


@settings(max_examples=examples(20))
@given(attention_problems(max_hosts=6), st.sampled_from(PROGRAMS))
def test_ring_with_mask_and_score_functions_equals_attention(p, program):
    o, trace = ring_attention(p.q, p.k, p.v, return_trace=True, **p.ring_kwargs(), **program)
    assert max_err(o, attention(p.q, p.k, p.v, **p.mask_kwargs(), **program)) <= TOL
    c = p.q.shape[1] // p.n_hosts
    assert np.all(trace.tiles_computed + trace.tiles_skipped == (c // p.block_q) * (c // p.block_kv))
    if "mask_fn" in program:  # the block mask's empty tiles, and no others, are skipped
        n = p.n_hosts
        kv_idx = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n
        empty = (trace.block_mask.tiles == 0).sum(axis=(2, 3))[np.arange(n)[:, None], kv_idx]
        assert np.array_equal(trace.tiles_skipped, empty)
        assert np.array_equal(trace.hop_skipped, ~trace.block_mask.hops)


@settings(max_examples=examples(20))
@given(st.data())
def test_cross_attention_ring_equals_attention(data):
    """t != s: queries and keys each laid out and sharded on their own, the queries the last t positions."""
    draw = data.draw
    n, layout = draw(st.integers(1, 4)), draw(st.sampled_from(["contiguous", "striped", "zigzag"]))
    unit = 2 * n if layout == "zigzag" else n
    t, s = unit * draw(st.integers(1, 3)), unit * draw(st.integers(1, 3))
    b, hk, group, d, d_v = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2)), 2, 3
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(shape) for shape in ((b, t, hk * group, d), (b, s, hk, d), (b, s, hk, d_v)))
    kw = dict(causal=draw(st.booleans()), window=draw(st.sampled_from([None, (2, 1), (-1, 0)])))
    if draw(st.booleans()):
        kw.update(segment_ids=rng.integers(0, 2, (b, t)), kv_segment_ids=rng.integers(0, 2, (b, s)))
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal(tuple(m if draw(st.booleans()) else 1 for m in (b, hk * group, t, s)))
    block_q, block_kv = draw(st.sampled_from([1, t // n])), draw(st.sampled_from([1, s // n]))
    o = ring_attention(q, k, v, n_hosts=n, layout=layout, block_q=block_q, block_kv=block_kv, **kw)
    assert o.shape == (b, t, hk * group, d_v)
    assert max_err(o, attention(q, k, v, **kw)) <= TOL
