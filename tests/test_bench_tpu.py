"""The TPU scripts (`benchmarks/bench_tpu.py`, `tune_tpu.py`, `tpu_checks.py`) exercised on CPU with --dry-run.

The dry runs go through the same code as on a chip (ours through ``ring_attention`` on a ring of one,
splash attention, the per-kernel tile sweep, the numerics checks) with every Pallas kernel interpreted;
they check the scripts' output contract (JSON lines on stdout, a table on stderr), not speed.
"""
import json
import sys

import pytest

from benchmarks import bench_tpu, tpu_checks, tune_tpu
from helpers import needs_fused_interpreter


def _json_lines(out):
    lines = out.splitlines()
    objs = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(objs) == len(lines), out  # stdout holds nothing but JSON lines
    return objs


def test_arguments():
    args = bench_tpu.parse_args(["--heads", "8,32/8", "--block-q", "512"])
    assert args.heads == [(8, 8), (32, 8)] and (args.block_q, args.block_kv) == (512, 512)
    for bad in (["--heads", "6/4"], ["--block-kv", "128"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_tpu.parse_args(bad)
    with pytest.raises(SystemExit):
        tune_tpu.parse_args(["--kernels", "fwd,nope"])


def test_without_a_tpu_and_no_dry_run_says_so(capsys):
    assert bench_tpu.main([]) == 2 and tune_tpu.main([]) == 2 and tpu_checks.main([]) == 2
    assert "no TPU" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_dry_run(capsys):
    """One row: ours (the per-hop kernel, interpreted), splash (interpreted), jax.nn; TFLOP/s, temp MiB,
    errors against splash within bf16 rounding."""
    assert bench_tpu.main(["--dry-run", "--heads", "4/2", "--causal", "true", "--no-fused", "--interleave"]) == 0
    out, err = capsys.readouterr()
    rows = _json_lines(out)
    (row,), summary = rows[:-1], rows[-1]
    assert summary["summary"] and summary["measured"] == 1
    assert {"ours", "native", "splash128", "xla"} <= set(row["tflops"]) and row["splash_best"] == "splash128"
    assert row["temp_mib"]["ours"] > 0 and "splash128_bshd" in row["temp_mib"]
    assert max(row["max_err"]["ours"]) < 0.05, row["max_err"]  # bf16 outputs against splash's
    assert max(row["max_err"]["native"]) < 0.05 and "ratio_native" in row, row["max_err"]  # [b, s, h * d] in and out
    assert "ours/spl" in err and "nat/spl" in err and "splash128" in err and summary["min_ratio_native"] > 0
    # --interleave: every kind's fwd+bwd timed in one loop, ratios against the fastest splash of that loop
    assert set(row["ms_interleaved"]) == {"ours", "native", "splash128", "splash128_bshd", "xla"}, \
        row["ms_interleaved"]
    assert set(row["ratio_interleaved"]) == {"ours", "native", "ours_bshd"} and "# interleaved 256 4/2" in err


@pytest.mark.slow
def test_tune_and_checks_dry_runs(capsys):
    kernels = {"fwd", "bwd_fused", "dq", "dkv", "fused_fwd", "fused_fwd_streaming", "fused_bwd"}
    assert tune_tpu.main(["--dry-run", "--causal", "true", "--tiles", "128", "--kernels", ",".join(sorted(kernels))]) == 0
    objs = _json_lines(capsys.readouterr().out)
    (summary,) = [o for o in objs if o.get("summary")]
    assert set(summary["best"]) == kernels and summary["best_pair"] == [128, 128]
    assert {o["kernel"] for o in objs if "kernel" in o} == kernels and all("ms" in o for o in objs if "kernel" in o)
    assert summary["fused_default"] == [None, None]  # interpreted: the kernels' own default_block
    assert tpu_checks.main(["--dry-run"]) == 0
    checks = _json_lines(capsys.readouterr().out)
    assert sum(c["check"] == "numerics" for c in checks) == 8 and all(c.get("ok", True) for c in checks)
    assert [c["check"] for c in checks][-1] == "xla hop"


def test_fused_backward_variants_dry_run(capsys):
    """``tpu_checks --checks variants`` on CPU: every dS K form of the fused backward (``pallas_tpu.DQ_FORM``)
    gives the shipped outputs, partial tiles whole or split 4 x 4 nearly so, base-2 logits (``EXP2``) too,
    and the module's settings are restored after the check."""
    from ringattn_fast.kernels import pallas_tpu
    before = (pallas_tpu.DQ_FORM, pallas_tpu.finite_keys, pallas_tpu.SPLIT, pallas_tpu.EXP2,
              pallas_tpu.FULL_TILE_WHERE, pallas_tpu.FWD_ROW_CHUNK, pallas_tpu.BWD_KEY_CHUNK)
    # all but the chunk forms one at a time (whole_tiles_unchunked has both; the fused ring's dry run times one)
    names = [n for n in tpu_checks.VARIANTS if n not in ("shipped", "fwd_unchunked", "bwd_unchunked")]
    assert tpu_checks.main(["--dry-run", "--checks", "variants", "--variant-causal", "true",  # sub-tiles need a mask
                            "--variants", ",".join(names)]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [r["causal"] for r in rows] == [True]
    for r in rows:
        assert set(r["ms"]) == {"shipped", *names}
        # a transpose is exact; the "tn" matmul may add in another order on CPU (5.8e-11 seen in CI)
        assert r["max_diff"]["dq_cast"] == 0 and r["max_diff"]["dq_tn"] < 1e-6, r
        # sub-tiles change the order of the online softmax: bfloat16 outputs within an ulp or so
        assert r["max_diff"]["whole_tiles"] <= 1.6e-2 and r["max_diff"]["split4"] <= 1.6e-2, r
        # base-2 logits round differently (bf16 outputs within an ulp); the full tiles' where changes no value here
        assert r["max_diff"]["exp2"] <= 1.6e-2 and r["max_diff"]["full_tile_where"] == 0, r
        # chunks add in another order (none here at the dry run's small tiles: the same outputs)
        assert all(r["max_diff"][n] <= 1.6e-2 for n in ("whole_tiles_unchunked", "bwd_keys128", "fwd_rows1024")), r
    assert (pallas_tpu.DQ_FORM, pallas_tpu.finite_keys, pallas_tpu.SPLIT, pallas_tpu.EXP2,
            pallas_tpu.FULL_TILE_WHERE, pallas_tpu.FWD_ROW_CHUNK, pallas_tpu.BWD_KEY_CHUNK) == before


@pytest.mark.slow
@needs_fused_interpreter
def test_variants_on_the_fused_ring_dry_run(capsys):
    """``tpu_checks --checks variants --variant-path fused``: the fused ring's kernels on a ring of one, shipped and
    with its backward's key chunks off (``pallas_tpu.BWD_KEY_CHUNK``, which it reads too), interpreted."""
    from ringattn_fast.kernels import pallas_tpu
    before = pallas_tpu.FWD_ROW_CHUNK, pallas_tpu.BWD_KEY_CHUNK
    assert tpu_checks.main(["--dry-run", "--checks", "variants", "--variant-path", "fused", "--variant-causal", "true",
                            "--variants", "whole_tiles_unchunked,bwd_unchunked"]) == 0
    (row,) = _json_lines(capsys.readouterr().out)
    assert row["path"] == "fused" and set(row["ms"]) == {"shipped", "whole_tiles_unchunked", "bwd_unchunked"}, row
    assert max(row["max_diff"].values()) <= 1.6e-2, row
    assert (pallas_tpu.FWD_ROW_CHUNK, pallas_tpu.BWD_KEY_CHUNK) == before


def test_checks_reject_an_unknown_variant(capsys):
    """``tpu_checks --variants`` with a name not in :data:`tpu_checks.VARIANTS` (one renamed since a run, say)
    is an argparse error naming the flag and the choices, not a run of the shipped form alone."""
    with pytest.raises(SystemExit) as exc:
        tpu_checks.main(["--dry-run", "--checks", "variants", "--variants", "exp2,no_full_tile_where"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--variants: unknown no_full_tile_where" in err and "full_tile_where" in err.split("choose from")[1]


def test_schedule_tool_rejects_bad_arguments_and_a_missing_libtpu(monkeypatch, capsys):
    """``benchmarks/schedule_tpu.py`` (its compiles are in tests/test_compile.py, libtpu needed): bad ``--heads``,
    ``--kinds`` and ``--set`` are argparse errors naming the flag; without libtpu importable it returns 2 and
    says what to install."""
    from benchmarks import schedule_tpu
    for argv, flag in ((["--heads", "3/2"], "--heads"), (["--kinds", "ours,nope"], "--kinds"),
                       (["--set", "EXP2=lambda"], "--set"), (["--seq", "0"], "--seq")):
        with pytest.raises(SystemExit):
            schedule_tpu.parse_args(argv)
        assert flag in capsys.readouterr().err, argv
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)  # main sets it; monkeypatch restores it
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu fails
    assert schedule_tpu.main(["--seq", "256"]) == 2
    assert "libtpu" in capsys.readouterr().err
