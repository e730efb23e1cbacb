"""Memory budgets of the Pallas kernels on the chips they are lowered for: VMEM (TPU) and shared memory (GPU).

Lowering for a chip that is not here (``tests/test_lowering.py``) runs Pallas' lowering and Mosaic's op
verifier, but allocates nothing: a kernel whose tiles do not fit is only found when the chip's compiler
runs. So every compiled kernel call estimates its own footprint first, from the same block shapes and
scratch it hands to ``pallas_call``, and checks it against :data:`CHIPS` *before* lowering:

- fits the chip's default scoped VMEM limit -> compiled as is;
- fits the chip but not that default -> ``pltpu.CompilerParams(vmem_limit_bytes=...)`` raises the limit;
- fits nowhere -> ``ValueError`` naming ``block_q`` / ``block_kv``, the estimate and blocks that fit.

Estimates (ours, not the compilers': tested against the formulas, not against a chip):

- TPU (:func:`tpu_vmem_bytes`): each pipelined block twice (the grid pipeline double-buffers every
  operand: one buffer computed on, one being copied), each scratch buffer once, score-sized
  temporaries once (what Mosaic spills beyond its 64 vector registers), every buffer padded to Mosaic's
  ``(8 * packing, 128)`` tiles (packing = 4 // itemsize, so bfloat16 rows come in 16s;
  ``jax/_src/tpu_info.py``, ``get_sublane_tiling``). Scalar-prefetch tables live in SMEM
  (:func:`smem_bytes`). Only :data:`HEADROOM` of a limit is planned for; the rest is left to Mosaic's
  internal scratch and register spills.
- GPU (:func:`triton_smem_bytes`): what Triton's software pipeliner keeps in shared memory for one
  program: ``num_stages`` copies of each tile loaded in the loop (``num_stages`` = :data:`TRITON_STAGES`,
  the kernels' ``CompilerParams``), plus the tiles loaded once and the score-sized operand of the second
  matmul, all in the input dtype.
"""
from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import numpy as np

MiB = 1 << 20
KiB = 1 << 10
LANES = 128
HEADROOM = 0.8  # plan for 80% of a limit: Mosaic's internal scratch and spills are not in our estimate
TRITON_STAGES = 2  # pallas_gpu's CompilerParams(num_stages=...); the smem estimate depends on it


class Chip(NamedTuple):
    """One target. TPU: ``memory`` is VMEM per TensorCore (a megacore v4 / v5p device runs a
    "parallel" grid axis on two cores, each with its own VMEM), ``default_limit`` the scoped VMEM a
    kernel gets without ``vmem_limit_bytes``, ``max_limit`` the most it may ask for, ``smem`` SMEM per
    core. GPU: ``memory`` = ``default_limit`` = ``max_limit`` is the shared memory one thread block may
    use (the opt-in maximum, which Triton requests), ``smem`` 0."""
    name: str
    platform: str
    memory: int
    default_limit: int
    max_limit: int
    smem: int = 0


def _tpu(name, vmem_mib, smem_kib=1024):
    # VMEM / SMEM per TensorCore: jax/_src/tpu_info.py (_get_tpu_info_impl: "16 MiB per core" for v4,
    # 128 MiB v5e, 64 MiB v5p, 128 MiB v6e; SMEM 1 MiB per core). Default scoped limit: XLA's flag
    # guidance (openxla.org/xla/flags_guidance, xla_tpu_scoped_vmem_limit_kib: default 16384 KiB, valid
    # range [4096, VMEM size of the architecture - 1024] KiB), which also bounds what a kernel may ask for.
    # Newer libtpu releases may default higher on some chips; assuming 16 MiB only means asking explicitly.
    vmem, top = vmem_mib * MiB, (vmem_mib - 1) * MiB
    return Chip(name, "tpu", vmem, min(16 * MiB, top), top, smem_kib * KiB)


def _gpu(name, smem_kib):
    # Shared memory per thread block (opt-in maximum): NVIDIA CUDA C++ Programming Guide, "Technical
    # Specifications per Compute Capability": 163 KB on compute capability 8.0 (A100), 227 KB on 9.0
    # (H100, H200).
    return Chip(name, "gpu", smem_kib * KiB, smem_kib * KiB, smem_kib * KiB)


