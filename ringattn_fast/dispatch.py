"""``impl=`` dispatch, decided per call from the devices of the mesh (never at import time).

``"auto"`` picks, for the platform of the mesh's devices: TPU -> ``"pallas_tpu_fused"`` (one kernel
runs the whole ring, moving K/V by remote DMA), GPU -> ``"pallas_gpu"`` (a Triton flash kernel per
hop), CPU -> ``"xla"`` (``hop.py``). The Pallas kernels take no ``bias``: with a bias ``"auto"``
falls back to ``"xla"``, and asking for a Pallas impl explicitly with a bias is an error. On CPU the
Pallas impls run in their interpreters (slow; for tests). Kernel modules are imported lazily, here.
"""
from __future__ import annotations

from importlib import import_module

IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu", "pallas_tpu_fused")
_AUTO = {"tpu": "pallas_tpu_fused", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}
_RUNS_ON = {"pallas_gpu": ("gpu", "cuda", "rocm", "cpu"), "pallas_tpu": ("tpu", "cpu"),
            "pallas_tpu_fused": ("tpu", "cpu")}
_MODULES = {"pallas_gpu": "ringattn_fast.kernels.pallas_gpu", "pallas_tpu": "ringattn_fast.kernels.pallas_tpu",
            "pallas_tpu_fused": "ringattn_fast.kernels.tpu_ring_fused"}


def resolve_impl(impl, platform, *, has_bias=False):
    """The concrete impl for this call: ``"xla"``, ``"pallas_gpu"``, ``"pallas_tpu"`` or ``"pallas_tpu_fused"``."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if impl == "auto":
        impl = "xla" if has_bias else _AUTO.get(platform, "xla")
    if impl == "xla":
        return impl
    if has_bias:
        raise ValueError(f"impl={impl!r} does not support bias (the Pallas kernels take none); "
                         f"use impl='xla' or impl='auto' with a bias")
    if platform not in _RUNS_ON[impl]:
        raise ValueError(f"impl={impl!r} cannot run on {platform!r} devices; it runs on "
                         f"{_RUNS_ON[impl]} (cpu = interpret mode)")
    return impl


def hop_functions(impl):
    """``(hop_fwd, hop_bwd)`` implementing the per-hop contract for a per-hop impl."""
    if impl == "xla":
        from . import hop
        return hop.hop_fwd, hop.hop_bwd
    if impl in ("pallas_gpu", "pallas_tpu"):
        module = import_module(_MODULES[impl])
        return module.hop_fwd, module.hop_bwd
    raise ValueError(f"impl {impl!r} has no per-hop functions")


def fused_ring():
    """``fused_ring_attention_shard`` of the fused TPU ring kernel (its own custom_vjp)."""
    return import_module(_MODULES["pallas_tpu_fused"]).fused_ring_attention_shard
