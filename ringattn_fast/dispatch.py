"""``impl=``: which code computes a hop, decided per call from the devices of the mesh.

``"auto"`` picks, for the platform of the mesh's devices: TPU -> ``"pallas_tpu_fused"`` (one kernel
runs the whole ring, moving K/V by remote DMA), GPU -> ``"pallas_gpu"`` (a Triton flash kernel per
hop), CPU -> ``"xla"`` (``kernels/xla.py``). The Pallas kernels take no ``bias`` and compute in
float32: with a bias ``"auto"`` falls back to ``"xla"``, and asking for a Pallas impl explicitly with a
bias, with float64 or with mixed q/k/v dtypes is an error (``kernels.tiles.check_kernel_dtypes``). On a
chip the kernels' memory table does not know (``kernels.budgets.CHIPS``: no VMEM / shared-memory budget
to check), ``"auto"`` picks ``"xla"`` and an explicit Pallas impl is an error naming ``device_kind``. On
CPU the Pallas impls run in their interpreters (slow; for tests). Where each impl runs, and which of
``logit_softcap``, ``mask_fn``, ``score_fn`` and a value width of its own it applies, is the table
``kernels.IMPLS``; its modules are imported here when first used. A user function that indexes an
array (a gather) does not lower in a compiled kernel: ``"auto"`` picks ``"xla"`` for it, an explicit
Pallas impl there is an error (`gathering`).
"""
from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .kernels import GPU_PLATFORMS, IMPLS, PROGRAMS

KERNEL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_AUTO = {"tpu": "pallas_tpu_fused", **{p: "pallas_gpu" for p in GPU_PLATFORMS}}


class Kernels(NamedTuple):
    """What one impl provides: per-hop functions (the contract of ``docs/design.md``) or a whole ring,
    whether the ring may skip empty hops around it (``kernels.Impl.skip_empty_hops``), and the
    kernels' own default tiles, ``default_blocks(q_shape, k_shape, dtype, device) -> (block_q,
    block_kv) | None`` (``kernels.budgets``: the largest that fit the chip they are compiled for; None:
    ``default_block``), or None for the XLA hop."""
    hop_fwd: Callable | None
    hop_bwd: Callable | None
    ring: Callable | None
    skip_empty_hops: bool
    default_blocks: Callable | None = None
    default_bwd_blocks: Callable | None = None


def kernels_for(impl):
    """The :class:`Kernels` of a resolved impl (``"xla"``, ``"pallas_gpu"``, ...); imports its module."""
    row = IMPLS[impl]
    module = importlib.import_module(f"{__package__}.kernels.{row.module}")
    blocks = getattr(module, "default_blocks", None)
    if row.per_hop:
        return Kernels(module.hop_fwd, module.hop_bwd, None, row.skip_empty_hops, blocks,
                       getattr(module, "default_bwd_blocks", None))
    return Kernels(None, None, module.fused_ring_attention_shard, row.skip_empty_hops, blocks)


def check_kernel_dtypes(impl, q, k, v):
    """The Pallas kernels compute in float32 and take float16, bfloat16 or float32; q, k, v alike."""
    dtypes = [jnp.dtype(x.dtype) for x in (q, k, v)]
    bad = [dt for dt in dtypes if dt not in KERNEL_DTYPES]
    if bad:
        hint = ": use impl='xla' for float64" if jnp.dtype(jnp.float64) in bad else ""
        raise ValueError(f"impl={impl!r} computes in float32 and takes float16, bfloat16 or float32 "
                         f"inputs; got {bad[0]}{hint}")
    if len(set(dtypes)) > 1:
        raise ValueError(f"impl={impl!r} needs q, k, v of one dtype; got q {dtypes[0]}, k {dtypes[1]}, "
                         f"v {dtypes[2]} (cast them first, or use impl='xla')")


def _chip_known(device_kind):
    """Whether ``kernels.budgets`` has a row for ``device_kind`` (None, not given: assumed known)."""
    from .kernels import budgets  # no numpy tables on import: kernels' modules load when first used

    return device_kind is None or budgets.knows(device_kind)


def programs_used(v_width, qk_width, *, logit_softcap=None, mask_fn=None, score_fn=None):
    """The names (``kernels.PROGRAMS``) of the programmable-attention features a call uses."""
    used = dict(logit_softcap=logit_softcap is not None, mask_fn=mask_fn is not None, score_fn=score_fn is not None,
                value_width=v_width != qk_width)
    return tuple(name for name in PROGRAMS if used[name])