# jax.Device.device_kind strings: jax/_src/tpu_info.py (chip_version_from_device_kind) and
# jax/experimental/topologies.py for TPUs; for GPUs the CUDA device name, matched on its model.
CHIPS = {
    "TPU v4": _tpu("v4", 16),
    "TPU v5 lite": _tpu("v5e", 128), "TPU v5e": _tpu("v5e", 128),
    "TPU v5": _tpu("v5p", 64), "TPU v5p": _tpu("v5p", 64),
    "TPU v6 lite": _tpu("v6e", 128), "TPU v6e": _tpu("v6e", 128),
    "A100": _gpu("A100", 163), "H100": _gpu("H100", 227), "H200": _gpu("H200", 227),
}
_GPU_MODEL = re.compile(r"\b(A100|H100|H200)\b")


def knows(device_kind):
    """Whether :func:`chip` has a row for ``device_kind`` (``"auto"`` picks a kernel only where it does)."""
    return device_kind in CHIPS or bool(_GPU_MODEL.search(str(device_kind)))


def chip(device_kind):
    """The :class:`Chip` of a ``device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``, ...), or a
    ValueError naming ``device_kind`` and the chips the tables know."""
    if device_kind in CHIPS:
        return CHIPS[device_kind]
    model = _GPU_MODEL.search(str(device_kind))
    if model:
        return CHIPS[model.group(1)]
    known = sorted(k for k in CHIPS if k.startswith("TPU")) + ["NVIDIA A100*", "NVIDIA H100*", "NVIDIA H200*"]
    raise ValueError(f"device_kind {device_kind!r} is not in the kernels' memory table (ringattn_fast.kernels."
                     f"budgets.CHIPS), so no VMEM / shared-memory budget can be checked for it; known: {known}. "
                     f"Use impl='xla' there, or add the chip's row")


# ---------------------------------------------------------------- footprints

