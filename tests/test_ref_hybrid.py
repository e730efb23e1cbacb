"""The 2-D hybrid (Ulysses inside groups, the ring across them) on virtual hosts (ringattn_ref.hybrid) and
in the cost model (ringattn_ref.strategy_cost): exactness on 2x2, 2x4, 4x2, the trace against the model,
two tiers of links, and the textbook facts (Ulysses degree <= heads; the hybrid wins where Ulysses cannot
run and the links are two-tier)."""
import dataclasses
from math import gcd

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import (HARDWARE, Hardware, attention, choose_strategy, hybrid_attention, hybrid_bytes_sent, hybrid_splits,
                          ring_attention, strategy_costs, ulysses_attention)
from ringattn_ref.strategy_cost import SIMPLICITY
from ringattn_ref.testing import attention_problems, max_abs_error as max_err
from helpers import examples

TOL = 1e-12
SPLITS = [(2, 2), (2, 4), (4, 2)]  # (ulysses_size, ring_size)
TWO_TIER = Hardware("A100, nodes of 4", 312e12, 300e9, group_size=4, inter_bandwidth_bytes_per_s=12.5e9)


def _heads_divisible(p, u):
    """The problem with its query heads repeated (and a per-head bias with them) until ``u`` divides them."""
    m = u // gcd(p.q.shape[2], u)
    if m == 1:
        return p
    bias = p.bias if p.bias is None or p.bias.shape[1] == 1 else np.concatenate([p.bias] * m, axis=1)
    return dataclasses.replace(p, q=np.concatenate([p.q] * m, axis=2), do=np.concatenate([p.do] * m, axis=2), bias=bias)


@st.composite
def hybrid_problems(draw):
    """A split of SPLITS and a drawn problem on its ``U * R`` hosts (every mask, layout, GQA ratio)."""
    u, r = draw(st.sampled_from(SPLITS))
    p = draw(attention_problems(min_hosts=u * r, max_hosts=u * r, max_kv_heads=4, max_group=2, max_shard=4,
                                max_dim=3))
    return u, r, _heads_divisible(p, u)


@settings(max_examples=examples(12), deadline=None)
@given(hybrid_problems())
def test_hybrid_equals_attention(drawn):
    u, r, p = drawn
    kw = p.ring_kwargs()
    kw.pop("n_hosts")
    o, trace = hybrid_attention(p.q, p.k, p.v, ulysses_size=u, ring_size=r, return_trace=True, **kw)
    assert max_err(o, attention(p.q, p.k, p.v, **p.mask_kwargs())) <= TOL
    assert trace.steps == ("all-to-all qkv",) + tuple(f"ring {s + 1}" for s in range(r)) + ("all-to-all o",)
    assert (trace.ulysses_size, trace.ring_size, trace.n_hosts) == (u, r, u * r)
    assert np.all(trace.flops[:, [0, -1]] == 0) and np.all(trace.bytes_sent[:, -2] == 0)  # no send after the last hop
    assert np.all(trace.bytes_sent[:, 1:-2] > 0) and np.all(trace.bytes_sent[:, [0, -1]] > 0)


