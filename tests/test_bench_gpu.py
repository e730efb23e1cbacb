"""The GPU kernel check script (`benchmarks/bench_gpu.py`), exercised on CPU with --dry-run.

The dry run goes through the same code as on a GPU (kernel 1 vs the XLA hop, timing, table, JSON),
with the Triton kernel interpreted; only the cuDNN call cannot run here, and its failure path is
tested by asking for it on CPU. ``benchmarks`` is imported from the checkout (pytest's
``pythonpath``); neither it nor these tests need the authors' package or a GPU.
"""
import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import bench_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(capsys, argv):
    """main(argv) -> (status, JSON rows, summary, table lines)."""
    status = bench_gpu.main(argv)
    out, err = capsys.readouterr()
    objs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(objs) == len(out.splitlines()), out  # stdout holds nothing but JSON lines
    rows = [o for o in objs if "summary" not in o and "check" not in o]
    summary = [o for o in objs if "summary" in o]
    assert len(summary) == 1
    return status, rows, summary[0], err.splitlines()


@pytest.mark.slow
def test_dry_run_float32_checks_of_the_hop_and_the_ring(capsys):
    """The float32 checks (benchmarks/gpu_checks.py) run first: the hop (causal and not) and the ring over
    2 devices (causal + segment ids + GQA), pallas_gpu vs XLA, forward and backward, all within tolerance."""
    assert bench_gpu.main(["--dry-run", "--causal", "true"]) == 0
    out, err = capsys.readouterr()
    checks = [json.loads(line) for line in out.splitlines() if '"check"' in line]
    assert [(c["check"], c.get("causal")) for c in checks] == [("float32 hop", False), ("float32 hop", True),
                                                               ("float32 ring", True)]
    for c in checks:
        assert c["ok"] and set(c["err"]) == {"o", "dq", "dk", "dv"}, c
        assert all(0 <= c["err"][n] <= c["tol"] * max(1.0, c["ref_max"][n]) for n in c["err"])
        assert all(c["ref_max"][n] > 0.1 for n in c["err"])  # not trivially zero
    assert checks[2]["devices"] == 2 and checks[2]["kv_heads"] == 1 and checks[2]["segments"]
    assert sum(line.startswith("float32 ") and line.endswith(" ok") for line in err.splitlines()) == 3
    assert json.loads(out.splitlines()[-1])["f32_checks_ok"] is True


@pytest.mark.slow
def test_dry_run_rows_and_errors(capsys):
    status, rows, summary, table = _run(capsys, ["--dry-run"])
    assert status == 0
    assert [(r["seq"], r["batch"], r["heads"], r["dim"], r["causal"]) for r in rows] == [
        (128, 1, 2, 32, False), (128, 1, 2, 32, True)]
    for r in rows:
        assert r["dtype"] == "float32" and r["ref_impl"] == "xla" and r["ref_error"] is None and r["ok"]
        assert (r["block_q"], r["block_kv"]) == (64, 32)
        for name in ("o", "dq", "dk", "dv"):
            assert 0 <= r["err"][name] <= 2e-5, (name, r["err"])
            assert 0 <= r["ref_err"][name] <= 2e-5, (name, r["ref_err"])
            assert r["ref_max"][name] > 0.1  # the reference is not trivially zero
        assert set(r["tflops"]) == {"ours_fwd", "ours_fwd_bwd", "ref_fwd", "ref_fwd_bwd"}
        assert all(t > 0 for t in r["tflops"].values()) and r["ratio_fwd"] > 0
        assert r["flops_fwd"] == 4 * 128 * 128 * 2 * 32 // (2 if r["causal"] else 1)
        assert r["ratio_fwd"] == pytest.approx(r["ms"]["ref_fwd"] / r["ms"]["ours_fwd"])
    assert summary["rows"] == summary["checked"] == 2 and summary["all_ok"]
    assert summary["min_ratio_fwd"] == min(r["ratio_fwd"] for r in rows)
    header = table.index(bench_gpu.HEADER)
    lines = table[header + 1:header + 3]
    assert [line.split()[:4] for line in lines] == [["128", "1", "2", "False"], ["128", "1", "2", "True"]]
    assert all(" yes " in line for line in lines)
    assert "2/2 rows checked, all passed" in table[-1]
    assert f"jax {jax.__version__}, backend cpu" in table[0]  # the configuration line names what ran


