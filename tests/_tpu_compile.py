"""Deviceless TPU compiles for tests/test_compile.py, run in a subprocess with libtpu on PYTHONPATH.

``jax.experimental.topologies.get_topology_desc`` gives compile-only devices of a TPU slice that is not
here; ``jax.jit(f).trace(...).lower().compile()`` over a mesh of them runs the real XLA:TPU and Mosaic
compilers (VMEM allocation included), where lowering alone stops at Mosaic's verifier. Prints one JSON
object per case to stdout:

- ``ring``: ``ring_attention`` forward+backward (``jax.vjp``) at its default tiles, per-hop kernel and
  fused ring, on an 8-chip slice of each chip (v5e, v6e: ``chip_config_name="default"``; v4, v5p:
  ``"megacore"``), 4096 tokens a chip, causal, GQA, bfloat16: ``ok``, the kernels in the compiled program,
  its temp MiB and its transfers as ``hiding`` reads them;
- ``one_chip``: the default call (no ``impl``) on a 1-chip v5e, forward+backward;
- ``memory``: temp bytes of that compiled forward+backward (``memory_analysis()``) against splash
  attention's at blocks 1024, called on [b, s, h, d] arrays as ours is (its transposes and the
  pre-scaling of q in the program), causal, 8 heads, d = 128, bfloat16, at 16K and 32K tokens;
- ``hiding``: ``benchmarks.overlap``'s check (issue 45): for each ``collective-permute`` of the scheduled
  HLO, whether compute runs between its start and done; ``ring`` rows carry the same fields;
- ``control``: a Pallas kernel whose blocks cannot fit VMEM must fail to compile (so the compiles above
  prove something).

usage: python tests/_tpu_compile.py [ring hiding one_chip memory control]
"""
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

import ringattn_fast as rf
from benchmarks import overlap

# 8-chip slices (issue 45: the ring's transfers are checked where a ring has more than a few hops)
SLICES = {"v5e": ("v5e:2x4", "default", (2, 4, 1)), "v6e": ("v6e:2x4", "default", (2, 4, 1)),
          "v4": ("v4:2x2x2", "megacore", (2, 2, 2)), "v5p": ("v5p:2x2x2", "megacore", (2, 2, 2))}


def devices(topology, config, bounds=(2, 2, 1)):
    return topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=bounds, num_slices=1,
                                        chip_config_name=config).devices


def mesh_of(devs):
    return jax.sharding.Mesh(np.array(devs), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))


def compiled_vjp(mesh, seq, heads, kv_heads, dim, **kw):
    """ring_attention's forward+backward compiled for ``mesh`` (global [1, seq, heads, dim] bfloat16)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((1, seq, kv_heads, dim), jnp.bfloat16, sharding=sharding)

    def f(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, causal=True, **kw), q, k, v)
        return (o,) + vjp(do)
    return jax.jit(f).trace(q, k, k, q).lower().compile()


def kernels(compiled):
    return sorted(set(re.findall(r"ring_(?:hop|fused)_[a-z_]+_tpu", compiled.as_text())))


def ring():
    for chip, (topology, config, bounds) in SLICES.items():
        mesh = mesh_of(devices(topology, config, bounds))
        for impl in ("pallas_tpu", "pallas_tpu_fused"):
            row = dict(case="ring", chip=chip, impl=impl)
            try:
                program = compiled_vjp(mesh, 8 * 4096, 8, 2, 128, impl=impl)
                row.update(ok=True, kernels=kernels(program), **overlap.read(program))
            except Exception as e:  # the test reports it
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            yield row


def hiding():
    """``benchmarks.overlap``'s check on the 8-chip v5e beside the causal GQA rows of ``ring``: the per-hop
    kernel not causal (8 heads), the XLA hop causal, and the control ring, which must come out exposed."""
    for impl, causal, backward in (("pallas_tpu", False, True), ("xla", True, True), ("control", False, False)):
        yield dict(case="hiding") | overlap.check("v5e", impl, causal, backward)


def one_chip():
    mesh = mesh_of(devices("v5e:1x1", "default", (1, 1, 1)))
    yield dict(case="one_chip", ok=True, kernels=kernels(compiled_vjp(mesh, 8192, 8, 8, 128)))


def splash_temp(mesh, seq, heads, dim, block=1024):
    from benchmarks.bench_tpu import splash_kernel
    kernel = splash_kernel(seq, heads, causal=True, block=block, fused_bwd=False)
    t = lambda x: x.swapaxes(1, 2)  # noqa: E731
    attn = lambda q, k, v: t(kernel(t(q * dim ** -0.5), t(k), t(v)))  # noqa: E731
    x = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, jax.P()))

    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o,) + vjp(do)
    return jax.jit(f).trace(x, x, x, x).lower().compile().memory_analysis().temp_size_in_bytes


def memory():
    mesh = mesh_of(devices("v5e:1x1", "default", (1, 1, 1)))
    for seq in (16384, 32768):
        ours = compiled_vjp(mesh, seq, 8, 8, 128).memory_analysis().temp_size_in_bytes
        splash = splash_temp(mesh, seq, 8, 128)
        yield dict(case="memory", seq=seq, ours_mib=ours / 2 ** 20, splash_mib=splash / 2 ** 20, ratio=ours / splash)


def control():
    from jax.experimental import pallas as pl
    mesh = mesh_of(devices("v5e:1x1", "default", (1, 1, 1)))
    big = (8192, 8192)  # one float32 block of 256 MiB, double-buffered: twice a v5e's 128 MiB of VMEM
    call = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2), grid=(2,),
                          in_specs=[pl.BlockSpec(big, lambda i: (i, 0))], out_specs=pl.BlockSpec(big, lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((2 * big[0], big[1]), jnp.float32))
    x = jax.ShapeDtypeStruct((2 * big[0], big[1]), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    try:
        jax.jit(call).trace(x).lower().compile()
        yield dict(case="control", rejected=False)
    except Exception as e:
        yield dict(case="control", rejected=True, error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["ring", "hiding", "one_chip", "memory", "control"]:
        for row in globals()[name]():
            print(json.dumps(row), flush=True)
