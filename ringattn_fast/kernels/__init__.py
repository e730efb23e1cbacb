"""The code that computes a hop, one module per ``impl=`` value (docs/design.md, "Per-hop contract").

======================  =========================  ================  ==============  ====================
impl                    module                     runs compiled on  interpreted on  what it provides
======================  =========================  ================  ==============  ====================
``"xla"``               ``xla.py``                 cpu, gpu, tpu     —               ``hop_fwd``, ``hop_bwd``
``"pallas_gpu"``        ``pallas_gpu.py``          gpu (Triton)      cpu             ``hop_fwd``, ``hop_bwd``
``"pallas_tpu"``        ``pallas_tpu.py``          tpu (Mosaic)      cpu             ``hop_fwd``, ``hop_bwd``
``"pallas_tpu_fused"``  ``pallas_tpu_fused.py``    tpu (Mosaic)      cpu             ``ring``: the whole ring, remote DMA
======================  =========================  ================  ==============  ====================

:data:`IMPLS` is that table, the one place that says where each impl runs (``dispatch`` and
``tiles.interpret_mode`` read it, on the platform of the mesh: ``mesh.mesh_device``, never
``jax.default_backend()``, so an abstract TPU or GPU mesh lowers the real kernel on a CPU host).
``budgets.py`` holds the per-chip VMEM / shared-memory table and the footprint estimates every
compiled kernel checks before it is lowered; ``fused_ring.py`` the fused ring's plumbing.
The modules are imported when an impl is first used
(``dispatch.kernels_for``), never here, so ``import ringattn_fast`` pulls in no Pallas. ``tiles.py``
is what the Pallas kernels share: tile bounds and schedules on ``masks.bounds_empty``, interpret mode
and their own preconditions (dtypes, tile shapes). They assume a validated call: ``ringattn_fast.front``
checks every argument once, before anything is traced.

K/V reach every kernel marked by ``masks.mark_bad_keys`` (the ring does it once, before the first hop),
except the per-hop TPU kernels' (``Impl.marks_keys``): they mark each K/V tile that holds a bad key in
VMEM, which spares a marked copy of K and V in HBM. What is left of the non-finite-key rule,
``masks.finite_part`` and ``masks.masked_grad``, the kernels share with the XLA hop.
"""
from typing import NamedTuple

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PROGRAMS = ("logit_softcap", "mask_fn", "score_fn", "value_width")  # docs/design.md, "Programmable attention"


class Impl(NamedTuple):
    """One row of :data:`IMPLS`: the module (in this package), the platforms it runs on compiled and
    interpreted, whether it provides per-hop functions (else a whole ring), whether the ring may skip
    an empty hop around it with ``lax.cond`` (not around a per-hop TPU kernel: the TPU interpreter puts a
    barrier across all devices before each kernel, so every host must run it at every step), and which
    of :data:`PROGRAMS` it applies (``value_width``: v as wide as it likes, d_v != d). ``marks_keys``: its
    kernels mark bad keys themselves (``masks.mark_bad_keys`` per tile), so the ring passes K/V unmarked
    where nothing re-encodes them on the way (no ``comm_dtype``: ``masks.marked_for_ring``)."""
    module: str
    compiled: tuple
    interpreted: tuple
    per_hop: bool = True
    skip_empty_hops: bool = True
    programs: tuple = PROGRAMS
    marks_keys: bool = False


IMPLS = {
    "xla": Impl("xla", ("cpu",) + GPU_PLATFORMS + ("tpu",), ()),
    "pallas_gpu": Impl("pallas_gpu", GPU_PLATFORMS, ("cpu",)),
    "pallas_tpu": Impl("pallas_tpu", ("tpu",), ("cpu",), skip_empty_hops=False, marks_keys=True),
    "pallas_tpu_fused": Impl("pallas_tpu_fused", ("tpu",), ("cpu",), per_hop=False, skip_empty_hops=False),
}