@pytest.mark.parametrize("u, r", SPLITS)
def test_every_feature_at_once(u, r):
    """GQA with kv heads straddling the Ulysses groups (12 heads, 3 kv heads: repeated 4 / gcd(3, 4) = 4 times
    for U = 4) + causal + packed segments + a per-head bias with -inf rows + window, zigzag, uneven tiles."""
    rng = np.random.default_rng(u + r)
    b, s, h, hk, d = 2, 8 * u * r, 12, 3, 3
    q = rng.standard_normal((b, s, h, d))
    k, v = rng.standard_normal((2, b, s, hk, d))
    bias = rng.standard_normal((1, h, s, s))
    bias[:, :, rng.random(s) < 0.2] = -np.inf
    seg = np.sort(rng.integers(0, 3, (b, s)), axis=1)
    kw = dict(causal=True, segment_ids=seg, bias=bias, window=(s // 2, -1))
    o = hybrid_attention(q, k, v, ulysses_size=u, ring_size=r, layout="zigzag", block_q=2, block_kv=4, **kw)
    assert max_err(o, attention(q, k, v, **kw)) <= TOL


@settings(max_examples=examples(15), deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.integers(1, 3), st.sampled_from([1, 2, 4]),
       st.sampled_from([2, 4]), st.integers(1, 2), st.data())
def test_model_counts_what_the_simulation_counts(u, r, kv_heads, group, c, batch, data):
    """Peak and bytes per host of the hybrid: the model (strategy_costs, hybrid_bytes_sent) == the hosts;
    U = 1 is the ring's trace, R = 1 Ulysses's (the same kv heads, repeated alike, on the wire)."""
    heads = kv_heads * group * u // gcd(kv_heads * group, u)  # a multiple of u and of kv_heads
    block = data.draw(st.sampled_from([t for t in (1, 2) if c % t == 0]))
    n, rng = u * r, np.random.default_rng(0)
    q = rng.standard_normal((batch, n * c, heads, 2))
    k, v = (rng.standard_normal((batch, n * c, kv_heads, 2)) for _ in range(2))
    kw = dict(block_q=block, block_kv=block, return_trace=True)
    _, trace = hybrid_attention(q, k, v, ulysses_size=u, ring_size=r, **kw)
    cost = strategy_costs(seq=n * c, heads=heads, kv_heads=kv_heads, dim=2, devices=n, batch=batch, hardware="TPU v4",
                          dtype_bytes=8, block=block, ulysses_size=u)["hybrid"]
    sent = trace.bytes_sent.sum(axis=1)
    assert np.all(sent == sent[0]) and np.all(trace.peak_bytes == trace.peak_bytes[0])  # every host alike
    assert (cost.peak_bytes, cost.bytes_sent, cost.ulysses_size, cost.ring_size) == (trace.peak_bytes[0], sent[0], u, r)
    by_kind = hybrid_bytes_sent(seq=n * c, heads=heads, kv_heads=kv_heads, dim=2, ulysses_size=u, ring_size=r,
                                batch=batch, dtype_bytes=8)
    assert by_kind == {"all-to-all": trace.bytes_sent[0, [0, -1]].sum(),
                       "collective-permute": trace.bytes_sent[0, 1:-1].sum()}
    for applies, run in ((u == 1, ring_attention), (r == 1, ulysses_attention)):
        if applies:
            _, other = run(q, k, v, n_hosts=n, **kw)
            assert other.peak_bytes.max() == trace.peak_bytes[0] and other.bytes_sent.sum() == trace.bytes_sent.sum()


HARDWARE_ROWS = sorted(HARDWARE) + [TWO_TIER.name]


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), st.data(), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
       st.sampled_from(HARDWARE_ROWS), st.sampled_from([None, 1, 2, 4, 8]), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2]), st.sampled_from([16, 64, 128]), st.sampled_from([2, 4]))
def test_hybrid_at_one_ring_step_is_ulysses_and_at_one_ulysses_host_the_ring(
        heads, data, devices, row, group_size, tokens, batch, dim, dtype_bytes):
    """The cost model's identities (issue 31, item 7): ``strategy_costs(..., ulysses_size=N)["hybrid"]``
    (R = 1) prices Ulysses and ``ulysses_size=1`` (U = 1) the ring, in bytes sent, peak bytes and time,
    exactly, over heads, kv heads (GQA that splits N ways or not: 12 heads, 3 kv heads on 4 repeat each
    4 times), device counts, every row of ``HARDWARE`` and two tiers of links in groups of 1 .. 8."""
    kv_heads = data.draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]), label="kv_heads")
    hw = HARDWARE[row] if row in HARDWARE else TWO_TIER
    if group_size is not None:  # the row's rates, two tiers: groups of group_size at B, 12.5 GB/s across
        hw = dataclasses.replace(hw, group_size=group_size, inter_bandwidth_bytes_per_s=12.5e9)
    shape = dict(seq=devices * tokens, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices, hardware=hw,
                 batch=batch, dtype_bytes=dtype_bytes)
    fields = ("bytes_sent", "peak_bytes", "time_s")
    ring = strategy_costs(ulysses_size=1, **shape)
    assert ({f: getattr(ring["hybrid"], f) for f in fields} == {f: getattr(ring["ring"], f) for f in fields})
    if heads % devices == 0:  # Ulysses runs: the hybrid with all devices in one Ulysses group is it
        ulysses = strategy_costs(ulysses_size=devices, **shape)
        assert ulysses["ulysses"].feasible
        assert ({f: getattr(ulysses["hybrid"], f) for f in fields} ==
                {f: getattr(ulysses["ulysses"], f) for f in fields})


def test_twelve_heads_three_kv_heads_hybrid_at_ring_size_one_is_ulysses():
    """The case of issue 31: 12 heads, 3 kv heads on 4 devices (each kv head sent 4 times, 3 per host),
    A100 NVLink and two nodes of 2: the hybrid 4 x 1 and Ulysses send, hold and take the same."""
    for hw in ("A100 NVLink", dataclasses.replace(TWO_TIER, group_size=2)):
        costs = strategy_costs(seq=4096, heads=12, kv_heads=3, dim=64, devices=4, hardware=hw, ulysses_size=4)
        hybrid, ulysses = costs["hybrid"], costs["ulysses"]
        assert (hybrid.bytes_sent, hybrid.peak_bytes, hybrid.time_s) == (
            ulysses.bytes_sent, ulysses.peak_bytes, ulysses.time_s)
        assert hybrid.bytes_sent == 3 * 1024 * 64 * (3 + 2 * 3 + 3) * 2  # q, k, v (3 copies), o to 3 others, bf16