def _round_up(x, m):
    return -(-int(x) // m) * m


def tile_bytes(shape, dtype):
    """Bytes of one VMEM buffer of ``shape``: the last two dims padded to ``(8 * packing, 128)`` tiles
    (a 1-D buffer is one row). Example: (128, 1) float32 -> 128 * 128 * 4 = 64 KiB (a column costs 128 lanes)."""
    itemsize = np.dtype(dtype).itemsize
    *lead, rows, cols = (1,) * max(0, 2 - len(shape)) + tuple(int(s) for s in shape)
    sublanes = 8 * max(1, 4 // itemsize)
    return math.prod(lead) * _round_up(rows, sublanes) * _round_up(cols, LANES) * itemsize


def tpu_vmem_bytes(blocks=(), scratch=(), temps=()):
    """VMEM of one Mosaic kernel: ``blocks`` (pipelined operands, ``(block_shape, dtype)``) twice each,
    ``scratch`` and ``temps`` (score-sized values, ``(shape, dtype)``) once each, padded (`tile_bytes`)."""
    return (2 * sum(tile_bytes(s, dt) for s, dt in blocks) + sum(tile_bytes(s, dt) for s, dt in scratch)
            + sum(tile_bytes(s, dt) for s, dt in temps))


def block_of(spec, dtype):
    """``(block_shape, dtype)`` of a ``pl.BlockSpec`` with its squeezed (None) dims dropped: what one
    pipelined buffer holds."""
    return tuple(int(s) for s in spec.block_shape if s is not None), dtype


def smem_bytes(*arrays):
    """SMEM of scalar-prefetched tables (anything with ``shape`` and ``dtype``; None skipped)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays if a is not None)


def triton_smem_bytes(*, looped, once, score, dtype, stages=TRITON_STAGES):
    """Shared memory of one Triton program: ``looped`` tile shapes (loaded in the inner loop, pipelined
    ``stages`` deep), ``once`` tile shapes (loaded before the loop), ``score`` the (rows, cols) operand
    of the second matmul (P or dS, cast to the input dtype), all in ``dtype``."""
    size = lambda s: math.prod(s) * np.dtype(dtype).itemsize  # noqa: E731
    return stages * sum(size(s) for s in looped) + sum(size(s) for s in once) + size(score)


class Footprint(NamedTuple):
    """One kernel call's estimate: ``vmem`` (TPU VMEM or GPU shared memory) and ``smem`` (TPU SMEM) bytes,
    and ``what`` it is (the pallas_call's name, for messages)."""
    vmem: int
    smem: int = 0
    what: str = ""


def fits(chip_, footprint):
    """True if ``footprint`` fits ``chip_`` (within :data:`HEADROOM` of its largest limit and of SMEM)."""
    return (footprint.vmem <= HEADROOM * chip_.max_limit and
            (chip_.smem == 0 or footprint.smem <= HEADROOM * chip_.smem))


def vmem_limit(chip_, footprints):
    """``vmem_limit_bytes`` to compile with: None where the default scoped limit holds the estimate,
    else the estimate over :data:`HEADROOM` rounded up to a MiB (at most the chip's ``max_limit``)."""
    need = max(f.vmem for f in footprints) / HEADROOM
    if chip_.platform != "tpu" or need <= chip_.default_limit:
        return None
    return min(chip_.max_limit, _round_up(need, MiB))


def candidate_blocks(s, *, multiple=1, top=None):
    """Tile sides to try for a shard of ``s`` tokens, largest first: the whole shard (if it is at most
    ``top``), then its divisors ``<= top`` that are powers of two and multiples of ``multiple``."""
    top = s if top is None else min(top, s)
    out = [s] if s <= top else []
    p = 1 << (top.bit_length() - 1)
    while p >= multiple:
        if s % p == 0 and p % multiple == 0 and p not in out:
            out.append(p)
        p //= 2
    return out


def largest_fitting(chip_, estimate: Callable, q_blocks, kv_blocks):
    """The ``(block_q, block_kv)`` with the most ``block_q * block_kv`` (then the larger ``block_q``)
    whose ``estimate(block_q, block_kv)`` (a list of :class:`Footprint`) all fit ``chip_``; None if none."""
    pairs = sorted(((bq, bk) for bq in q_blocks for bk in kv_blocks), key=lambda p: (-p[0] * p[1], -p[0]))
    return next((p for p in pairs if all(fits(chip_, f) for f in estimate(*p))), None)


def check_fit(impl, chip_, estimate: Callable, *, block_q, block_kv, q_blocks, kv_blocks, hint_estimate=None,
              shape=""):
    """The ``vmem_limit_bytes`` for ``(block_q, block_kv)`` on ``chip_`` (None: the default limit holds
    it), or a ValueError naming block_q / block_kv, the estimate, the chip's limit and blocks that fit
    (searched among ``q_blocks`` x ``kv_blocks``). ``hint_estimate(block_q, block_kv)``: the footprints a
    suggestion must fit, the forward's and every backward kernel's (None: ``estimate``), so a suggested
    pair is accepted wherever it is fed back; when none fits, the message says so and names ``shape``
    (head dim and dtype) as what to change."""
    footprints = estimate(block_q, block_kv)
    bad = [f for f in footprints if not fits(chip_, f)]
    if not bad:
        return vmem_limit(chip_, footprints)
    f, memory = bad[0], "VMEM" if chip_.platform == "tpu" else "shared memory"
    good = largest_fitting(chip_, hint_estimate or estimate, q_blocks, kv_blocks)
    sixteen = any(name in shape for name in ("bfloat16", "float16"))
    hint = (f"block_q={good[0]}, block_kv={good[1]} fit, forward and backward" if good else
            f"no block sizes fit this shard{' at ' + shape if shape else ''}: a smaller head dim"
            + ("" if sixteen else " or a 16-bit dtype") + " needs less")
    raise ValueError(f"impl={impl!r}: block_q={block_q}, block_kv={block_kv} do not fit a {chip_.name}: "
                     f"{f.what} needs an estimated {_size(f.vmem)} of {memory}"
                     + (f" and {f.smem / KiB:.0f} KiB of SMEM" if f.smem else "")
                     + f", more than {HEADROOM:.0%} of the {_size(chip_.max_limit)} a kernel may use"
                     + (f" (SMEM {chip_.smem / KiB:.0f} KiB)" if chip_.smem else "") + f"; {hint}")


def _size(nbytes):
    """Bytes for a message: MiB from 1 MiB up (a TPU's VMEM), else KiB (a GPU's shared memory: 227 KiB on
    an H100 printed as "0 MiB")."""
    return f"{nbytes / MiB:.2f} MiB" if nbytes >= MiB else f"{nbytes / KiB:.0f} KiB"


def default_tiles(chip_, estimate: Callable, sq, sk, *, q_multiple, kv_multiple, top=128, q_top=None):
    """A kernel's default ``(block_q, block_kv)`` on ``chip_``: the largest tiles up to ``top`` (the
    library's ``default_block`` target; ``q_top``, if given, for ``block_q``) allowed by the tile rule
    (multiples of ``q_multiple`` / ``kv_multiple``, or the whole shard) whose ``estimate`` fits; None if
    none does (the caller then falls back to ``default_block`` and its call fails by name)."""
    return largest_fitting(chip_, estimate, candidate_blocks(sq, multiple=q_multiple, top=top if q_top is None else q_top),
                           candidate_blocks(sk, multiple=kv_multiple, top=top))
