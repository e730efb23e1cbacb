"""Tile geometry shared by the Pallas per-hop kernels: masks, tile skipping, argument checks.

Mirrors `ringattn_fast.masks` (and `ringattn_ref.masks`) for the kernels' needs. Every mask is
built from the tokens' *true* positions, so it is exact for any layout (contiguous, striped,
zigzag, an explicit permutation); see docs/design.md, "Shared semantics".

A ``block_q x block_kv`` tile is skipped when its mask is provably empty from the min/max of the
tile's positions and segment ids (docs/design.md, "Skipping"). `tile_bounds` computes those
min/max outside the kernel, `tile_visible` is the predicate each kernel evaluates before computing
a tile, and `tile_schedule` evaluates the same predicate for all tiles at once (for tests, cost
models and figures).
"""
import jax
import jax.numpy as jnp

from ringattn_fast.mesh import vary_like, varying_axes

NEG_INF = float("-inf")


def tile_bounds(pos, seg, block):
    """Per-tile (pos_min, pos_max, seg_min, seg_max): int32 [batch, n_tiles, 4].

    pos: int32 [batch, seq]; seg: int32 [batch, seq] or None (then the segment range is (0, 0)).
    """
    b, s = pos.shape
    n = s // block
    pos_t = pos.astype(jnp.int32).reshape(b, n, block)  # (b, n, block)
    seg_t = jnp.zeros_like(pos_t) if seg is None else seg.astype(jnp.int32).reshape(b, n, block)
    return jnp.stack([pos_t.min(-1), pos_t.max(-1), seg_t.min(-1), seg_t.max(-1)], axis=-1)


def tile_visible(q_lo, q_hi, k_lo, k_hi, qs_lo, qs_hi, ks_lo, ks_hi, *, causal, window):
    """True unless the tile's mask is provably empty (works on scalars or broadcast arrays).

    causal: empty when every key is after every query, ``max q_pos < min k_pos``;
    window (left, right): empty when ``min k_pos > max q_pos + right`` or ``max k_pos < min q_pos - left``;
    segments: empty when the segment-id ranges do not overlap.
    """
    visible = (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
    if causal:
        visible = visible & (k_lo <= q_hi)
    if window is not None:
        left, right = window
        if right >= 0:
            visible = visible & (k_lo <= q_hi + right)
        if left >= 0:
            visible = visible & (k_hi >= q_lo - left)
    return visible


def tile_schedule(q_pos, k_pos, q_seg=None, k_seg=None, *, causal, window, block_q, block_kv):
    """bool [batch, sq // block_q, sk // block_kv]: which tiles the kernels compute.

    The same predicate (`tile_visible` on `tile_bounds`) the kernels evaluate per tile; heads do
    not change it. With 4 contiguous tokens per host, causal, block 2: q_pos = [0..3],
    k_pos = [4..7] gives all False (a future K/V shard), k_pos = [0..3] gives [[T, F], [T, T]].
    """
    qb = tile_bounds(q_pos, q_seg, block_q)[:, :, None, :]  # (b, nq, 1, 4)
    kb = tile_bounds(k_pos, k_seg, block_kv)[:, None, :, :]  # (b, 1, nk, 4)
    return tile_visible(qb[..., 0], qb[..., 1], kb[..., 0], kb[..., 1],
                        qb[..., 2], qb[..., 3], kb[..., 2], kb[..., 3], causal=causal, window=window)


def tile_mask(q_pos, k_pos, q_seg, k_seg, *, causal, window):
    """bool [block_q, block_kv]: query i may see key j (docs/design.md "Mask").

    q_pos, q_seg: [block_q, 1] columns; k_pos, k_seg: [1, block_kv] rows; segments may be None.
    """
    mask = jnp.ones((q_pos.shape[0], k_pos.shape[1]), dtype=jnp.bool_)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if window is not None:
        left, right = window
        if left >= 0:
            mask = mask & (k_pos >= q_pos - left)
        if right >= 0:
            mask = mask & (k_pos <= q_pos + right)
    if q_seg is not None:
        mask = mask & (q_seg == k_seg)
    return mask


def same_vma(*xs):
    """Cast the (non-None) arrays to vary over the union of their mesh axes (no-op outside shard_map).

    A pallas_call under ``shard_map(check_vma=True)`` needs its inputs to agree and its outputs typed
    (`out_struct`); e.g. positions computed from ``axis_index`` vary over the ring axis, q may not yet.
    """
    return vary_like(xs, varying_axes(*xs))


def out_struct(shape, dtype, like):
    """A pallas_call output type that varies over the same mesh axes as ``like`` (see `same_vma`)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def check_hop_args(name, q, k, v, q_pos, k_pos, q_seg, k_seg, bias, window, block_q, block_kv):
    """Validate a per-hop call; returns (block_q, block_kv, group) with blocks clamped to the shard.

    Raises ValueError naming the argument, what was received and what is needed.
    """
    if bias is not None:
        raise ValueError(f"{name}: bias is not supported by the Pallas kernels (got bias of shape "
                         f"{getattr(bias, 'shape', None)}); use impl='xla' for attention with bias")
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{name}: q must be [batch, seq, heads, dim] and k, v [batch, seq, kv_heads, dim] "
                         f"with k.shape == v.shape; got q {q.shape}, k {k.shape}, v {v.shape}")
    b, sq, h, d = q.shape
    _, sk, hk, dk = k.shape
    if k.shape[0] != b or dk != d or h % hk:
        raise ValueError(f"{name}: k/v must share batch and dim with q and kv_heads must divide heads; "
                         f"got q {q.shape}, k {k.shape}")
    if q_pos.shape != (b, sq) or k_pos.shape != (b, sk):
        raise ValueError(f"{name}: q_pos must be [batch, sq] = {(b, sq)} and k_pos [batch, sk] = {(b, sk)}; "
                         f"got q_pos {q_pos.shape}, k_pos {k_pos.shape}")
    if (q_seg is None) != (k_seg is None):
        raise ValueError(f"{name}: q_seg and k_seg must both be given or both be None")
    if q_seg is not None and (q_seg.shape != (b, sq) or k_seg.shape != (b, sk)):
        raise ValueError(f"{name}: q_seg must be [batch, sq] = {(b, sq)} and k_seg [batch, sk] = {(b, sk)}; "
                         f"got {q_seg.shape}, {k_seg.shape}")
    if window is not None and (len(window) != 2 or min(window) < -1):
        raise ValueError(f"{name}: window must be None or (left, right) with -1 for unbounded; got {window}")
    block_q, block_kv = min(block_q or 128, sq), min(block_kv or 128, sk)
    if sq % block_q or sk % block_kv:
        raise ValueError(f"{name}: block_q must divide sq and block_kv must divide sk; got block_q={block_q}, "
                         f"sq={sq}, block_kv={block_kv}, sk={sk}")
    return block_q, block_kv, h // hk


def check_bwd_args(name, q, do, lse, delta):
    """hop_bwd's extra inputs: do shaped like q, lse and delta [b, h, sq]."""
    if do.shape != q.shape or lse.shape != (q.shape[0], q.shape[2], q.shape[1]) or delta.shape != lse.shape:
        raise ValueError(f"{name}: do must be shaped like q {q.shape} and lse, delta [b, h, sq]; "
                         f"got do {do.shape}, lse {lse.shape}, delta {delta.shape}")
