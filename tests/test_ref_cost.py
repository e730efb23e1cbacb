"""Cost model: Table 2 (c >= F/B, s = 6c), Table 1 activation formulas, per-hop times, bad inputs."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import cost
from ringattn_ref.cost import (HARDWARE, Hardware, activation_bytes, hop_times, min_block_size,
                               step_bytes, step_flops, table1, table2)
from helpers import examples

# Table 2 of arXiv:2310.01889 as printed: (min block, min seq) in thousands of tokens.
PAPER_TABLE2 = {
    "A100 NVLink": (1.0, 6.2),
    "A100 InfiniBand": (24.5, 149.5),
    "TPU v3": (1.1, 6.6),
    "TPU v4": (1.0, 6.2),
    "TPU v5e": (1.1, 6.3),
}


def test_table2_rows_match_the_paper_within_its_rounding():
    rows = {r.name: r for r in table2()}
    assert list(rows) == list(PAPER_TABLE2)
    for name, (block_k, seq_k) in PAPER_TABLE2.items():
        r = rows[name]
        assert r.min_block == pytest.approx(r.flops_per_s / r.bandwidth_bytes_per_s)
        assert r.min_seq == pytest.approx(6 * r.min_block)
        if name == "A100 InfiniBand":
            # exact F/B = 24.96K, 6c = 149.8K; the paper prints 24.5K / 149.5K ("~25K").
            assert abs(r.min_block / 1e3 - block_k) / block_k < 0.02
            assert abs(r.min_seq / 1e3 - seq_k) / seq_k < 0.02
            assert round(r.min_block / 1e3) == 25
        else:
            assert round(r.min_block / 1e3, 1) == block_k
            assert round(r.min_seq / 1e3, 1) == seq_k


def test_table2_nvlink_numbers_and_text():
    (row,) = table2(["A100 NVLink"])
    assert (row.flops_per_s, row.bandwidth_bytes_per_s) == (312e12, 300e9)
    assert row.min_block == pytest.approx(1040.0) and row.min_seq == pytest.approx(6240.0)
    text = cost.format_table2(table2())
    assert "A100 NVLink" in text and "1.0K" in text and "6.2K" in text and "25.0K" in text


def test_table2_custom_hardware_and_dtype():
    hw = Hardware("toy", 100e12, 50e9)
    (row,) = table2([hw], dtype_bytes=4)  # fp32 K/V: twice the bytes, twice the min block
    assert row.min_block == pytest.approx(4000.0)


@settings(max_examples=examples(50))
@given(st.sampled_from(sorted(HARDWARE)), st.integers(1, 4), st.integers(1, 8),
       st.sampled_from([32, 64, 128, 256]), st.sampled_from([1, 2, 4]))
def test_overlap_condition_is_where_compute_meets_transfer(name, batch, heads, dim, dtype_bytes):
    hw = HARDWARE[name]
    c = min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, dtype_bytes=dtype_bytes)
    at = hop_times(c, hw, dim=dim, batch=batch, heads=heads, dtype_bytes=dtype_bytes)
    assert at.compute_s == pytest.approx(at.transfer_s, rel=1e-12)
    small = hop_times(0.5 * c, name, dim=dim, batch=batch, heads=heads, dtype_bytes=dtype_bytes)
    big = hop_times(2.0 * c, name, dim=dim, batch=batch, heads=heads, dtype_bytes=dtype_bytes)
    assert small.transfer_s > small.compute_s  # communication exposed
    assert big.compute_s > big.transfer_s  # communication hidden


def test_step_counts_follow_the_paper():
    # §3: 4 d c^2 FLOPs and 4 c d bytes (K and V in bf16) per step, with d the hidden size.
    c, d = 1024, 4096
    assert step_flops(c, d) == 4 * d * c**2
    assert step_bytes(c, d) == 4 * c * d
    assert step_flops(c, 128, batch=2, heads=32) == 4 * 2 * 32 * 128 * c**2
    assert step_bytes(c, 128, batch=2, kv_heads=8, dtype_bytes=4) == 2 * 2 * c * 8 * 128 * 4


def test_hop_times_vectorised_and_gqa_sends_less():
    shards = np.array([256, 1024, 4096])
    t = hop_times(shards, "TPU v4", dim=128, heads=8)
    assert t.compute_s.shape == t.transfer_s.shape == (3,)
    np.testing.assert_allclose(t.compute_s[1:] / t.compute_s[:-1], 16.0)  # c^2
    np.testing.assert_allclose(t.transfer_s[1:] / t.transfer_s[:-1], 4.0)  # c
    gqa = hop_times(shards, "TPU v4", dim=128, heads=8, kv_heads=2)
    np.testing.assert_allclose(gqa.transfer_s, t.transfer_s / 4)
    np.testing.assert_allclose(gqa.compute_s, t.compute_s)


def test_table1_formulas():
    b, s, h, n, c = 2, 8192, 1024, 16, 512
    rows = {r.method: r for r in table1(batch=b, seq=s, hidden=h, heads=n, shard=c)}
    want = {  # bytes in bf16, straight from Table 1
        "vanilla": (2 * b * n * s * s, 8 * b * s * h),
        "memory-efficient attention": (2 * b * s * h + 4 * b * c * h, 8 * b * s * h),
        "blockwise parallel transformer": (2 * b * s * h, 2 * b * s * h),
        "ring attention": (6 * b * c * h, 2 * b * c * h),
    }
    assert list(rows) == list(want)
    for method, (attn, ffn) in want.items():
        r = rows[method]
        assert (r.attention_bytes, r.ffn_bytes, r.total_bytes) == (attn, ffn, max(attn, ffn))
        assert r.attention_formula == cost.TABLE1_FORMULAS[method][0]
    totals = [rows[m].total_bytes for m in want]
    assert totals == sorted(totals, reverse=True)  # each technique lowers the peak


def test_table1_scaling_in_seq_and_dtype():
    seqs = np.array([4096.0, 8192.0, 16384.0])
    kw = dict(batch=1, seq=seqs, hidden=4096, heads=32, shard=2048)
    vanilla, _ = activation_bytes("vanilla", **kw)
    bpt, _ = activation_bytes("blockwise parallel transformer", **kw)
    ring, ring_ffn = activation_bytes("ring attention", **kw)
    np.testing.assert_allclose(vanilla[1:] / vanilla[:-1], 4.0)  # quadratic
    np.testing.assert_allclose(bpt[1:] / bpt[:-1], 2.0)  # linear
    assert ring.shape == ring_ffn.shape == (3,) and np.all(ring == ring[0])  # flat per host
    fp32, _ = activation_bytes("ring attention", **{**kw, "seq": 4096}, dtype_bytes=4)
    assert fp32 == 2 * ring[0]


@pytest.mark.parametrize("call, match", [
    (lambda: min_block_size(0, 1e9), r"flops_per_s must be a positive finite number.*got 0"),
    (lambda: min_block_size(1e12, -3), r"bandwidth_bytes_per_s must be .*got -3"),
    (lambda: min_block_size(1e12, float("nan")), r"bandwidth_bytes_per_s must be"),
    (lambda: min_block_size(1e12, 1e9, dtype_bytes=0), r"dtype_bytes must be"),
    (lambda: step_flops(0, 64), r"shard must be"),
    (lambda: step_bytes(16, 64, kv_heads=0), r"kv_heads must be"),
    (lambda: hop_times(128, "H100 magic"), r"hardware must be a Hardware or one of .*got 'H100 magic'"),
    (lambda: table2(["TPU v9"]), r"hardware must be"),
    (lambda: activation_bytes("flash", batch=1, seq=8, hidden=8, heads=1, shard=4), r"method must be one of"),
    (lambda: table1(batch=1, seq=-8, hidden=8, heads=1, shard=4), r"seq must be"),
])
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ring_trace_matches_the_cost_model():
    """The simulation's own counts agree with step_flops/step_bytes (float64: 8 bytes)."""
    from ringattn_ref import ring_attention

    batch, seq, heads, kv_heads, dim, n_hosts = 1, 32, 4, 2, 8, 4
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, seq, heads, dim))
    k, v = (rng.standard_normal((batch, seq, kv_heads, dim)) for _ in range(2))
    _, trace = ring_attention(q, k, v, n_hosts=n_hosts, block_q=4, block_kv=4, return_trace=True)
    shard = seq // n_hosts
    np.testing.assert_allclose(trace.flops.sum(axis=0), n_hosts * step_flops(shard, dim, batch=batch, heads=heads))
    sent = step_bytes(shard, dim, batch=batch, kv_heads=kv_heads, dtype_bytes=8)
    np.testing.assert_array_equal(trace.bytes_sent[:, :-1], sent)
    np.testing.assert_array_equal(trace.bytes_sent[:, -1], 0)  # no wasted final send


