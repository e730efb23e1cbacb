"""Benchmarks of ringattn: tools, not part of the installed libraries. Run from the repository root:

    python -m benchmarks.bench              # ring_attention vs jax.nn.dot_product_attention vs the authors' package
    python -m benchmarks.bench --gpu-kernel # the Pallas Triton per-hop kernel vs cuDNN (benchmarks.bench_gpu)

- :mod:`benchmarks.bench` -- the CPU benchmark on simulated devices (``docs/benchmarks.md``);
- :mod:`benchmarks.bench_gpu` -- the GPU check of the per-hop kernel (``--dry-run`` runs it on CPU);
- :mod:`benchmarks.authors` -- the stand-ins that let the authors' ``ringattention`` 0.1.2 import.
"""
