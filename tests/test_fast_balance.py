"""The fast ring's schedule reports its balance (issue 23): ``ringattn_fast.schedule.ring_balance`` gives
the tiles each host computes at each step, the critical path and the imbalance figure, equal to what the
float64 ring simulation counts (``RingTrace.balance``), for fixed layouts and a balancing layout object."""
import numpy as np
import pytest

import ringattn_fast as rf
import ringattn_ref as ref
from ringattn_fast.schedule import ring_balance


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "per_document"])
def test_ring_balance_counts_what_the_ring_computes(layout):
    lengths = [40, 12, 8, 4]  # 4 packed documents, causal: zigzag over the whole sequence is not balanced
    seg = np.repeat(np.arange(4), lengths)[None]
    lay = ref.per_document_zigzag(lengths, 4) if layout == "per_document" else layout
    perm = lay.perm if layout == "per_document" else layout
    got = ring_balance(64, 4, layout=lay, causal=True, segment_ids=seg, block_q=4, block_kv=4)
    q, k, v = (np.random.default_rng(0).standard_normal((1, 64, 2, 8)) for _ in range(3))
    o, trace = ref.ring_attention(q, k, v, n_hosts=4, causal=True, segment_ids=seg, layout=perm, block_q=4,
                                  block_kv=4, return_trace=True)
    want = trace.balance()
    np.testing.assert_array_equal(got.work, want.work)
    assert (got.critical_path, got.imbalance) == (want.critical_path, want.imbalance)
    np.testing.assert_allclose(rf.ring_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                                 mesh=rf.make_mesh(4), causal=True, segment_ids=seg, layout=perm),
                               ref.attention(q, k, v, causal=True, segment_ids=seg), atol=2e-5)