def test_lazy_exports():
    import ringattn_ref

    for name in ("HARDWARE", "step_flops", "step_bytes", "min_block_size", "hop_times", "table1", "table2"):
        assert getattr(ringattn_ref, name) is getattr(cost, name)


def test_min_block_size_gqa_and_partial_hops_cross_where_hop_times_do():
    """c = min_block_size(..., heads, kv_heads, fill) is where fill x compute equals the transfer."""
    hw = cost.HARDWARE["A100 InfiniBand"]
    c = cost.min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, heads=32, kv_heads=8, fill=0.5)
    assert np.isclose(c, 2 * 8 / 32 * hw.flops_per_s / hw.bandwidth_bytes_per_s)
    t = cost.hop_times(c, hw, dim=128, heads=32, kv_heads=8)
    assert np.isclose(0.5 * t.compute_s, t.transfer_s, rtol=1e-12)
    with pytest.raises(ValueError, match="fill"):
        cost.min_block_size(1.0, 1.0, fill=0.0)


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_backward_step_counts_are_the_ring_traces_ratios(itemsize):
    """The closed forms are the simulated ring's own counts (``backward_factors``: 2.5x FLOPs; 3x bytes in
    bf16, whose dK/dV travel as float32; 2x in float32 and float64)."""
    from ringattn_ref.backward import backward_factors

    flops_x, bytes_x = backward_factors(itemsize)
    c, d = 1024, 128
    assert cost.backward_step_flops(c, d, heads=8) == flops_x * step_flops(c, d, heads=8)
    assert cost.backward_step_bytes(c, d, kv_heads=2, dtype_bytes=itemsize) == bytes_x * step_bytes(
        c, d, kv_heads=2, dtype_bytes=itemsize)
    assert cost.backward_step_bytes(c, d, dtype_bytes=2, grad_bytes=2) == 2 * step_bytes(c, d)  # bf16 on the wire


