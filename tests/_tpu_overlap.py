"""Deviceless TPU compiles for tests/test_overlap.py, run in a subprocess with libtpu on PYTHONPATH.

Compiles ``ring_attention`` forward+backward (``jax.vjp``) for 8-chip slices (``benchmarks.overlap.TARGETS``:
v5e and v6e ``"default"``, v5p ``"megacore"``), 4096 tokens a chip, 8 heads, d = 128, bfloat16, and reads the
scheduled HLO (``benchmarks.overlap``): one JSON row per case to stdout. Few compiles (CI has 2 cores): per-hop
Pallas kernel causal and not on v5e, the XLA hop causal on v5e, the Pallas kernel non-causal on v6e and v5p,
and the control (a ring whose transfers a data dependency exposes), about a minute and a half here.

usage: python tests/_tpu_overlap.py
"""
import json
import time

from benchmarks import overlap

CASES = [("v5e", "pallas_tpu", False, True), ("v5e", "pallas_tpu", True, True), ("v5e", "xla", True, True),
         ("v6e", "pallas_tpu", False, True), ("v5p", "pallas_tpu", False, True), ("v5e", "control", False, False)]

if __name__ == "__main__":
    t0 = time.perf_counter()
    for case in CASES:
        print(json.dumps(overlap.check(*case)), flush=True)
    print(json.dumps(dict(case="total", seconds=round(time.perf_counter() - t0, 1))), flush=True)
