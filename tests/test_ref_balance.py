"""Load balance (ringattn_ref.balance): the work model, per-document zigzag, the solver; exact attention under both."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import attention, ring_attention, variants
from ringattn_ref.balance import (balance, balanced_layout, critical_path, imbalance, layout_block_mask,
                                  step_imbalance, work)
from ringattn_ref.block_mask import ring_block_mask
from ringattn_ref.layouts import Layout, as_layout, layout_permutation, per_document_zigzag
from ringattn_ref.packing import segment_ids_from_cu_seqlens
from helpers import examples, random_qkv

FIXED = ("contiguous", "striped", "zigzag")


def packed(lengths, seq):
    """Segment ids [seq] of documents of ``lengths`` from position 0 (the rest padding, id 0)."""
    return segment_ids_from_cu_seqlens(np.concatenate([[0], np.cumsum(lengths)]), seq)[0]


@st.composite
def packed_batches(draw):
    """n_hosts, tile side, seq and document lengths (1 to 6 documents, maybe a padded tail)."""
    n = draw(st.sampled_from([2, 4]))
    block = draw(st.sampled_from([1, 2, 4]))
    per_host = block * draw(st.integers(1, 4))
    seq = n * per_host * (2 if draw(st.booleans()) else 1)
    cuts = sorted(draw(st.lists(st.integers(1, seq - 1), max_size=5, unique=True)))
    end = seq - draw(st.integers(0, seq // 4))
    bounds = [0] + [c for c in cuts if c < end] + [end]
    return n, block, seq, np.diff(bounds)


def test_work_counts_the_tiles_of_each_host_at_each_step():
    bm = ring_block_mask(None, 16, 4, block_q=4, block_kv=4, causal=True)  # one tile per hop
    w = work(bm)
    np.testing.assert_array_equal(w, np.tril(np.ones((4, 4))))  # host i computes its first i + 1 steps
    assert critical_path(bm) == 4 and imbalance(bm) == 4 / 2.5 and step_imbalance(bm) == 4 / 2.5
    assert imbalance(ring_block_mask(None, 16, 4, layout="zigzag", block_q=2, block_kv=2, causal=True)) == 1.0
    b = balance(np.array([[2.0, 0.0], [0.0, 2.0]]))  # equal totals, but each step waits for a busy host
    assert (b.imbalance, b.step_imbalance, b.critical_path) == (1.0, 2.0, 4.0)
    assert imbalance(np.zeros((3, 3))) == step_imbalance(np.zeros((3, 3))) == 1.0  # nothing visible
    half = work(ring_block_mask(None, 8, 2, block_q=4, block_kv=4, causal=True), partial=0.5)
    np.testing.assert_array_equal(half, [[0.5, 0.0], [0.5, 1.0]])  # host 1 sees shard 0 full at step 1
    np.testing.assert_array_equal(work(bm, hop=2.0), 3 * np.tril(np.ones((4, 4))))  # + 2 per live hop


def test_the_trace_reports_the_balance_of_the_tiles_it_computed():
    q, k, v = random_qkv(1, 32, 2, 1, 4, seed=1, dtype=np.float64)
    mask_fn = variants.prefix_lm(5)
    _, trace = ring_attention(q, k, v, n_hosts=4, mask_fn=mask_fn, block_q=2, block_kv=2, return_trace=True)
    np.testing.assert_array_equal(trace.balance().work, work(trace.block_mask))
    assert trace.imbalance() == imbalance(trace.block_mask) > 1.0  # contiguous: host 0 sees only the prefix
    _, trace = ring_attention(q, k, v, n_hosts=4, causal=True, layout="zigzag", block_q=2, block_kv=2,
                              return_trace=True)
    assert trace.imbalance() == 1.0 and trace.balance().critical_path == trace.tiles_computed.max(axis=0).sum()


def test_per_document_zigzag_zigzags_each_document():
    np.testing.assert_array_equal(per_document_zigzag([8, 4], 2).perm, [0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10])
    np.testing.assert_array_equal(per_document_zigzag([32], 4).perm, layout_permutation("zigzag", 32, 4))
    lay = per_document_zigzag([7, 5, 3], 4, seq_len=16)  # lengths not multiples of 2N, a padded tail
    np.testing.assert_array_equal(lay.inverse[lay.perm], np.arange(16))


@settings(max_examples=examples(30))
@given(packed_batches())
def test_per_document_zigzag_splits_every_document_evenly(batch):
    n, _, seq, lengths = batch
    lay = per_document_zigzag(lengths, n, seq)
    np.testing.assert_array_equal(np.sort(lay.perm), np.arange(seq))
    np.testing.assert_array_equal(lay.perm[lay.inverse], np.arange(seq))
    host = lay.inverse // (seq // n)  # the host of each true position
    for doc in np.split(np.arange(seq), np.cumsum(lengths))[:-1]:
        per_host = np.bincount(host[doc], minlength=n)
        assert per_host.max() - per_host.min() <= 2, per_host  # 2 * (L // 2N) each, plus at most 2 extra tokens


@settings(max_examples=examples(25))
@given(packed_batches())
def test_the_solver_beats_every_fixed_layout(batch):
    n, block, seq, lengths = batch
    kw = dict(segment_ids=packed(lengths, seq), causal=True, block_q=block, block_kv=block)
    fixed = [f for f in FIXED if f != "zigzag" or seq % (2 * n) == 0] + [per_document_zigzag(lengths, n, seq)]
    scores = [balance(layout_block_mask(f, seq, n, **kw)) for f in fixed]
    by_ratio = balance(layout_block_mask(balanced_layout(None, seq, n, candidates=fixed, objective="imbalance",
                                                         **kw), seq, n, **kw))
    by_time = balance(layout_block_mask(balanced_layout(None, seq, n, candidates=fixed, **kw), seq, n, **kw))
    for f, s in zip(fixed, scores):
        what = f if isinstance(f, str) else "per-document zigzag"
        assert by_ratio.imbalance <= s.imbalance, what
        assert by_time.critical_path <= s.critical_path, what
    # the solver alone keeps the sorted rounds' bound, max - mean <= (N - 1) / N * (r_max - r_min), chunks of a tile
    alone = balance(layout_block_mask(balanced_layout(None, seq, n, candidates=(), **kw), seq, n, **kw))
    rows = layout_block_mask("contiguous", seq, n, **kw).tiles  # (host, shard, nq, nk) in true order
    r = (rows != 0).sum(axis=(1, 3)).ravel()  # each query tile's work against every key
    assert alone.host_totals.max() - alone.host_totals.mean() <= (n - 1) / n * (r.max() - r.min()) + 1e-9
    assert alone.work.sum() == scores[0].work.sum()  # moving whole tiles keeps the tiles


MASKS = {  # name -> (ring / oracle keywords given segment ids of the packed batch)
    "causal documents": lambda seg: dict(causal=True, segment_ids=seg[None]),
    "window": lambda seg: dict(window=(3, 0)),
    "prefix-LM": lambda seg: dict(mask_fn=variants.prefix_lm(5)),
}


@settings(max_examples=examples(12))
@given(packed_batches(), st.sampled_from(sorted(MASKS)), st.sampled_from(["per-document zigzag", "solver"]))
def test_balanced_layouts_give_the_oracle(batch, mask, which):
    n, block, seq, lengths = batch
    seg = packed(lengths, seq)
    kw = MASKS[mask](seg)
    if which == "solver":
        lay = balanced_layout(kw.get("mask_fn"), seq, n, segment_ids=kw.get("segment_ids"),
                              causal=kw.get("causal", False), window=kw.get("window"), block_q=block, block_kv=block)
    else:
        lay = per_document_zigzag(lengths, n, seq)
    q, k, v = random_qkv(1, seq, 2, 1, 4, seed=seq, dtype=np.float64)
    got = ring_attention(q, k, v, n_hosts=n, layout=lay.perm, block_q=block, block_kv=block, **kw)
    want = attention(q, k, v, **kw)
    assert np.abs(got - want).max() <= 1e-12


def test_bad_input_names_the_argument_and_the_numbers():
    with pytest.raises(ValueError, match=r"doc_lengths sum to 20 tokens, past seq_len = 16"):
        per_document_zigzag([12, 8], 4, seq_len=16)
    with pytest.raises(ValueError, match=r"doc_lengths must be non-negative"):
        per_document_zigzag([4, -1], 1)
    with pytest.raises(ValueError, match=r"seq \(18\) must be divisible by n_hosts = 4"):
        per_document_zigzag([10, 8], 4)
    with pytest.raises(ValueError, match=r"layout is not a permutation of range\(4\): 1 positions missing \[1\], "
                                         r"1 repeated \[2\]"):
        as_layout([0, 2, 2, 3], 4)
    with pytest.raises(ValueError, match=r"layout.inverse must be the inverse"):
        as_layout(Layout(np.arange(4), np.arange(4)[::-1]), 4)
    with pytest.raises(ValueError, match=r"candidates\[0\] is not a permutation of range\(8\): .*1 outside \[9\]"):
        balanced_layout(None, 8, 2, causal=True, candidates=[np.array([9, 1, 2, 3, 4, 5, 6, 7])])
    with pytest.raises(ValueError, match=r"chunk must be a positive multiple of lcm\(block_q, block_kv\) = 2 dividing "
                                         r"the shard seq_len / n_hosts = 8; got 3"):
        balanced_layout(None, 16, 2, causal=True, block_q=2, block_kv=1, chunk=3)
    with pytest.raises(ValueError, match=r"block_kv must be a positive int dividing the shard seq_len / n_hosts = 8"):
        balanced_layout(None, 16, 2, block_kv=3)
    with pytest.raises(ValueError, match=r"objective must be one of"):
        balanced_layout(None, 16, 2, objective="fast")
    with pytest.raises(ValueError, match=r"segment_ids must be an int array \[seq_len\] .* = 16; got shape \(8,\)"):
        balanced_layout(None, 16, 2, segment_ids=np.zeros(8, int))
    with pytest.raises(ValueError, match=r"work must be a non-negative \[n_hosts, n_steps\] array"):
        imbalance(np.ones((2, 3)))


def test_the_balance_benchmark_prints_the_figures(capsys):
    """``python -m benchmarks.bench --mode balance --time false`` at a tiny size: the table and the verdicts."""
    from benchmarks import bench
    rows = bench.main(["--mode", "balance", "--seq", "256", "--block", "8", "--time", "false"])
    err = capsys.readouterr().err
    by = {r["layout"]: r for r in rows}
    assert list(by) == ["contiguous", "striped", "zigzag", "per-document zigzag", "solver (critical_path)",
                        "solver (imbalance)"]
    assert by["solver (critical_path)"]["critical_path"] == min(r["critical_path"] for r in rows)
    assert by["solver (imbalance)"]["imbalance"] == min(r["imbalance"] for r in rows)
    assert "| layout | picked | imbalance |" in err and "expectations held" in err and "mode=balance" in err
