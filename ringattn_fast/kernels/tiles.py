"""What the three Pallas kernels share: tile bounds and schedules, non-finite keys, checks, interpret mode.

Masks come from ``ringattn_fast.masks`` (the vocabulary of ``ringattn_ref.masks``): a kernel calls
`bounds_empty` on the min/max of a tile's positions and segment ids (computed in the kernel, or
computed here by `tile_bounds` and scalar-prefetched) to skip it, and `allowed` on a column of query
positions against a row of key positions for the tile's mask. Both use differences of positions only,
so int32 positions in ``[0, 2**31)`` never overflow. `tile_schedule` evaluates the skip test for all
tiles at once (tests, cost models, figures, and the fused kernel's SMEM tables).

Non-finite keys (docs/design.md): the kernels take K/V as the ring hands them, marked once per ring
by ``masks.mark_bad_keys`` (a key whose K or V holds a nan/inf gets V = 0 and an all-NaN K). The mask
then turns such a key's logits into -inf for every query that may not see it and NaN for those that
may, so a masked key contributes nothing and exactly the rows that see it are NaN, whatever the
tiling. What is left to the kernels (``masks.finite_part``, ``masks.masked_grad``, shared with the XLA
hop): dQ multiplies dS with the finite part of K (a masked key's NaN K meets dS = 0 there), and dS is
zeroed with ``where`` where P is 0 (never ``0 * nan``).
"""
import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.masks import bounds_empty
from ringattn_fast.mesh import vary_like, varying_axes

NEG_INF = float("-inf")
KERNEL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_RUNS_ON = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",), "pallas_tpu_fused": ("tpu",)}
_ELSEWHERE = {"pallas_gpu": "impl='pallas_tpu' or 'xla'", "pallas_tpu": "impl='pallas_gpu' or 'xla'",
              "pallas_tpu_fused": "impl='pallas_gpu' or 'xla'"}


# ---------------------------------------------------------------- tiles and schedules

def tile_bounds(pos, seg, block):
    """Per-tile (pos_min, pos_max, seg_min, seg_max): int32 [batch, n_tiles, 4].

    pos: int32 [batch, seq]; seg: int32 [batch, seq] or None (then the segment range is (0, 0)).
    """
    b, s = pos.shape
    n = s // block
    pos_t = pos.astype(jnp.int32).reshape(b, n, block)  # (b, n, block)
    seg_t = jnp.zeros_like(pos_t) if seg is None else seg.astype(jnp.int32).reshape(b, n, block)
    return jnp.stack([pos_t.min(-1), pos_t.max(-1), seg_t.min(-1), seg_t.max(-1)], axis=-1)


def bounds_skip(qb, kb, *, causal, window, segments):
    """`bounds_empty` on two `tile_bounds` rows ``(lo, hi, seg_lo, seg_hi)`` (scalars or arrays).

    None when nothing can be masked (the kernels then emit no skip test at all).
    """
    seg = (qb[2], qb[3], kb[2], kb[3]) if segments else ()
    return bounds_empty(qb[0], qb[1], kb[0], kb[1], *seg, causal=causal, window=window)


def tile_schedule(q_pos, k_pos, q_seg=None, k_seg=None, *, causal, window, block_q, block_kv):
    """bool [batch, sq // block_q, sk // block_kv]: which tiles the kernels compute.

    The kernels' own test (`bounds_empty` on `tile_bounds`); heads do not change it. With 4
    contiguous tokens per host, causal, block 2: q_pos = [0..3], k_pos = [4..7] gives all False (a
    future K/V shard), k_pos = [0..3] gives [[T, F], [T, T]].
    """
    qb = tile_bounds(q_pos, q_seg, block_q)[:, :, None, :]  # (b, nq, 1, 4)
    kb = tile_bounds(k_pos, k_seg, block_kv)[:, None, :, :]  # (b, 1, nk, 4)
    empty = bounds_skip(jnp.moveaxis(qb, -1, 0), jnp.moveaxis(kb, -1, 0), causal=causal, window=window,
                        segments=q_seg is not None)
    shape = (q_pos.shape[0], qb.shape[1], kb.shape[2])
    return jnp.ones(shape, bool) if empty is None else ~jnp.broadcast_to(empty, shape)


def resident_blocks(schedule):
    """int32 like ``schedule [..., n]``: the block to hold at each step of the last (inner) axis.

    A visible step holds its own block; a skipped step keeps the block of the last visible step
    before it (or, before the first visible one, that one), so a pipelined kernel whose index map
    reads this table issues no DMA for a skipped tile (JAX's TPU flash / splash kernels do the same).
    Example: visible [F, T, F, F, T, F] -> [1, 1, 1, 1, 4, 4]; no visible step -> all 0.
    """
    n = schedule.shape[-1]
    steps = jnp.arange(n, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(schedule, steps, -1), axis=schedule.ndim - 1)
    first = jnp.argmax(schedule, axis=-1).astype(jnp.int32)[..., None]  # 0 when none is visible
    return jnp.where(last >= 0, last, first).astype(jnp.int32)