def test_failed_check_and_missing_cudnn_are_reported(capsys, monkeypatch):
    """A zero tolerance fails the row (status 1); cuDNN on CPU raises and the row says so."""
    monkeypatch.setitem(bench_gpu.TOL, "float32", 0.0)
    status, rows, summary, table = _run(capsys, ["--dry-run", "--causal", "true", "--ref-impl", "cudnn"])
    assert status == 1 and not summary["all_ok"]
    (row,) = rows
    assert row["causal"] and not row["ok"] and max(row["err"].values()) > 0
    assert row["ref_error"] and "ratio_fwd" not in row and "ref_fwd" not in row["tflops"]
    line = table[table.index(bench_gpu.HEADER) + 1]
    assert " NO " in line and "cudnn unavailable" in line


def test_budget_skips_rows(capsys):
    status, rows, summary, table = _run(capsys, ["--dry-run", "--budget-s", "0", "--seqs", "64,128"])
    assert status == 0 and summary["checked"] == 0 and summary["rows"] == 4
    assert all("skipped" in r and "err" not in r for r in rows)
    assert sum("skipped: time budget" in line for line in table) == 4


def test_defaults_and_flops():
    full, quick = bench_gpu.parse_args([]), bench_gpu.parse_args(["--quick"])
    assert (full.seqs, full.heads, full.dim, full.dtype) == ([4096, 8192, 16384, 32768], [8, 32], 128, "bfloat16")
    assert (full.block_q, full.block_kv, full.ref_impl, full.tokens) == (None, None, "cudnn", 32768)  # kernel defaults
    assert (quick.seqs, quick.heads) == ([4096, 16384], [32])
    assert bench_gpu.parse_args(["--block-q", "256", "--block-kv", "128"]).block_q == 256
    assert bench_gpu.attention_flops(2, 3, 8, 4, causal=False) == (4 * 2 * 3 * 64 * 4, 3.5 * 4 * 2 * 3 * 64 * 4)
    assert bench_gpu.attention_flops(2, 3, 8, 4, causal=True)[0] == 2 * 2 * 3 * 64 * 4
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--seqs", "4096,x"])


def test_no_gpu_exits_2(capsys):
    assert bench_gpu.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "no GPU" in err and "--dry-run" in err


def test_no_gpu_cli_exit_status():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.strip().startswith("bench_gpu: no GPU")


def test_reference_backward_failure_keeps_forward_ratio(capsys, monkeypatch):
    """If only the reference's fwd+bwd raises, the forward ratio (the issue's target) is still reported."""
    make = bench_gpu.make_functions

    def without_ref_backward(*args):
        def fail(*xs):
            raise NotImplementedError("no backward for this shape")
        return make(*args)[:4] + (fail,)

    monkeypatch.setattr(bench_gpu, "make_functions", without_ref_backward)
    status, rows, summary, table = _run(capsys, ["--dry-run", "--causal", "false"])
    (row,) = rows
    assert status == 0 and row["ok"] and row["ratio_fwd"] > 0 and "ratio_fwd_bwd" not in row
    assert row["ref_error"] == "fwd+bwd: NotImplementedError: no backward for this shape"
    assert set(row["ref_err"]) == {"o"} and row["ref_err"]["o"] <= 2e-5
    assert summary["min_ratio_fwd"] == row["ratio_fwd"]
    line = table[table.index(bench_gpu.HEADER) + 1]
    assert "n/a" in line and "fwd+bwd: NotImplementedError" in line


def test_bench_gpu_kernel_flag_routes_to_the_gpu_check(capsys):
    """``python -m benchmarks.bench --gpu-kernel`` is the command line's entry point for this check."""
    from benchmarks import bench

    status = bench.main(["--gpu-kernel", "--dry-run", "--causal", "true", "--no-f32-check"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert status == 0 and [r["causal"] for r in rows if not r.get("summary") and "check" not in r] == [True]
