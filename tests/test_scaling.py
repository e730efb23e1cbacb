"""benchmarks/scaling.py, the one-chip-to-a-thousand model: it reads the measured v5e rows as they are, it agrees
with ``ringattn_ref.cost`` on bytes, FLOPs, hide thresholds and pass times, and its command line runs."""
import json

import numpy as np
import pytest

from benchmarks import scaling
from benchmarks.scaling import TARGETS, Measured, hide_threshold, hop_bytes, hop_flops, measured
from ringattn_ref import cost

V5E = TARGETS["v5e"]


def constant(causal, fwd, bwd):
    """A kernel that runs at one rate at every shard length (the paper's assumption)."""
    return Measured(causal, (8192,), (fwd,), (bwd,), ("made up",))


def test_measured_rates_are_the_bench_rows_own():
    """The FLOP count turns the row's ms into the TFLOP/s the bench wrote beside them; provenance names the row."""
    rates = measured((8, 8), "fused")
    rows = [json.loads(line) for line in (scaling.RESULTS / scaling.RUNS[(8, 8)]).read_text().splitlines()]
    for causal in (False, True):
        m = rates[causal]
        assert m.shards == (8192, 16384, 32768)
        for shard, fwd_rate in zip(m.shards, m.fwd_flops_per_s):
            (r,) = [r for r in rows if r.get("seq") == shard and r.get("causal") == causal]
            assert fwd_rate / 1e12 == pytest.approx(r["tflops"]["fused"][0], rel=1e-9)
    m = rates[False]
    assert m.provenance(8192) == "measured (tpu_v5e_2026-12-07_bench18.jsonl:1)"
    assert m.provenance(4096).startswith("extrapolated at 8K's rate") and m.rate(1024) == m.rate(8192)
    assert m.provenance(65536).startswith("extrapolated at 32K's rate") and m.rate(65536) == m.rate(32768)
    assert m.provenance(12288) == "interpolated" and m.rate(8192) < m.rate(12288) < m.rate(16384)
    assert m.rate(8192, backward=True) > 1.4 * m.rate(8192)  # the backward kernel runs faster than the forward
    assert measured((32, 8), "per_hop")[True].shards == (8192, 16384, 32768)


@pytest.mark.parametrize("shard, heads, kv_heads, dim, dtype, e", [
    (4096, 8, 8, 128, "bfloat16", 2), (16384, 32, 8, 128, "bfloat16", 2), (1024, 4, 2, 64, "float32", 4)])
def test_bytes_and_flops_agree_with_the_ref_cost_model(shard, heads, kv_heads, dim, dtype, e):
    kv_b, grad_b = hop_bytes(shard, kv_heads, dtype, dim=dim)
    assert kv_b == cost.step_bytes(shard, dim, kv_heads=kv_heads, dtype_bytes=e)
    assert kv_b + grad_b == cost.backward_step_bytes(shard, dim, kv_heads=kv_heads, dtype_bytes=e)
    assert kv_b + hop_bytes(shard, kv_heads, dtype, "bfloat16", dim)[1] == cost.backward_step_bytes(
        shard, dim, kv_heads=kv_heads, dtype_bytes=e, grad_bytes=2)
    assert hop_flops(shard, heads, False, dim=dim) == cost.step_flops(shard, dim, heads=heads)
    assert hop_flops(shard, heads, False, True, dim) == cost.backward_step_flops(shard, dim, heads=heads)
    assert hop_flops(shard, heads, True, dim=dim) == 0.5 * cost.step_flops(shard, dim, heads=heads)


@pytest.mark.parametrize("heads, dim, dtype, e", [((8, 8), 128, "bfloat16", 2), ((32, 8), 128, "bfloat16", 2),
                                                  ((4, 2), 64, "float32", 4)])
