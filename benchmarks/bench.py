"""The benchmarks' command line: one entry point, a mode per benchmark.

    python -m benchmarks.bench                          # train mode: ring vs dense vs the authors' package
    python -m benchmarks.bench --seq 2048 --causal true --out runs.jsonl --plot bench.png
    python -m benchmarks.bench --mode decode            # decoding against a sharded KV cache (decode.py)
    python -m benchmarks.bench --mode=strategies        # ring vs all-gather vs Ulysses (strategies.py)
    python -m benchmarks.bench --mode masks             # mask / score functions vs built-ins and a bias (masks.py)
    python -m benchmarks.bench --mode balance           # packed documents: zigzag vs the balance solver (balance.py)
    python -m benchmarks.bench --gpu-kernel [--quick]   # on a GPU: the Pallas Triton kernel vs cuDNN
    python -m benchmarks.bench --mode decode --help     # a mode's own options

(from the repository root: ``benchmarks`` is a folder of the checkout, not an installed package).

``--mode`` and ``--gpu-kernel`` are read first (``--mode X`` and ``--mode=X`` alike); everything else
goes to that mode's parser, so each mode keeps its own options and ``--help``. No flags: train mode
with its defaults (:mod:`benchmarks.train`).
"""
from __future__ import annotations

import argparse
import sys

from . import balance, bench_gpu, decode, masks, report, strategies, train

PROG = "python -m benchmarks.bench"
MODES = {"train": (train, "forward and forward+backward of ours, dense and the authors' package (the default)"),
         "decode": (decode, "one token per step against a sequence-sharded KV cache vs a dense one"),
         "strategies": (strategies, "ring vs all-gather vs Ulysses: time, memory, bytes sent"),
         "masks": (masks, "mask_fn and its block mask vs the built-ins and a dense bias; soft-cap, sinks"),
         "balance": (balance, "packed documents: imbalance and time of zigzag, per-document zigzag, the solver")}


def add_mode_arguments(p):
    """``--mode`` and ``--gpu-kernel``: which benchmark runs (the rest of the line is its options)."""
    g = p.add_argument_group("which benchmark")
    g.add_argument("--mode", choices=list(MODES), default=None,
                   help="the benchmark to run (omitted: train); --mode MODE --help lists its options")
    g.add_argument("--gpu-kernel", action="store_true",
                   help="instead: the GPU check of the Pallas Triton kernel: float32 errors of the hop and the ring "
                        "vs XLA, TFLOP/s vs cuDNN (benchmarks.bench_gpu; "
                        "--gpu-kernel --help lists its options, --gpu-kernel --dry-run runs it on CPU)")
    return p


def epilog():
    """The modes, one a line, for the end of ``--help``."""
    lines = ["modes (--mode MODE; each has its own options: --mode MODE --help):"]
    lines += [f"  {name:<14}{text}" for name, (_, text) in MODES.items()]
    lines += [f"  {'--gpu-kernel':<14}{bench_gpu.__doc__.splitlines()[0]}"]
    return "\n".join(lines)


def parser():
    """The whole line's parser: the mode options, then train mode's (the default mode's help)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=epilog(),
                                formatter_class=report.HelpFormatter)
    add_mode_arguments(p)
    train.add_arguments(p.add_argument_group("train mode options"))
    return p


def split_mode(argv):
    """``(mode or None, gpu_kernel, the other arguments)``: ``--mode`` / ``--gpu-kernel`` taken out of
    ``argv`` wherever they are (a prefix such as ``--mo`` too: no mode has an option it could mean)."""
    pre = add_mode_arguments(argparse.ArgumentParser(prog=PROG, add_help=False))
    known, rest = pre.parse_known_args(argv)
    if known.gpu_kernel and known.mode is not None:
        pre.error(f"--gpu-kernel is a check of its own and takes no --mode; got --mode {known.mode}")
    return known.mode, known.gpu_kernel, rest


def main(argv=None):
    """Run the chosen benchmark: train mode's rows, another mode's rows, or bench_gpu's status."""
    mode, gpu_kernel, rest = split_mode(sys.argv[1:] if argv is None else list(argv))
    if gpu_kernel:
        return bench_gpu.main(rest)
    if mode in (None, "train"):
        return train.run(parser().parse_args(rest))
    return MODES[mode][0].main(rest)


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
