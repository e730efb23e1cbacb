"""One process of a multi-process ``ring_attention`` check, for tests/test_multiprocess.py.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- python tests/_multiprocess_worker.py

Every process runs this same program (SPMD, multi-controller JAX): it joins the job
(``jax.distributed.initialize``, the environment from ``scripts/launch_local.py``), builds one mesh
over the devices of *all* processes (``make_mesh()``: 2 processes x 4 CPU devices = a ring of 8),
builds global q/k/v from a seeded numpy array of which it places only its own shards
(``jax.make_array_from_callback`` asks it for the 4 slices its devices hold), runs the ring forward
and backward, gathers the outputs and gradients to every process (``process_allgather``), and
compares them with the float64 oracle. Each process prints its own errors as one JSON line (each
checks the gathered result it holds; a real program prints on process 0 only) and exits 1 if one
is above ``TOL``. It joins and leaves the job through ``_multiprocess_job``: JAX's timeouts, and the
exit code written for the launcher, so that a process that fails ends the whole job.

Cases (batch 2, seq 64, 4 heads, 2 kv heads, dim 16, float32), on one ring of all 8 devices: causal
GQA in the contiguous layout, and causal with 3 documents (segment ids) in the zigzag layout; on the
2-D mesh ``make_mesh(data=2)``: the batch split over ``"data"`` (one row of the mesh per process, so
each ring stays inside a process: what you want across nodes), causal; and, when ``ringattn_fast``
has it, ``dot_product_attention`` against ``jax.nn.dot_product_attention`` on the gathered arrays.
"""
import json
import os
import sys

import jax

import _multiprocess_job as job

if "JAX_NUM_PROCESSES" not in os.environ or "JAX_PROCESS_ID" not in os.environ:
    sys.exit("run this through the launcher: python scripts/launch_local.py --processes 2 "
             "--devices-per-process 4 -- python tests/_multiprocess_worker.py")
# Before any JAX computation; the coordinator's address comes from JAX_COORDINATOR_ADDRESS. The timeouts
# (_multiprocess_job) end the job when a process fails, with or without the launcher watching.
job.initialize()

import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import process_allgather  # noqa: E402

import ringattn_fast as rf  # noqa: E402
import ringattn_ref as ref  # noqa: E402

B, S, H, HK, D = 2, 64, 4, 2, 16
DOCS = (20, 30, 14)  # document lengths of the segment-ids case
TOL = 2e-5  # float32 vs the float64 oracle, relative to max(1, max |oracle|)


def global_array(x, mesh, spec):
    """``x`` (the same numpy array on every process) as one global array; this process fills only its shards."""
    sharding = jax.NamedSharding(mesh, spec)
    asked = []  # the slices this process was asked for: its devices' shards, nobody else's

    def shard(index):
        asked.append(index)
        return x[index]

    out = jax.make_array_from_callback(x.shape, sharding, shard)
    assert len(asked) == jax.local_device_count() and not out.is_fully_addressable, (asked, out.sharding)
    return out


def rel_err(got, want):
    """max |got - want| / max(1, max |want|), in float64. Not ``tests/helpers.rel_err`` (which asserts that
    NaN / -inf patterns match and skips non-finite entries): here a NaN must come out as an error value in
    this process's JSON line (``not e <= TOL``), not as an assertion part-way through the job, and the
    worker, which also runs outside pytest (``scripts/launch_local.py``), needs no hypothesis."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def check_ring(mesh, arrays, host, name, **kw):
    """Forward and vjp of ``ring_attention(**kw)`` on global arrays vs the oracle: ``{name/what: error}``."""
    q, k, v, do, seg = (arrays[x] for x in ("q", "k", "v", "do", "seg"))
    f = jax.jit(lambda q, k, v, seg: rf.ring_attention(q, k, v, mesh=mesh, segment_ids=seg, **kw))
    o, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
    got = process_allgather((o,) + vjp(do), tiled=True)  # global arrays -> numpy everywhere
    seg_np = None if seg is None else host["seg"]
    want_o = ref.attention(host["q"], host["k"], host["v"], segment_ids=seg_np,
                           **{key: val for key, val in kw.items() if key != "layout"})
    want = (want_o,) + ref.ring_attention_vjp(host["q"], host["k"], host["v"], host["do"], n_hosts=mesh.shape["sp"],
                                              segment_ids=seg_np, **kw)
    return {f"{name}/{what}": rel_err(g, w) for what, g, w in zip(("o", "dq", "dk", "dv"), got, want)}


def check_dot_product_attention(mesh, arrays, host):
    """``rf.dot_product_attention`` (the ring) vs ``jax.nn.dot_product_attention`` on the gathered arrays."""
    f = jax.jit(lambda q, k, v: rf.dot_product_attention(q, k, v, is_causal=True, mesh=mesh))
    o = f(arrays["q"], arrays["k"], arrays["v"])
    want = jax.nn.dot_product_attention(host["q"], host["k"], host["v"], is_causal=True)  # one local device
    return {"dot_product_attention/o": rel_err(process_allgather(o, tiled=True), want)}


def main():
    n, me = jax.process_count(), jax.process_index()
    assert jax.device_count() == n * jax.local_device_count(), (jax.devices(), jax.local_devices())
    mesh = rf.make_mesh()  # every device of every process: one ring of jax.device_count() hosts
    assert {d.process_index for d in mesh.devices.flat} == set(range(n)), mesh.devices
    rng = np.random.default_rng(0)  # the same seed everywhere: every process knows the global values
    host = {"q": rng.standard_normal((B, S, H, D)), "k": rng.standard_normal((B, S, HK, D)),
            "v": rng.standard_normal((B, S, HK, D)), "do": rng.standard_normal((B, S, H, D))}
    host = {name: x.astype(np.float32) for name, x in host.items()}
    host["seg"] = np.repeat(np.repeat(np.arange(len(DOCS), dtype=np.int32), DOCS)[None], B, 0)  # [B, S]
    arrays = {name: global_array(x, mesh, jax.P(None, "sp")) for name, x in host.items()}

    errors = check_ring(mesh, dict(arrays, seg=None), host, "causal gqa contiguous", causal=True)
    errors |= check_ring(mesh, arrays, host, "causal segments zigzag", causal=True, layout="zigzag")
    rows = rf.make_mesh(data=n)  # ("data", "sp"): row r = the devices of process r, a ring of 4 each
    assert all(len({d.process_index for d in row}) == 1 for row in rows.devices), rows.devices
    by_rows = {name: global_array(x, rows, jax.P("data", "sp")) for name, x in host.items()}
    errors |= check_ring(rows, dict(by_rows, seg=None), host, "causal data=2", causal=True)
    if hasattr(rf, "dot_product_attention"):
        errors |= check_dot_product_attention(mesh, arrays, host)
    else:
        print("skipped dot_product_attention: ringattn_fast has no dot_product_attention", flush=True)
    print(json.dumps({"process": me, "processes": n, "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(), "errors": errors}), flush=True)
    return 1 if any(not e <= TOL for e in errors.values()) else 0


if __name__ == "__main__":
    job.run(main)  # sys.exit(main()), telling the launcher when this process has left (_multiprocess_job)
