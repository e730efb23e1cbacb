"""Subprocess probe for tests/test_kernels_fused.py: is removing the fused ring's handshake caught?

Runs the fused forward kernel on 4 simulated devices three times and prints one JSON line:
with the handshake (race detector on, expect no race), without it and ``on_race="warn"`` (expect
``races_found``), without it and ``on_race="raise"`` (expect an exception naming the race). The
last one leaves the TPU interpreter's global state broken, hence a separate process. With 2
devices each device sends once into a never-used slot; from 3 devices on a slot is written twice, so
3 is the smallest ring where the handshake matters (notebook 09 shows the detector on 2 and 3); the
probe runs 4.
"""
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from ringattn_fast.kernels.races import races_found  # noqa: E402
from ringattn_fast.kernels.pallas_tpu_fused import fused_ring_attention_shard  # noqa: E402
from ringattn_fast.schedule import HopConfig, KVShard, QShard  # noqa: E402


def run(handshake, on_race):
    n, b, s, h, d = 4, 1, 32, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(3))
    pos = np.arange(s, dtype=np.int32)[None]
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    params = pltpu.InterpretParams(detect_races=True, on_race=on_race)

    def shard_fn(q, k, v, pos):
        return fused_ring_attention_shard(QShard(q, pos), KVShard(k, v, pos), HopConfig(scale=d ** -0.5, block_q=8,
                                          block_kv=8), axis_name="x", interpret=params, _handshake=handshake)

    seq = jax.P(None, "x")
    ring = jax.jit(jax.shard_map(shard_fn, mesh=mesh, in_specs=(seq,) * 4, out_specs=seq, check_vma=False))
    try:
        jax.block_until_ready(ring(q, k, v, pos))
        raised = None
    except Exception as e:  # noqa: BLE001 - the race surfaces wrapped in a runtime error
        message = f"{type(e).__name__}: {e}"
        raised = "RACE DETECTED" if "RACE DETECTED" in message else message[:1000]
    return {"races_found": races_found(), "raised": raised}


if __name__ == "__main__":
    result = {"handshake": run(True, "raise"), "no_handshake_warn": run(False, "warn"),
              "no_handshake_raise": run(False, "raise")}
    print(json.dumps(result))
