"""``impl=``: which code computes a hop, decided per call from the devices of the mesh.

``"auto"`` picks, for the platform of the mesh's devices: TPU -> ``"pallas_tpu_fused"`` (one kernel
runs the whole ring, moving K/V by remote DMA), GPU -> ``"pallas_gpu"`` (a Triton flash kernel per
hop), CPU -> ``"xla"`` (``kernels/xla.py``). The Pallas kernels take no ``bias`` and compute in
float32: with a bias ``"auto"`` falls back to ``"xla"``, and asking for a Pallas impl explicitly with a
bias, with float64 or with mixed q/k/v dtypes is an error (``kernels.tiles.check_kernel_dtypes``). On a
chip the kernels' memory table does not know (``kernels.budgets.CHIPS``: no VMEM / shared-memory budget
to check), ``"auto"`` picks ``"xla"`` and an explicit Pallas impl is an error naming ``device_kind``. On
CPU the Pallas impls run in their interpreters (slow; for tests). Where each impl runs is the table
``kernels.IMPLS``; its modules are imported here when first used.
"""
from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import jax.numpy as jnp

from .kernels import GPU_PLATFORMS, IMPLS

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


def kernels_for(impl):
    """The :class:`Kernels` of a resolved impl (``"xla"``, ``"pallas_gpu"``, ...); imports its module."""
    row = IMPLS[impl]
    module = importlib.import_module(f"{__package__}.kernels.{row.module}")
    blocks = getattr(module, "default_blocks", None)
    if row.per_hop:
        return Kernels(module.hop_fwd, module.hop_bwd, None, row.skip_empty_hops, blocks)
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


def check_impl(impl, platform, q, k, v, *, has_bias=False, has_dropout=False, xla_only=False, fused_ok=True,
               device_kind=None):
    """The concrete impl for this call, or a ValueError naming what does not fit (bias, dropout, dtype,
    platform). Attention dropout, ``logit_softcap``, ``mask_fn`` and ``score_fn`` (``xla_only``) run in
    the XLA hop only: ``"auto"`` picks it, as it does on a TPU or GPU ``device_kind`` that
    ``kernels.budgets`` has no row for.

    ``fused_ok=False``: the caller needs per-hop functions (``comm_dtype`` on the ring, the all-gather
    and Ulysses strategies), so "auto" picks "pallas_tpu" where it would pick the fused ring.
    """
    impls = ("auto",) + tuple(IMPLS)
    if not isinstance(impl, str) or impl not in impls:
        raise ValueError(f"impl must be one of {impls}; got {impl!r}")
    if impl == "pallas_tpu_fused" and not fused_ok:
        raise ValueError("impl='pallas_tpu_fused' runs the whole ring in one kernel that moves K/V itself; "
                         "comm_dtype, the all-gather and Ulysses need per-hop kernels: use impl='pallas_tpu'")
    if impl == "auto":
        value_width = v.shape[-1] != q.shape[-1]
        impl = "xla" if has_bias or has_dropout or xla_only or value_width else _AUTO.get(platform, "xla")
        impl = "pallas_tpu" if impl == "pallas_tpu_fused" and not fused_ok else impl
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
    if xla_only:
        raise ValueError(f"impl={impl!r} does not support logit_softcap, mask_fn or score_fn yet (the XLA hop "
                         f"applies them); use impl='xla' or impl='auto' with them")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"impl={impl!r} needs v as wide as q and k for now; got q {tuple(q.shape)}, v "
                         f"{tuple(v.shape)} (a value width of its own runs in the XLA hop: impl='xla' or 'auto')")
    row = IMPLS[impl]
    if platform not in row.compiled + row.interpreted:
        raise ValueError(f"impl={impl!r} cannot run on {platform!r} devices (the mesh's platform); it runs on "
                         f"{row.compiled} (and in its interpreter on {row.interpreted}): use impl='auto' or 'xla'")
    check_kernel_dtypes(impl, q, k, v)
    return impl
