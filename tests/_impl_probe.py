"""Subprocess probe for tests/test_fast_semantics.py: one impl, every mask and layout, x64 on.

``python tests/_impl_probe.py IMPL`` runs ``ringattn_fast.ring_attention(impl=IMPL)`` forward and
backward (with ``return_lse=True``) on 2 and 4 simulated devices for masks where hosts disagree on skipping a hop (causal with
the contiguous layout, ``window=(0, -1)``: issue 8's deadlock of the per-hop TPU kernel), for windows
beyond int32 (the overflow that zeroed every output), and with NaN in a key that only its own query
sees (a masked key must contribute nothing), and prints one JSON line of max errors against the
float64 oracle. ``jax_enable_x64`` is on while the inputs are float32 (the fused kernel used to crash
on int64 ring indices). A separate process, so that a deadlock is a timeout and not a hung test run.
"""
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ringattn_fast as rf  # noqa: E402
import ringattn_ref as ref  # noqa: E402
from helpers import rel_err  # noqa: E402  (tests/ is sys.path[0]: this file runs as a script)

B, H, HK, D = 1, 2, 1, 8
CASES = {  # name -> (devices, ring_attention keywords); each case compiles a forward and a backward ring
    "causal contiguous": (2, dict(causal=True)),
    "window (0, -1) contiguous, 4 devices": (4, dict(window=(0, -1))),
    "window (2**31-1, 2**31-1) striped": (2, dict(window=(2**31 - 1, 2**31 - 1), layout="striped")),
}


def problem(n, seed=0):
    rng = np.random.default_rng(seed)
    s = 8 * n
    q, do = rng.standard_normal((2, B, s, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, B, s, HK, D)).astype(np.float32)
    return q, k, v, do


def fast(q, k, v, do, n, impl, **kw):
    """o, lse (``return_lse=True``, issue 9), dq, dk, dv of ``ring_attention(impl=impl)``."""
    mesh = rf.make_mesh(n)
    f = lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, impl=impl, block_q=8, block_kv=8,  # noqa: E731
                                          return_lse=True, **kw)
    (o, lse), vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v)))
    return [np.asarray(x, np.float64) for x in (o, lse) + vjp((jnp.asarray(do), jnp.zeros_like(lse)))]


def oracle(q, k, v, do, n, **kw):
    o, lse = ref.attention(q, k, v, return_lse=True, **{key: val for key, val in kw.items() if key != "layout"})
    return [o, lse, *ref.ring_attention_vjp(q, k, v, do, n_hosts=n, **kw)]


def main(impl):
    out = {}
    for name, (n, kw) in CASES.items():
        q, k, v, do = problem(n)
        got, want = fast(q, k, v, do, n, impl, **kw), oracle(q, k, v, do, n, **kw)
        out[name] = max(rel_err(g, w) for g, w in zip(got, want))
    # NaN in K and V of the last key, alone in its segment: only its own query sees it (that row and that
    # key's gradients are NaN); every other output and gradient equals the oracle with the key zeroed.
    n = 2
    q, k, v, do = problem(n, seed=1)
    seg = np.zeros((B, 8 * n), np.int32)
    seg[:, -1] = 1
    k[:, -1], v[:, -1] = np.nan, np.nan
    got = fast(q, k, v, do, n, impl, causal=True, segment_ids=seg)
    k0, v0 = np.where(np.isnan(k), 0, k), np.where(np.isnan(v), 0, v)
    want = oracle(q, k0, v0, do, n, causal=True, segment_ids=seg)
    out["nan row is nan"] = bool(np.isnan(got[0][:, -1]).all() and np.isnan(got[1][:, :, -1]).all())
    rows, keys = np.s_[:, :-1], np.s_[:, :-1]
    lse_rows = np.s_[:, :, :-1]
    out["masked nan key"] = max(rel_err(got[0][rows], want[0][rows]), rel_err(got[1][lse_rows], want[1][lse_rows]),
                                rel_err(got[2][rows], want[2][rows]), rel_err(got[3][keys], want[3][keys]),
                                rel_err(got[4][keys], want[4][keys]))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
