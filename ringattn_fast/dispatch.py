"""``impl=``: which code computes a hop, decided per call from the devices of the mesh.

``"auto"`` picks, for the platform of the mesh's devices: TPU -> ``"pallas_tpu_fused"`` (one kernel
runs the whole ring, moving K/V by remote DMA), GPU -> ``"pallas_gpu"`` (a Triton flash kernel per
hop), CPU -> ``"xla"`` (``hop.py``). The Pallas kernels take no ``bias`` and compute in float32: with
a bias ``"auto"`` falls back to ``"xla"``, and asking for a Pallas impl explicitly with a bias, with
float64 or with mixed q/k/v dtypes is an error (``kernels.tiles.check_kernel_dtypes``). On CPU the
Pallas impls run in their interpreters (slow; for tests). The per-hop TPU kernel must run on every
host at every step (the TPU interpreter puts a barrier before each kernel), so the ring never skips
its hops with ``lax.cond``: it skips tiles inside the kernel, from its prefetched tile schedule.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from . import hop
from .kernels import pallas_gpu, pallas_tpu, tpu_ring_fused
from .kernels.tiles import check_kernel_dtypes


class Kernels(NamedTuple):
    """What one impl provides: per-hop functions (the contract of ``docs/design.md``), or a whole
    ring; where it runs (``"cpu"`` = interpret mode); whether the ring may skip empty hops around it."""
    hop_fwd: Callable | None
    hop_bwd: Callable | None
    ring: Callable | None
    runs_on: tuple
    ring_may_skip: bool


KERNELS = {
    "xla": Kernels(hop.hop_fwd, hop.hop_bwd, None, ("cpu", "gpu", "cuda", "rocm", "tpu"), True),
    "pallas_gpu": Kernels(pallas_gpu.hop_fwd, pallas_gpu.hop_bwd, None, ("gpu", "cuda", "rocm", "cpu"), True),
    "pallas_tpu": Kernels(pallas_tpu.hop_fwd, pallas_tpu.hop_bwd, None, ("tpu", "cpu"), False),
    "pallas_tpu_fused": Kernels(None, None, tpu_ring_fused.fused_ring_attention_shard, ("tpu", "cpu"), False),
}
IMPLS = ("auto",) + tuple(KERNELS)
_AUTO = {"tpu": "pallas_tpu_fused", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}


def kernels_for(impl):
    """The :class:`Kernels` of a resolved impl (``"xla"``, ``"pallas_gpu"``, ...)."""
    return KERNELS[impl]


def check_impl(impl, platform, q, k, v, *, has_bias=False, has_dropout=False, fused_ok=True):
    """The concrete impl for this call, or a ValueError naming what does not fit (bias, dropout, dtype,
    platform). Attention dropout runs in the XLA hop only: ``"auto"`` picks it.

    ``fused_ok=False``: the caller needs per-hop functions (``comm_dtype`` on the ring, the all-gather
    and Ulysses strategies), so "auto" picks "pallas_tpu" where it would pick the fused ring.
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if impl == "pallas_tpu_fused" and not fused_ok:
        raise ValueError("impl='pallas_tpu_fused' runs the whole ring in one kernel that moves K/V itself; "
                         "comm_dtype, the all-gather and Ulysses need per-hop kernels: use impl='pallas_tpu'")
    if impl == "auto":
        impl = "xla" if has_bias or has_dropout else _AUTO.get(platform, "xla")
        impl = "pallas_tpu" if impl == "pallas_tpu_fused" and not fused_ok else impl
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
    if platform not in KERNELS[impl].runs_on:
        raise ValueError(f"impl={impl!r} cannot run on {platform!r} devices; it runs on "
                         f"{KERNELS[impl].runs_on} (cpu = interpret mode)")
    check_kernel_dtypes(impl, q, k, v)
    return impl
