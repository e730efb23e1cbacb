"""All-gather and Ulysses on virtual hosts (ringattn_ref.strategies) and the three-way cost model
(ringattn_ref.strategy_cost): exactness, the traces against the model, and the textbook facts."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import (HARDWARE, allgather_attention, attention, choose_strategy, min_block_size,
                          ring_attention, strategy_costs, table2, ulysses_attention)
from ringattn_ref.strategy_cost import SIMPLICITY
from ringattn_ref.testing import attention_problems, max_abs_error as max_err
from helpers import examples

TOL = 1e-12


@settings(max_examples=examples(30), deadline=None)
@given(attention_problems(max_hosts=6))
def test_allgather_equals_attention(p):
    o, trace = allgather_attention(p.q, p.k, p.v, return_trace=True, **p.ring_kwargs())
    assert max_err(o, attention(p.q, p.k, p.v, **p.mask_kwargs())) <= TOL
    _, ring = ring_attention(p.q, p.k, p.v, return_trace=True, **p.ring_kwargs())
    assert trace.n_steps == p.n_hosts  # N - 1 gather rounds, then one attention
    np.testing.assert_array_equal(trace.total_bytes_sent(), ring.bytes_sent.sum(axis=1))  # same bytes
    assert np.all(trace.bytes_sent[:, -1] == 0) and np.all(trace.flops[:, :-1] == 0)


@settings(max_examples=examples(30), deadline=None)
@given(attention_problems(max_hosts=4, max_kv_heads=4, max_group=3).filter(
    lambda p: p.q.shape[2] % p.n_hosts == 0))
def test_ulysses_equals_attention(p):
    o, trace = ulysses_attention(p.q, p.k, p.v, return_trace=True, **p.ring_kwargs())
    assert max_err(o, attention(p.q, p.k, p.v, **p.mask_kwargs())) <= TOL
    assert trace.steps == ("all-to-all qkv", "attend", "all-to-all o")
    assert np.all(trace.bytes_sent[:, 1] == 0) and np.all(trace.flops[:, [0, 2]] == 0)
    if p.n_hosts == 1:
        assert trace.total_bytes_sent().sum() == 0


def test_ulysses_gqa_straddling_kv_heads():
    """12 heads, 3 kv heads, 4 hosts: host 1's query heads 3, 4, 5 use kv heads 0, 1, 1."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 12, 2))
    k, v = (rng.standard_normal((1, 8, 3, 2)) for _ in range(2))
    o = ulysses_attention(q, k, v, n_hosts=4, causal=True)
    assert max_err(o, attention(q, k, v, causal=True)) <= TOL


@pytest.mark.parametrize("heads, n_hosts", [(6, 4), (2, 4)])
def test_ulysses_needs_heads_divisible_by_hosts(heads, n_hosts):
    q = np.zeros((1, 8, heads, 2))
    with pytest.raises(ValueError, match=rf"heads \({heads}\) must be divisible by n_hosts \({n_hosts}\)"):
        ulysses_attention(q, q, q, n_hosts=n_hosts)
    costs = strategy_costs(seq=8, heads=heads, kv_heads=heads, dim=2, devices=n_hosts, hardware="TPU v4")
    assert not costs["ulysses"].feasible and "heads divisible by devices" in costs["ulysses"].why_not
    choice = choose_strategy(seq=8, heads=heads, dim=2, devices=n_hosts, hardware="TPU v4")
    assert choice.strategy != "ulysses" and "ulysses: not possible" in choice.reason


@settings(max_examples=examples(15), deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 4]),
       st.integers(1, 2), st.data())
def test_model_counts_what_the_simulations_count(n, kv_heads, group, c, batch, data):
    """Peak bytes and bytes sent of the worst host: the model's formulas == the simulated hosts."""
    heads, d = kv_heads * group, 2
    block = data.draw(st.sampled_from([t for t in (1, 2, 4) if c % t == 0]))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, n * c, heads, d))
    k, v = (rng.standard_normal((batch, n * c, kv_heads, d)) for _ in range(2))
    costs = strategy_costs(seq=n * c, heads=heads, kv_heads=kv_heads, dim=d, devices=n, batch=batch,
                           hardware="TPU v4", dtype_bytes=8, block=block)
    runs = {"ring": ring_attention, "allgather": allgather_attention}
    if heads % n == 0:
        runs["ulysses"] = ulysses_attention
    for name, run in runs.items():
        _, trace = run(q, k, v, n_hosts=n, block_q=block, block_kv=block, return_trace=True)
        assert costs[name].peak_bytes == trace.peak_bytes.max(), name
        assert costs[name].bytes_sent == trace.bytes_sent.sum(axis=1).max(), name