@pytest.mark.parametrize("name", sorted(HARDWARE))
@pytest.mark.parametrize("heads, kv_heads, fill, grad_bytes", [(1, 1, 1.0, None), (32, 8, 0.5, None), (8, 8, 1.0, 2)])
def test_backward_min_block_size_is_where_backward_compute_meets_its_sends(name, heads, kv_heads, fill, grad_bytes):
    hw = HARDWARE[name]
    c = cost.backward_min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, heads=heads, kv_heads=kv_heads,
                                     fill=fill, grad_bytes=grad_bytes)
    compute = fill * cost.backward_step_flops(c, 128, heads=heads) / hw.flops_per_s
    sends = cost.backward_step_bytes(c, 128, kv_heads=kv_heads, grad_bytes=grad_bytes) / hw.bandwidth_bytes_per_s
    assert compute == pytest.approx(sends, rel=1e-12)
    if (heads, kv_heads, fill, grad_bytes) == (1, 1, 1.0, None):  # 1.2 F/B: the backward binds, not the forward
        assert c == pytest.approx(1.2 * min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s))
    with pytest.raises(ValueError, match="grad_bytes"):
        cost.backward_min_block_size(1.0, 1.0, grad_bytes=0)


def test_ring_pass_seconds_by_hand():
    rps = cost.ring_pass_seconds
    assert rps([1.0], 5.0, 5.0) == rps([1.0], 5.0, 5.0, hidden=False) == 1.0  # a ring of one sends nothing
    assert rps([1.0, 1.0], 0.5, hidden=False) == 2.5  # forward: N hops, N - 1 K/V sends
    assert rps([1.0, 1.0], 0.5) == 2.0  # ... each under a hop
    assert rps([1.0, 1.0, 1.0], 0.25, 0.5, hidden=False) == 3 + 2 * 0.25 + 3 * 0.5  # backward: dK/dV N times
    assert rps([1.0, 1.0, 1.0], 2.0, 1.0) == 2.0 + 3.0 + 1.0 + 1.0  # link-bound steps, then the send home
    assert rps([1.0, 1.0, 1.0], 0.25, 0.5) == 3.0 + 0.5  # all hidden but the last move home
