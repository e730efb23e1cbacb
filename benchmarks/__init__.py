"""Benchmarks of ringattn: tools, not part of the installed libraries. Run from the repository root:

    python -m benchmarks.bench --help            # every mode and option
    python -m benchmarks.bench                   # train mode: ring_attention vs dense vs the authors' package
    python -m benchmarks.bench --mode decode     # decoding against a sequence-sharded KV cache
    python -m benchmarks.bench --mode strategies # ring vs all-gather vs Ulysses
    python -m benchmarks.bench --gpu-kernel      # the Pallas Triton kernel on a GPU: float32 vs XLA, vs cuDNN

- :mod:`benchmarks.bench` -- the command line: ``--mode`` / ``--gpu-kernel``, then the mode's options;
- :mod:`benchmarks.train`, :mod:`benchmarks.decode`, :mod:`benchmarks.strategies` -- the CPU
  benchmarks on simulated devices (``docs/benchmarks.md``);
- :mod:`benchmarks.bench_gpu` -- the GPU check of the Triton kernel (its float32 half: :mod:`benchmarks.gpu_checks`;
  ``--dry-run`` runs it on CPU);
- :mod:`benchmarks.timeline` -- the profiler timeline of one forward+backward;
- :mod:`benchmarks.timing`, :mod:`benchmarks.report` -- what they share: progress bar and
  round-robin timing; JSON lines, configuration line, tables, length labels, figures;
- :mod:`benchmarks.authors` -- the stand-ins that let the authors' ``ringattention`` 0.1.2 import.
"""