@settings(max_examples=examples(10), deadline=None)
@given(st.sampled_from([64, 128, 512]), st.sampled_from([8, 32]), st.sampled_from([1, 4]))
def test_allgather_memory_grows_with_seq_the_others_stay_flat(c, heads, group):
    """Fixed tokens per device, more devices: the all-gather holds all S tokens of K/V."""
    peaks = {name: [] for name in ("ring", "allgather", "ulysses")}
    for n in (2, 4, 8):
        costs = strategy_costs(seq=n * c, heads=heads, kv_heads=heads // group, dim=64, devices=n,
                               hardware="A100 NVLink")
        for name in peaks:
            peaks[name].append(costs[name].peak_bytes)
    assert peaks["allgather"][0] < peaks["allgather"][1] < peaks["allgather"][2]
    assert peaks["ring"][0] == peaks["ring"][1] == peaks["ring"][2]
    assert max(peaks["ulysses"]) <= 1.5 * min(peaks["ulysses"])  # S h/N = c h: flat but for the inputs


@pytest.mark.parametrize("row", table2(), ids=lambda r: r.name)
@pytest.mark.parametrize("group", [1, 4])
def test_ring_hides_its_transfers_iff_block_at_least_F_over_B(row, group):
    """c >= (kv_heads / heads) F / B in bf16 (§3, Table 2): the ring's transfers are all hidden."""
    need = min_block_size(row.flops_per_s, row.bandwidth_bytes_per_s) / group
    for c, hidden in ((math.floor(need) - 1, False), (math.ceil(need), True)):
        costs = strategy_costs(seq=8 * c, heads=4 * group, kv_heads=4, dim=128, devices=8,
                               hardware=HARDWARE[row.name], block=1)
        ring = costs["ring"]
        assert ring.overlapped is hidden and (ring.exposed_comm_s == 0) is hidden, (row.name, c)
        assert not costs["allgather"].overlapped and costs["allgather"].exposed_comm_s > 0


@settings(max_examples=examples(30), deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([4, 8, 12, 32, 128]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1024, 8192, 65536]), st.sampled_from(sorted(HARDWARE)),
       st.one_of(st.none(), st.sampled_from([2**28, 2**31, 2**34])))
def test_choice_is_feasible_near_fastest_and_simplest(n, heads, group, c, hw, limit):
    kv = max(heads // group, 1)
    try:
        choice = choose_strategy(seq=n * c, heads=heads, kv_heads=kv, dim=128, devices=n, hardware=hw,
                                 memory_limit_bytes=limit, block=128)
    except ValueError as err:  # only when nothing fits in the memory limit
        assert "no strategy fits" in str(err) and limit is not None
        return
    costs = choice.costs
    chosen = costs[choice.strategy]
    best = min(cost.time_s for cost in costs.values() if cost.feasible)
    assert chosen.feasible and chosen.time_s <= 1.05 * best
    simpler = SIMPLICITY[:SIMPLICITY.index(choice.strategy)]
    assert all(not costs[s].feasible or costs[s].time_s > 1.05 * best for s in simpler)
    assert choice.reason.startswith(choice.strategy) and str(choice) == choice.reason
    if limit is not None and costs["allgather"].peak_bytes > limit:
        assert choice.strategy != "allgather"


def test_quiz_128_heads_on_8_devices():
    """The notebook's quiz: 128 heads, 8 kv heads, 128K tokens on 8 A100s."""
    shape = dict(seq=2**17, heads=128, kv_heads=8, dim=128, devices=8)
    nvlink = choose_strategy(hardware="A100 NVLink", **shape)
    infiniband = choose_strategy(hardware="A100 InfiniBand", **shape)
    assert nvlink.costs["ring"].overlapped and infiniband.costs["ring"].overlapped  # c = 16K > 1560
    assert nvlink.strategy == "allgather"  # all three within 5%: the simplest
    assert infiniband.strategy == "ring"  # the all-gather's exposed transfer costs > 5%
    mha = choose_strategy(hardware="A100 InfiniBand", **dict(shape, kv_heads=128))
    assert mha.strategy == "ulysses" and not mha.costs["ring"].overlapped  # c = 16K < 25K


def test_cost_model_errors():
    with pytest.raises(ValueError, match=r"seq \(100\) must be divisible by devices \(8\)"):
        strategy_costs(seq=100, heads=8, kv_heads=8, dim=64, devices=8, hardware="TPU v4")
    with pytest.raises(ValueError, match="hardware must be"):
        choose_strategy(seq=64, heads=8, dim=64, devices=8, hardware="H100")
    with pytest.raises(ValueError, match=r"heads \(8\) must be divisible by kv_heads \(3\)"):
        strategy_costs(seq=64, heads=8, kv_heads=3, dim=64, devices=8, hardware="TPU v4")
