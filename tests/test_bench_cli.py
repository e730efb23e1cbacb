"""The benchmarks' command line (`benchmarks/bench.py`) and what every mode prints: ``--help`` lists the
modes and their options, ``--mode X`` and ``--mode=X`` both work, each table comes after a
configuration line and holds ratios measured in the same run, lengths are labelled exactly.
Tiny shapes and ``--repeats 1``; none of it needs the authors' package or a GPU."""
import os
import re
import subprocess
import sys

import jax
import pytest

from benchmarks import bench, decode, masks, report, strategies, timing, train

TINY = ["--repeats", "1", "--dim", "8"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _help(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv + ["--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_mode_and_option(capsys):
    text = _help(capsys, [])
    assert "--mode {" + ",".join(bench.MODES) + "}" in text and "--gpu-kernel" in text
    assert {"train", "decode", "strategies", "masks"} <= set(bench.MODES)
    for mode in bench.MODES:
        assert re.search(rf"^  {mode} +\S", text, re.M), mode  # the epilog's line for the mode
    for flag in ("--devices", "--batch", "--seq", "--heads", "--dim", "--dtype", "--causal", "--block",
                 "--ours-block-q", "--ours-block-kv", "--repeats", "--impls", "--out", "--plot"):
        assert flag in text, flag
    assert "(default 8192)" in text  # defaults are shown


def test_help_runs_as_docs_write_it():
    """``python -m benchmarks.bench --help`` (docs/benchmarks.md) from the repository root."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "--mode {" + ",".join(bench.MODES) + "}" in proc.stdout and "--gpu-kernel" in proc.stdout


@pytest.mark.parametrize("argv, own", [(["--mode", "decode"], "--lengths"), (["--mode=decode"], "--kv-heads"),
                                       (["--mode=strategies"], "--strategies"), (["--mode", "train"], "--impls"),
                                       (["--mode", "masks"], "--doc-lengths"),
                                       (["--gpu-kernel"], "--dry-run")])
def test_each_mode_has_its_own_help(capsys, argv, own):
    text = _help(capsys, argv)
    assert own in text and "issue" not in text.lower()


def test_mode_split_keeps_the_rest_in_order():
    assert bench.split_mode(["--seq", "64", "--mode=decode", "--lengths", "8,16"]) == (
        "decode", False, ["--seq", "64", "--lengths", "8,16"])
    assert bench.split_mode(["--mode", "strategies", "--seqs", "64"]) == ("strategies", False, ["--seqs", "64"])
    assert bench.split_mode(["--gpu-kernel", "--dry-run"]) == (None, True, ["--dry-run"])
    assert bench.split_mode([]) == (None, False, [])


@pytest.mark.parametrize("argv, message", [(["--mode", "fast"], "invalid choice: 'fast'"),
                                           (["--mode=decode", "--gpu-kernel"], "takes no --mode"),
                                           (["--impls", "ours,fast", "--seq", "64"], "unknown impl 'fast'")])
def test_bad_command_lines_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert message in str(stop.value.code) + capsys.readouterr().err


def _config(err):
    """The items of the configuration line in stderr, as a dict of strings."""
    (line,) = [line for line in err.splitlines() if line.startswith("config: ")]
    return dict(item.split("=", 1) for item in line[len("config: "):].split("; "))


def _table(err, first):
    """The markdown lines of the table whose header starts with ``first``."""
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return [line for line in lines[start:] if line.startswith("|")]


def test_train_mode_header_and_ratios(capsys):
    rows = bench.main(["--seq", "256", "--impls", "ours,dense", "--causal", "true", "--heads", "2"] + TINY)
    err = capsys.readouterr().err
    cfg = _config(err)
    assert {k: cfg[k] for k in ("mode", "devices", "batch", "seq", "heads", "dim", "dtype", "causal", "blocks",
                                "repeats", "impls")} == dict(mode="train", devices="8", batch="1", seq="256", heads="2",
                                                             dim="8", dtype="float32", causal="true",
                                                             blocks="ours default", repeats="1", impls="ours,dense")
    assert cfg["jax"] == jax.__version__ and cfg["backend"] == "cpu"
    head, _, ours, dense = _table(err, "| impl |")
    assert "| fwd s | fwd vs ours | fwd+bwd s | fwd+bwd vs ours |" in head and "temp fwd+bwd vs ours" in head
    by = {r["impl"]: r for r in rows}
    assert ours.split(" | ")[3] == "1.00x"
    assert dense.split(" | ")[3] == report.ratio(by["dense"]["fwd_s"], by["ours"]["fwd_s"])
    assert dense.split(" | ")[9] == report.ratio(by["dense"]["temp_fwd_bwd_bytes"], by["ours"]["temp_fwd_bwd_bytes"])


def test_decode_mode_with_equals_labels_256_tokens(capsys):
    rows = bench.main(["--mode=decode", "--lengths", "256", "--heads", "4", "--kv-heads", "2"] + TINY)
    err = capsys.readouterr().err
    cfg = _config(err)
    assert (cfg["mode"], cfg["seq"], cfg["kv_heads"], cfg["causal"], cfg["repeats"]) == ("decode", "256", "2",
                                                                                       "true", "1")
    head, _, *lines = _table(err, "| S |")
    assert "| ms/token | vs fastest |" in head and len(lines) == len(rows) == 2
    assert all(line.startswith("| 256 | ") for line in lines) and "0K" not in err
    assert "1.00x" in {line.split(" | ")[4] for line in lines}  # the fastest, relative to itself


def test_strategies_mode_header_and_ratios(capsys):
    bench.main(["--mode", "strategies", "--seqs", "256", "--heads", "8", "--kv-heads", "2",
                "--strategies", "ring,allgather"] + TINY)
    err = capsys.readouterr().err
    cfg = _config(err)
    assert (cfg["mode"], cfg["seq"], cfg["heads"], cfg["kv_heads"], cfg["causal"]) == ("strategies", "256", "8", "2",
                                                                                      "false")
    head, _, ring, allgather = _table(err, "| S |")
    assert "| fwd+bwd vs ring |" in head and "| sent fwd+bwd vs ring |" in head
    assert ring.startswith("| 256 | ring | ") and ring.split(" | ")[3] == "1.00x"
    assert allgather.split(" | ")[9] != "1.00x"  # the all-gather sends less than the ring in fwd+bwd


def test_masks_mode_block_mask_and_verdicts(capsys):
    """The documents group only (3 programs): ratios over the bias row, the block mask's counts, the verdicts."""
    rows = bench.main(["--mode", "masks", "--seq", "256", "--heads", "2", "--block", "16", "--groups", "documents"]
                      + TINY)
    err = capsys.readouterr().err
    assert (_config(err)["mode"], _config(err)["docs"]) == ("masks", "48/16/32/8/40/64/24/24")
    head, _, bias, mask_fn, segments = _table(err, "| group |")
    assert "| ratio |" in head and bias.split(" | ")[4] == "1.00x"
    by = {r["name"]: r for r in rows}
    assert mask_fn.split(" | ")[4] == f"{by['mask_fn=documents']['ratio']:.2f}x"
    assert by["mask_fn=documents"]["skipped_tiles"] > 0.6 and by["mask_fn=documents"]["max_diff_vs_base"] < 1e-5
    assert by["segment_ids+causal"]["skipped_tiles"] is None and "of 2 expectations held" in err
    assert re.search(r"^expectation (held|FAILED): documents: the block mask skips >= 60% of the tiles: 87\.9%", err,
                     re.M)


def test_length_labels():
    assert [report.length_label(n) for n in (8, 256, 1000, 1024, 1536, 8192, 131072)] == [
        "8", "256", "1000", "1K", "1536", "8K", "128K"]
    assert report.lengths_label([256, 2048]) == "256,2K"
    fig, ax = report.pyplot().subplots()
    report.log2_length_axis(ax, [1024, 256, 256])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "1K"] and not ax.get_xticks(minor=True).size


def test_one_timing_loop_serves_every_benchmark():
    """Warm-up rounds untimed, then round-robin rounds; every benchmark module uses this one copy."""
    calls = []
    medians = timing.time_interleaved([lambda: calls.append("a"), lambda: calls.append("b")], repeats=2, warmup=1)
    assert calls == ["a", "b"] * 3 and len(medians) == 2 and min(medians) >= 0
    assert (train.time_interleaved is strategies.time_interleaved is decode.time_interleaved is masks.time_interleaved
            is timing.time_interleaved)
    assert train.Progress is strategies.Progress is decode.Progress is timing.Progress