def test_textbook_hybrid_wins_when_heads_are_few_and_links_two_tier():
    """8 devices in nodes of 4 (NVLink inside, 12.5 GB/s across), 4 heads: Ulysses cannot split 4 heads 8
    ways; the ring waits for the network at every step; the hybrid 4 x 2 keeps its all-to-alls inside the
    nodes and computes half the attention per ring step, which hides the transfer."""
    shape = dict(seq=2**16, heads=4, dim=128, devices=8)
    choice = choose_strategy(hardware=TWO_TIER, **shape)
    assert not choice.costs["ulysses"].feasible and "4 heads on 8 devices" in choice.costs["ulysses"].why_not
    assert (choice.strategy, choice.ulysses_size, choice.ring_size) == ("hybrid", 4, 2)
    hybrid, ring = choice.costs["hybrid"], choice.costs["ring"]
    assert hybrid.time_s < 0.5 * ring.time_s and hybrid.exposed_comm_s < 0.05 * hybrid.time_s
    assert choice.reason.startswith("hybrid 4 x 2: the fastest")
    one_tier = choose_strategy(hardware="A100 NVLink", **shape)  # NVLink everywhere: no hybrid by default
    assert "hybrid" not in one_tier.costs and one_tier.ulysses_size is None


@settings(max_examples=examples(20), deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16, 32]), st.sampled_from([1, 2, 3, 4, 8, 12, 32]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([2**12, 2**16]), st.sampled_from([None, 2, 4, 8]))
def test_ulysses_degree_never_exceeds_heads(devices, heads, group, seq, tier):
    kv_heads = heads // group if heads % group == 0 else heads
    splits = hybrid_splits(heads, devices)
    assert (1, devices) in splits and all(u <= heads and heads % u == 0 and u * r == devices for u, r in splits)
    hw = TWO_TIER if tier is None else dataclasses.replace(TWO_TIER, group_size=tier)
    costs = strategy_costs(seq=seq, heads=heads, kv_heads=kv_heads, dim=64, devices=devices, hardware=hw)
    hybrid = costs["hybrid"]
    assert (hybrid.ulysses_size, hybrid.ring_size) in splits
    assert hybrid.time_s <= costs["ring"].time_s * (1 + 1e-12)  # U = 1 is the ring, so never worse
    if heads % devices == 0:  # R = 1 is Ulysses
        assert hybrid.time_s <= costs["ulysses"].time_s * (1 + 1e-12)


@settings(max_examples=examples(20), deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([8, 32, 128]), st.sampled_from([1, 4]),
       st.sampled_from([1024, 8192, 65536]), st.sampled_from(["A100 NVLink", "A100 InfiniBand", "TPU v4"]))