def gathering(heads, *, mask_fn=None, score_fn=None):
    """The names of the user functions that index an array (a gather or scatter in their jaxpr, e.g.
    ``variants.alibi``'s ``slopes[head]``): Mosaic and Triton lower neither, so these run in the XLA hop
    or an interpreted kernel only (the same per-head value as arithmetic of ``head`` lowers)."""
    i32, f32 = jnp.int32, jnp.float32
    col, row = jax.ShapeDtypeStruct((1, 1, 2, 1), i32), jax.ShapeDtypeStruct((1, 1, 1, 3), i32)
    head = jax.ShapeDtypeStruct((1, heads, 1, 1), i32)

    from jax.extend.core import jaxprs_in_params  # here: importing jax.extend imports Pallas (test_faces)

    def gathers(jaxpr):
        return any(e.primitive.name == "gather" or e.primitive.name.startswith("scatter")
                   or any(gathers(sub) for sub in jaxprs_in_params(e.params)) for e in jaxpr.eqns)

    fns = (("mask_fn", mask_fn, (col, row, col, row, head)),
           ("score_fn", score_fn, (jax.ShapeDtypeStruct((1, heads, 2, 3), f32), col, row, head)))
    return tuple(name for name, fn, args in fns if fn is not None and gathers(jax.make_jaxpr(fn)(*args).jaxpr))


def check_impl(impl, platform, q, k, v, *, has_bias=False, has_dropout=False, logit_softcap=None, mask_fn=None,
               score_fn=None, fused_ok=True, device_kind=None):
    """The concrete impl for this call, or a ValueError naming what does not fit (bias, dropout, dtype,
    platform, a programmable-attention feature its kernel lacks). Attention dropout and a bias run in the
    XLA hop only: ``"auto"`` picks it, as it does where the platform's kernel does not apply one of the
    call's ``logit_softcap``, ``mask_fn``, ``score_fn`` or ``d_v != d`` (``kernels.IMPLS``' ``programs``)
    or cannot lower a user function (`gathering`), and on a TPU or GPU ``device_kind`` that
    ``kernels.budgets`` has no row for.

    ``fused_ok=False``: the caller needs per-hop functions (``comm_dtype`` on the ring, the all-gather
    and Ulysses strategies), so "auto" picks "pallas_tpu" where it would pick the fused ring.
    """
    impls = ("auto",) + tuple(IMPLS)
    if not isinstance(impl, str) or impl not in impls:
        raise ValueError(f"impl must be one of {impls}; got {impl!r}")
    if impl == "pallas_tpu_fused" and not fused_ok:
        raise ValueError("impl='pallas_tpu_fused' runs the whole ring in one kernel that moves K/V itself; "
                         "comm_dtype, the all-gather, Ulysses and the hybrid need per-hop kernels: use impl='pallas_tpu'")
    used = programs_used(v.shape[-1], q.shape[-1], logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn)
    if impl == "auto":
        impl = "xla" if has_bias or has_dropout else _AUTO.get(platform, "xla")
        impl = "pallas_tpu" if impl == "pallas_tpu_fused" and not fused_ok else impl
        impl = impl if set(used) <= set(IMPLS[impl].programs) else "xla"
        if impl != "xla" and platform != "cpu" and gathering(q.shape[2], mask_fn=mask_fn, score_fn=score_fn):
            impl = "xla"  # compiled, the kernel could not lower the function
        if impl != "xla" and platform != "cpu" and not _chip_known(device_kind):
            impl = "xla"  # a chip without a memory row: nothing to check a kernel's tiles against
        if impl != "xla":
            try:
                check_kernel_dtypes(impl, q, k, v)
            except ValueError:  # float64 or mixed dtypes: the kernels compute in float32, XLA does not
                impl = "xla"
    if impl == "xla":
        return impl
    if has_dropout:
        raise ValueError(f"impl={impl!r} does not support dropout_rate > 0 (attention dropout runs in the XLA "
                         f"hop only); use impl='xla' or impl='auto' with dropout")
    if has_bias:
        raise ValueError(f"impl={impl!r} does not support bias (the Pallas kernels take none); "
                         f"use impl='xla' or impl='auto' with a bias")
    row = IMPLS[impl]
    lacking = [name for name in used if name not in row.programs]
    if lacking:
        what = ", ".join(f"v of width {v.shape[-1]} != q's {q.shape[-1]}" if name == "value_width" else name
                         for name in lacking)
        raise ValueError(f"impl={impl!r} does not apply {what} yet (the XLA hop does); use impl='xla' or "
                         f"impl='auto' with them")
    if platform in row.compiled:
        names = gathering(q.shape[2], mask_fn=mask_fn, score_fn=score_fn)
        if names:
            verb = "index" if len(names) > 1 else "indexes"
            raise ValueError(f"impl={impl!r}: {' and '.join(names)} {verb} an array (a gather, e.g. slopes[head]), "
                             f"which the compiled kernel cannot lower; compute the value from head instead (ALiBi: "
                             f"2 ** (-8 * (head + 1) / heads)) or use impl='xla' (or 'auto')")
    if platform not in row.compiled + row.interpreted:
        raise ValueError(f"impl={impl!r} cannot run on {platform!r} devices (the mesh's platform); it runs on "
                         f"{row.compiled} (and in its interpreter on {row.interpreted}): use impl='auto' or 'xla'")
    check_kernel_dtypes(impl, q, k, v)
    return impl