# ---------------------------------------------------------------- checks and interpret mode

def interpret_mode(impl):
    """What ``pallas_call(interpret=...)`` needs for ``impl`` on the default backend.

    pallas_gpu: True on CPU (Triton interpreter), False on a GPU. pallas_tpu, pallas_tpu_fused: the
    TPU interpreter with race detection on CPU, False on a TPU. ValueError anywhere else.
    """
    backend = jax.default_backend()
    if backend == "cpu":
        return True if impl == "pallas_gpu" else pltpu.InterpretParams(detect_races=True)
    if backend in _RUNS_ON[impl]:
        return False
    raise ValueError(f"impl={impl!r} needs {'a GPU' if impl == 'pallas_gpu' else 'a TPU'} (or CPU, "
                     f"interpreted); the default backend is {backend!r}: use {_ELSEWHERE[impl]} there")


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


def check_hop_args(impl, qs, kv, cfg):
    """Validate a kernel call on (QShard, KVShard, HopConfig); returns ``cfg`` with the blocks clamped
    to the shard and ``scale=None`` resolved to ``dim ** -0.5``.

    Raises ValueError naming the impl, the argument, what was received and what is needed.
    """
    q, k, v = qs.q, kv.k, kv.v
    if kv.bias is not None:
        raise ValueError(f"impl={impl!r}: the Pallas kernels take no bias; use impl='xla' (got bias of "
                         f"shape {getattr(kv.bias, 'shape', None)})")
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"impl={impl!r}: q must be [batch, seq, heads, dim] and k, v [batch, seq, kv_heads, "
                         f"dim] with k.shape == v.shape; got q {q.shape}, k {k.shape}, v {v.shape}")
    check_kernel_dtypes(impl, q, k, v)
    b, sq, h, d = q.shape
    _, sk, hk, dk = k.shape
    if k.shape[0] != b or dk != d or h % hk:
        raise ValueError(f"impl={impl!r}: k/v must share batch and dim with q and kv_heads must divide "
                         f"heads; got q {q.shape}, k {k.shape}")
    if qs.pos.shape != (b, sq) or kv.pos.shape != (b, sk):
        raise ValueError(f"impl={impl!r}: q positions must be [batch, sq] = {(b, sq)} and k positions "
                         f"[batch, sk] = {(b, sk)}; got {qs.pos.shape}, {kv.pos.shape}")
    if (qs.seg is None) != (kv.seg is None):
        raise ValueError(f"impl={impl!r}: q and k segment ids must both be given or both be None")
    if qs.seg is not None and (qs.seg.shape != (b, sq) or kv.seg.shape != (b, sk)):
        raise ValueError(f"impl={impl!r}: segment ids must be [batch, sq] = {(b, sq)} and [batch, sk] = "
                         f"{(b, sk)}; got {qs.seg.shape}, {kv.seg.shape}")
    if cfg.window is not None and (len(cfg.window) != 2 or min(cfg.window) < -1):
        raise ValueError(f"impl={impl!r}: window must be None or (left, right) with -1 for unbounded; "
                         f"got {cfg.window}")
    block_q, block_kv = min(cfg.block_q or 128, sq), min(cfg.block_kv or 128, sk)
    if sq % block_q or sk % block_kv:
        raise ValueError(f"impl={impl!r}: block_q must divide sq and block_kv must divide sk; got "
                         f"block_q={block_q}, sq={sq}, block_kv={block_kv}, sk={sk}")
    scale = d ** -0.5 if cfg.scale is None else float(cfg.scale)
    window = None if cfg.window is None else tuple(int(w) for w in cfg.window)
    return dataclasses.replace(cfg, scale=scale, causal=bool(cfg.causal), window=window,
                               block_q=block_q, block_kv=block_kv)


def check_bwd_args(impl, q, do, lse, delta):
    """hop_bwd's extra inputs: do shaped like q, lse and delta [b, h, sq]."""
    if do.shape != q.shape or lse.shape != (q.shape[0], q.shape[2], q.shape[1]) or delta.shape != lse.shape:
        raise ValueError(f"impl={impl!r}: do must be shaped like q {q.shape} and lse, delta [b, h, sq]; "
                         f"got do {do.shape}, lse {lse.shape}, delta {delta.shape}")


# ---------------------------------------------------------------- shard_map(check_vma=True) typing

def same_vma(*xs):
    """Cast the (non-None) arrays to vary over the union of their mesh axes (no-op outside shard_map).

    A pallas_call under ``shard_map(check_vma=True)`` needs its inputs to agree and its outputs typed
    (`out_struct`); e.g. positions computed from ``axis_index`` vary over the ring axis, q may not yet.
    """
    return vary_like(xs, varying_axes(*xs))


def out_struct(shape, dtype, like):
    """A pallas_call output type that varies over the same mesh axes as ``like`` (see `same_vma`)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)