def test_one_tier_choices_do_not_change(devices, heads, group, c, hw):
    """One tier: by default the three strategies as before. Priced too (hybrid=True), the hybrid changes
    nothing where the ring hides its transfers (the hybrid cannot beat ``time = compute``)."""
    shape = dict(seq=devices * c, heads=heads, kv_heads=heads // group, dim=128, devices=devices, hardware=hw)
    default, without = choose_strategy(**shape), choose_strategy(**shape, hybrid=False)
    assert default == without and set(default.costs) == {"ring", "allgather", "ulysses"}
    if default.costs["ring"].overlapped:
        assert choose_strategy(**shape, hybrid=True).strategy == default.strategy


@settings(max_examples=examples(20), deadline=None)
@given(st.sampled_from([2, 4, 8, 16]), st.sampled_from([4, 8, 32]), st.sampled_from([1, 4]),
       st.sampled_from([1024, 8192, 65536]), st.sampled_from([2, 4, 8]), st.sampled_from([12.5e9, 50e9]))
def test_two_tier_choice_is_near_fastest_and_simplest(devices, heads, group, c, group_size, inter):
    hw = dataclasses.replace(TWO_TIER, group_size=group_size, inter_bandwidth_bytes_per_s=inter)
    choice = choose_strategy(seq=devices * c, heads=heads, kv_heads=heads // group, dim=128, devices=devices,
                             hardware=hw, block=128)
    best = min(cost.time_s for cost in choice.costs.values() if cost.feasible)
    assert choice.costs[choice.strategy].time_s <= 1.05 * best
    simpler = SIMPLICITY[:SIMPLICITY.index(choice.strategy)]
    assert all(not choice.costs[s].feasible or choice.costs[s].time_s > 1.05 * best for s in simpler)
    split = (choice.ulysses_size, choice.ring_size)
    assert split == ((choice.costs["hybrid"].ulysses_size, choice.costs["hybrid"].ring_size)
                     if choice.strategy == "hybrid" else (None, None))


def test_hybrid_can_beat_ulysses_on_one_tier():
    """Why one tier leaves the hybrid out only by default: over InfiniBand alone, 8 heads on 8 devices, 64K
    tokens, the ring cannot hide its steps (c = 8K < 25K) and Ulysses sends (N-1)/N of q, k, v, o; the
    hybrid 4 x 2 sends 3/4 of them and hides most of its 2-step ring: 11.1 ms against Ulysses's 11.7."""
    shape = dict(seq=2**16, heads=8, dim=128, devices=8, hardware="A100 InfiniBand")
    assert choose_strategy(**shape).strategy == "ulysses"
    priced = choose_strategy(**shape, hybrid=True)
    assert (priced.strategy, priced.ulysses_size, priced.ring_size) == ("hybrid", 4, 2)
    assert priced.costs["hybrid"].time_s < priced.costs["ulysses"].time_s / 1.05


def test_two_tiers_price_the_links_each_collective_crosses():
    shape = dict(seq=2**15, heads=8, kv_heads=8, dim=128, hardware="A100 NVLink")
    inside = dataclasses.replace(TWO_TIER, name="one node of 8", group_size=8)
    one = strategy_costs(devices=8, **shape)
    for name, cost in strategy_costs(devices=8, **dict(shape, hardware=inside)).items():  # one node: one tier
        if name != "hybrid":
            assert (cost.peak_bytes, cost.bytes_sent) == (one[name].peak_bytes, one[name].bytes_sent), name
            assert cost.time_s == pytest.approx(one[name].time_s, rel=1e-12), name
    two = strategy_costs(devices=8, **dict(shape, hardware=TWO_TIER))
    ib = strategy_costs(devices=8, **dict(shape, hardware="A100 InfiniBand"))
    assert two["ring"].time_s == ib["ring"].time_s and two["allgather"].time_s == ib["allgather"].time_s
    assert one["ulysses"].comm_s < two["ulysses"].comm_s < ib["ulysses"].comm_s  # 4 of 7 peers across
    aligned = strategy_costs(devices=8, ulysses_size=4, **dict(shape, hardware=TWO_TIER))["hybrid"]
    straddling = strategy_costs(devices=8, ulysses_size=8, **dict(shape, hardware=TWO_TIER))["hybrid"]
    assert aligned.exposed_comm_s < 0.5 * straddling.exposed_comm_s  # U = 4: all-to-alls inside a node


def test_bad_splits_and_hardware_are_value_errors():
    q = np.zeros((1, 16, 4, 2))
    for kw, match in [(dict(ulysses_size=8, ring_size=1), r"ulysses_size \(8\) must not exceed heads \(4\)"),
                      (dict(ulysses_size=3, ring_size=1), r"heads \(4\) must be divisible by ulysses_size \(3\)"),
                      (dict(ulysses_size=2, ring_size=0), r"ring_size must be a positive int; got 0"),
                      (dict(ulysses_size=2, ring_size=3),
                       r"seq \(16\) must be divisible by ulysses_size \* ring_size = 6")]:
        with pytest.raises(ValueError, match=match):
            hybrid_attention(q, q, q, **kw)
    shape = dict(seq=64, heads=4, kv_heads=4, dim=8, devices=8, hardware="TPU v4")
    for kw, match in [(dict(ulysses_size=8), r"ulysses_size \(8\) must not exceed heads \(4\)"),
                      (dict(ulysses_size=3), r"heads \(4\) must be divisible by ulysses_size \(3\)"),
                      (dict(ulysses_size=2, ring_size=2),
                       r"ulysses_size \* ring_size = 2 \* 2 = 4 must equal devices \(8\)"),
                      (dict(ring_size=2), r"ring_size \(2\) needs ulysses_size"),
                      (dict(ulysses_size=2, hybrid=False),
                       r"ulysses_size \(2\) is the hybrid's split, but hybrid=False")]:
        for fn in (strategy_costs, choose_strategy):
            with pytest.raises(ValueError, match=match):
                fn(**shape, **kw)
    with pytest.raises(ValueError, match=r"ulysses_size \(4\) must divide devices \(6\)"):
        strategy_costs(**dict(shape, devices=6, seq=60), ulysses_size=4)
    for hw, match in [(dataclasses.replace(TWO_TIER, inter_bandwidth_bytes_per_s=None), "go together"),
                      (dataclasses.replace(TWO_TIER, group_size=0), r"hardware.group_size .* positive int; got 0"),
                      (dataclasses.replace(TWO_TIER, inter_bandwidth_bytes_per_s=-1.0),
                       r"hardware.inter_bandwidth_bytes_per_s .* must be a positive finite number")]:
        with pytest.raises(ValueError, match=match):
            choose_strategy(**dict(shape, hardware=hw))