@pytest.mark.parametrize("bandwidth", [50e9, 3.125e9])
def test_hide_thresholds_agree_with_the_ref_cost_model(heads, dim, dtype, e, bandwidth):
    """At constant rates the bisection finds the ref's closed forms: c >= (e/2)(hk/h)/fill F/B forward and
    (e+g)/5 (hk/h)/fill F/B backward; zigzag's steady hop is half a full one (fill 1/2 at the full rate),
    striped's a causal hop (fill 1/2 at the causal rate)."""
    h, hk = heads
    f, fb, fc, fcb = 100e12, 160e12, 60e12, 130e12
    rates = {False: constant(False, f, fb), True: constant(True, fc, fcb)}
    ref = dict(dtype_bytes=e, heads=h, kv_heads=hk)
    kw = dict(bandwidth=bandwidth, heads=heads, dtype=dtype, dim=dim)
    for layout, (ff, fbb, fill) in {"none": (f, fb, 1.0), "zigzag": (f, fb, 0.5), "striped": (fc, fcb, 0.5)}.items():
        fwd = hide_threshold(V5E, rates, layout, backward=False, **kw)
        bwd = hide_threshold(V5E, rates, layout, backward=True, **kw)
        assert fwd == pytest.approx(cost.min_block_size(ff, bandwidth, fill=fill, **ref), rel=1e-9)
        assert bwd == pytest.approx(cost.backward_min_block_size(fbb, bandwidth, fill=fill, **ref), rel=1e-9)
    # another chip: the measured rate times the ratio of peak FLOP/s
    h100 = hide_threshold(TARGETS["H100"], rates, "none", backward=False, **kw)
    assert h100 == pytest.approx(cost.min_block_size(f * 989 / 197, bandwidth, **ref), rel=1e-9)


def test_measured_threshold_is_the_ref_formula_at_the_rate_it_lands_on():
    """Past 8K the rate changes with the shard (interpolated, then held at 32K's): the threshold the bisection
    finds is the closed form at the rate of the shard it finds."""
    rates = measured((8, 8))
    for bandwidth in (6.25e9, 3.125e9):
        for backward, formula in ((False, cost.min_block_size), (True, cost.backward_min_block_size)):
            c = hide_threshold(V5E, rates, "none", backward=backward, bandwidth=bandwidth)
            assert c > 8192
            assert c == pytest.approx(formula(rates[False].rate(c, backward), bandwidth), rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_pass_times_agree_with_the_ref_schedule(n):
    rng = np.random.default_rng(n)
    compute = rng.uniform(0.5, 2.0, n)
    for kv, grad in ((0.7, 0.0), (0.7, 1.4), (3.0, 0.1)):
        for hidden in (True, False):
            assert scaling.pass_seconds(compute, kv, grad, hidden) == pytest.approx(
                cost.ring_pass_seconds(list(compute), kv, grad, hidden=hidden), rel=1e-12)


def test_rows_follow_the_model():
    rates = measured((8, 8))
    r = scaling.row(V5E, rates, "none", 65536, 8)
    assert r["network"] == "fast" and r["seq"] == 8 * 65536 and r["rate"].startswith("extrapolated")
    assert 0.9 < r["eff_exposed"] < r["eff_before"] < r["eff_hidden"] <= 1.0
    assert r["compute_s"] == pytest.approx(8 * (r["hop_fwd_s"] + r["hop_bwd_s"]))
    assert r["grad_send_s"] == pytest.approx(2 * r["kv_send_s"])  # float32 dK/dV: twice bf16 K/V
    past = scaling.row(V5E, rates, "none", 65536, 512)  # past the 256-chip pod: the data-center network
    assert past["network"] == "DCN" and past["eff_hidden"] < r["eff_hidden"]
    zig = scaling.row(TARGETS["H100"], rates, "zigzag", 16384, 8)
    assert zig["rate"].startswith("scaled: v5e's x 5.02") and zig["hop_fwd_s"] == pytest.approx(
        0.5 * scaling.row(TARGETS["H100"], rates, "none", 16384, 8)["hop_fwd_s"])


def test_command_line_tables_and_plot(tmp_path, capsys):
    png, out = tmp_path / "s.png", tmp_path / "rows.jsonl"
    scaling.main(["--targets", "v5e,H100", "--shards", "4096,65536", "--ns", "8,64", "--plot", str(png),
                  "--out", str(out)])
    text = capsys.readouterr().out
    assert "paper F/B" in text and "non-causal" in text and "causal, zigzag" in text
    assert "| H100 | 64K | " in text and "*" in text  # 64 GPUs leave the NVLink domain
    assert png.stat().st_size > 10_000 and len(out.read_text().splitlines()) == 2 * 2 * 2 * 2
    scaling.main(["--targets", "v6e", "--shards", "8192", "--ns", "4", "--layouts", "striped", "--long"])
    assert "measured (tpu_v5e_2026-12-07_bench18.jsonl:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        scaling.main(["--targets", "v7"])


def test_targets_cite_their_sources():
    for t in TARGETS.values():
        assert t.source and t.how and t.hop <= t.chip and t.link <= t.hop and t.outer < t.hop
        assert "http" not in t.source
