"""One ring hop as FlashAttention-2 kernels on Pallas Mosaic TPU (TPU; interpreted on CPU).

Same contract as `pallas_gpu` and ``kernels/xla.py`` (docs/design.md, "Per-hop contract"):
``hop_fwd(QShard, KVShard, HopConfig) -> (o, lse)``, ``hop_bwd(...) -> HopGrads``.

Notation: FlashAttention-2 (Dao 2023, arXiv:2307.08691) -> code

- Br, Bc: cfg.block_q, cfg.block_kv.
- loops: both are grid axes: ``(batch, heads, sq // block_q, sk // block_kv)``; the K/V axis is
  last and "arbitrary", so Mosaic runs it in order and the running statistics live in VMEM scratch
  across it (``m_sc``, ``l_sc``, ``acc_sc``).
- skipping: the tiles' position/segment min/max are computed outside (`tiles.tile_bounds`) and
  scalar-prefetched into SMEM (``PrefetchScalarGridSpec``); ``masks.bounds_empty`` on them decides
  ``pl.when`` around a tile's compute (`_unless_empty`). A third SMEM table (`tiles.resident_blocks`)
  feeds the index maps: a skipped tile keeps the block of the last computed one, so it costs no DMA
  either (JAX's flash / splash kernels' trick). Every hop runs on every host: an empty hop is a grid
  of skipped tiles.
- S_ij, m, l, O: as in FA-2 Alg. 1: ``s = scale * q @ k.T``, soft-capped, ``score_fn`` and
  ``mask_fn`` applied as in `pallas_gpu` (`tiles.programmed`), -inf where ``masks.allowed`` is False,
  ``m`` row max, ``l`` row sum of exp(s - m), ``acc`` = unnormalised O (divided by l at the
  end). K/V tiles are marked by ``masks.mark_bad_keys``'s rule in VMEM (see "bad keys" below).
- L_i, D_i: ``lse = m + log l`` (-inf for a row that saw nothing); ``delta = rowsum(dO * O)``.
- backward: Alg. 2 as one fused kernel where it applies (`_bwd_fused_kernel`: no program, lse as rows,
  the kv head's whole dK/dV fit VMEM; 5 matmuls a tile), else as two kernels: dQ (grid over Q tiles,
  K/V tiles last) and dK/dV (grid over K/V tiles, then the GQA group's heads and the Q tiles last, so
  dK/dV are summed over the group in VMEM scratch without atomics; key-major where it applies,
  `_dkv_key_major_kernel`). Each has its own default tiles (:data:`TUNED`, measured on a v5e;
  ``HopConfig.bwd_blocks``). ``group`` is the GQA group size, ``kv_head`` a kv head's index and
  ``member`` a query head's place in its group (query head ``kv_head * group + member``).
- sub-tiles: a partial tile of the forward and of the fused backward runs as :data:`SPLIT` x :data:`SPLIT`
  sub-tiles, each skipped, unmasked or masked by its own prefetched bounds (`_sub_tiles`): on the diagonal
  of a causal hop a quarter of the tile is skipped (splash attention's compute sub-blocks do this along
  the keys).
- chunks: a tile that is not split runs as row chunks in the forward and key chunks in the fused backward
  (:data:`FWD_ROW_CHUNK`, :data:`BWD_KEY_CHUNK`, `_chunks`): the same sums in another order, which Mosaic
  schedules better on a v5e (2-4 % off the forward+backward).
- bad keys: the ring hands these kernels K/V unmarked (``Impl.marks_keys``); a flag per K/V tile
  (`_bad_tiles`) tells the kernel that loads it to mark it in VMEM (`_mark_tile`), as
  ``masks.mark_bad_keys`` would have in HBM.
- count: ``fwd_tile_counts``: the forward with ``count=True`` adds an SMEM counter per (batch,
  head, Q tile), incremented inside ``pl.when``; otherwise that ref is None.

Refs are named and fixed: absent segment ids (and the counter) are ``None`` refs with a ``None``
BlockSpec, as in ``jax/experimental/pallas/ops/tpu/flash_attention.py``.

TPU tiling. Mosaic tiles the last two dims of every block in (8 sublanes x 128 lanes), so:

* q, k, v, do and the outputs are viewed ``[b, s, h * d]`` when d and d_v are multiples of 128, a
  block being one head's (block_q, d) slice (`_direct`); otherwise they are given heads-major,
  ``[b, h, s, d]`` (one transpose outside), a block being (block_q, d) with d the full last dim (v,
  o and dO: d_v, which may differ from q's d). On a TPU either is one relayout copy of each
  operand (the tiled layout of ``[b, s, h, d]`` is neither's), unless XLA can produce the operand
  in that layout (q from a projection in the same program);
* per-row statistics live in VMEM as lane-replicated ``(block_q, 128)`` columns (m, l); in HBM lse
  and delta are lane-dense rows ``[b, h, 1, s]`` (a (1, block_q) block, read as a column with a
  relayout, as splash attention's backward does) when block_q is a multiple of 128, else
  lane-replicated ``[b, h, s, 128]`` (`_stat_rows`); positions and segment ids alike: ``[b, 1, s]``
  rows, read as columns with the same relayout where a tile needs them so (queries of a q-major tile,
  keys of a key-major one; partial tiles only), query columns lane-replicated ``[b, s, 128]`` where
  the statistics are (`_positions`);
* on a TPU block_q must be a multiple of 8 and block_kv a multiple of 128, unless the block is
  the whole shard (a block equal to the full dim is always legal).

Skipping and masking, per tile, from the prefetched bounds: an empty tile is skipped, a full one
(`masks.bounds_full`: every pair visible) runs without computing a mask, and only a partial tile
(on the diagonal of a causal hop, a window's or a segment's edge) pays for it (splash attention's
mask info does the same). Outputs are float32, or ``cfg.out_dtype`` when the ring has one hop.

Rule for small test shapes: in interpret mode (CPU) block_kv may also be a multiple of 8, so a
64-token test shard still has several K/V tiles to skip; the kernels are otherwise unchanged.

Inputs: float16, bfloat16 or float32, one dtype for q, k, v; compute in float32; outputs in float32
or ``cfg.out_dtype`` (`ringattn_ref.shards.HopConfig`).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import budgets
from ringattn_fast.kernels.tiles import (NEG_INF, Budget, by_kind, const_specs, empty_tiles, finite_keys, hop_kernels,
                                         out_struct, program, programmed, resident_blocks, same_vma, sub_tiles,
                                         target_chip, tile_bounds)
from ringattn_fast.masks import allowed, masked_grad
from ringattn_fast.schedule import HopConfig

__all__ = ["hop_fwd", "hop_bwd", "fwd_tile_counts", "default_blocks", "footprints"]

IMPL = "pallas_tpu"
LANES, SUBLANES = 128, 8
_STATIC = ("cfg", "interpret", "vmem_limit")
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
# Two forms that take VPU work out of every logit. In the deviceless compile for a v5e (8K tokens, 8 heads,
# d = 128, bf16, non-causal; `benchmarks/schedule_tpu.py`) the fused backward's 1024 x 1024 tile drops from
# 10517 to 9644 bundles with both (splash attention's: 9133): a TPU's exp is exp2 of a product (vexp2 after a
# vmul), so base-2 logits save a multiply a logit (278 bundles), and no where on full tiles a compare, mask
# ops, a select and a reload of P (512). Timed on a v5e (2026-12-07, `tpu_checks --checks variants`, 8K and
# 16K, causal and not, fwd+bwd, interleaved): no where 0.1-0.8 % faster than with it and the same outputs
# to the bit, so it ships; base 2 on top took -1.2 % to +0.1 %, and float32 at the TPU's default precision
# then ran 1.4-1.8x further from the reference (plain: dq 0.0032, dk 0.0031 against 0.0022, 0.0017; jax.nn's
# 0.0013, 0.0018), so it stays opt-in. Bundles are not cycles (docs/benchmarks.md, "Seventh chip session").
EXP2 = False  # logits in base 2 where no program applies (`_base2`)
FULL_TILE_WHERE = False  # dS zeroed where P is 0 on full tiles too, not only on masked ones (`key_major_grads`)


def _base2(prog):
    """Whether a kernel's logits are in base 2: the pre-scaled operand carries log2(e) too, so P = exp2(S' - L')
    with no multiply per logit (a TPU's exp is exp2 of a product). Not under a program: its score_fn, soft-cap
    and pullbacks see the logits in natural units. The statistics leave the kernels in natural units."""
    return EXP2 and prog is None


def _logit_scale(cfg, base2):
    """What the pre-scaled operand (`_scaled`) is multiplied by: the softmax scale, times log2(e) in base 2."""
    return cfg.scale * LOG2E if base2 else cfg.scale


def _tile_rule(cfg, sq, sk, interpret):
    """Mosaic's tile rule (interpreted: block_kv a multiple of 8 is enough, see above)."""
    lane = SUBLANES if interpret else LANES
    if (cfg.block_q != sq and cfg.block_q % SUBLANES) or (cfg.block_kv != sk and cfg.block_kv % lane):
        raise ValueError(f"impl={IMPL!r}: TPU tiles need block_q % {SUBLANES} == 0 (or block_q == sq) and "
                         f"block_kv % {lane} == 0 (or block_kv == sk); got block_q={cfg.block_q}, sq={sq}, "
                         f"block_kv={cfg.block_kv}, sk={sk}")


def _direct(d, d_v):
    """True when the kernels read and write ``[b, s, h, d]`` viewed ``[b, s, h * d]``: a block of one head
    is then (rows, d), Mosaic-legal when d and d_v are multiples of 128; else heads-major."""
    return d % LANES == 0 and d_v % LANES == 0


def _view(x, direct):
    """[b, s, h, w] -> the kernels' operand: ``[b, s, h * w]`` or ``[b, h, s, w]`` (on a TPU each a relayout)."""
    b, s, h, w = x.shape
    return x.reshape(b, s, h * w) if direct else x.swapaxes(1, 2)


def _unview(y, heads, direct):
    """Inverse of `_view` for an output of ``heads`` heads: [b, s, h, w]."""
    if direct:
        b, s, hw = y.shape
        return y.reshape(b, s, heads, hw // heads)
    return y.swapaxes(1, 2)


def _stat_rows(cfg):
    """lse / delta in HBM as rows ``[b, h, 1, s]`` (True: block_q a multiple of 128, Mosaic's lane rule for a
    (1, block_q) block) or lane-replicated ``[b, h, s, 128]`` columns, 128x the bytes (False)."""
    return cfg.block_q % LANES == 0


def _stats_in(x, rows):
    """float32 [b, h, s] statistics as the backward kernels read them (`_stat_rows`)."""
    b, h, s = x.shape
    x = x.astype(jnp.float32)
    return x[:, :, None, :] if rows else jnp.broadcast_to(x[..., None], (b, h, s, LANES))


def _column(ref, rows, part=slice(None)):
    """A statistic's (block_q, 1) column in a kernel, from its (1, block_q) row or (block_q, 128) block; ``part``:
    the rows of a sub-tile only (`_sub_tiles`)."""
    return jnp.expand_dims(ref[0, part], -1) if rows else ref[part, :1]


def _out_dtype(cfg):
    return jnp.float32 if cfg.out_dtype is None else jnp.dtype(cfg.out_dtype)


def _prefetch(qs, kv, cfg, *, transposed=False, split=1):
    """Scalar-prefetch tables (flat int32): Q and K/V tile bounds ``[b * n * 4]`` (`tiles.tile_bounds`), the
    resident block of the inner grid axis per step (`tiles.resident_blocks`; K/V tiles per Q tile, or with
    ``transposed`` Q tiles per K/V tile, for the dK/dV kernel), which K/V tiles hold a bad key
    (`_bad_tiles`), and the bounds of the Q and K/V sub-tiles of sides block / ``split`` (`_sub_tiles`)."""
    empty = empty_tiles(qs.pos, kv.pos, qs.seg, kv.seg, causal=cfg.causal, window=cfg.window,
                        block_q=cfg.block_q, block_kv=cfg.block_kv)  # (b, nq, nk)
    resident = resident_blocks(empty.swapaxes(1, 2) if transposed else empty)
    return [tile_bounds(qs.pos, qs.seg, cfg.block_q).reshape(-1),
            tile_bounds(kv.pos, kv.seg, cfg.block_kv).reshape(-1), resident.reshape(-1), _bad_tiles(kv, cfg.block_kv),
            tile_bounds(qs.pos, qs.seg, cfg.block_q // split).reshape(-1),
            tile_bounds(kv.pos, kv.seg, cfg.block_kv // split).reshape(-1)]


N_PREFETCH = 6  # the scalar-prefetch tables of every kernel here: (qb, kb, res, bad, qsb, ksb), `_prefetch`


def _prefetch_smem(b, n_q, n_kv):
    """SMEM bytes of `_prefetch`'s int32 tables: tile and sub-tile bounds, bad K/V tiles, resident blocks."""
    return 4 * (b * n_q * 4 * (1 + SPLIT) + b * n_kv * (5 + 4 * SPLIT) + b * n_q * n_kv)


def _resident(res, bi, outer, inner, n_outer, n_inner):
    """The inner-axis block that grid step (outer, inner) of batch row ``bi`` holds, from the `_prefetch` table
    ``res`` (`tiles.resident_blocks`): ``inner``, or the last computed block when ``inner`` is skipped."""
    return res[(bi * n_outer + outer) * n_inner + inner]


# A partial tile (the diagonal of a causal hop, a window's or a segment's edge) of the forward and of the fused
# backward runs as SPLIT x SPLIT sub-tiles (`_sub_tiles`, `_split`; 1: whole).
SPLIT = 2


# The forward computes a tile as row chunks of FWD_ROW_CHUNK queries, the fused backward as key chunks of
# BWD_KEY_CHUNK keys, each chunk a whole FA-2 step of its own (`_chunks`; 0: the tile whole). The arithmetic is
# the tile's, in another order; what changes is the program Mosaic schedules: on a v5e (JAX 0.10.2,
# 2026-12-07, `tpu_checks --checks variants`, 8 heads, d = 128, bf16, forward+backward of the default call,
# compiled ahead and timed interleaved) 512-query chunks of the forward's 2048 x 2048 tile and 256-key chunks
# of the backward's 1024 x 1024 one took 2.1-4.2 % off the call at 8K and 16K tokens, causal or not (the
# backward's chunks 1.8-3.0 % alone, the forward's 0.3-1.7 %; 512-key chunks 0.1-0.8 % alone, 128-key ones
# with the forward's chunks no more than those alone; 1024-row chunks as 512). In the static schedule
# (`benchmarks/schedule_tpu.py`, 8K) the forward's tile drops from 18343 to 17774 bundles (fewer stores:
# each chunk's logits are a quarter of the tile's) and the backward's from 10005 to 9540.
FWD_ROW_CHUNK = 512
BWD_KEY_CHUNK = 256


def _chunks(size, chunk):
    """Static slices of ``size`` rows in runs of ``chunk`` (`FWD_ROW_CHUNK`, `BWD_KEY_CHUNK`); the whole as one
    where ``chunk`` is 0, not smaller than ``size`` or does not divide it."""
    if not chunk or chunk >= size or size % chunk:
        return [slice(None)]
    return [slice(start, start + chunk) for start in range(0, size, chunk)]


def _split(cfg, prog, interpret):
    """:data:`SPLIT` where it applies, else 1: no program (its tables are per tile), lse as rows (a sub-tile's
    statistics and query positions are lane slices of them), and sub-tile sides that keep Mosaic's tile rule
    (multiples of 128; interpreted, of 8)."""
    side = SUBLANES if interpret else LANES
    ok = SPLIT > 1 and prog is None and _stat_rows(cfg) and all(
        block % SPLIT == 0 and (block // SPLIT) % side == 0 for block in (cfg.block_q, cfg.block_kv))
    return SPLIT if ok else 1


def _bad_tiles(kv, block_kv):
    """int32 ``[b * n_kv]``: 1 where K/V tile j of batch row b holds a nan/inf in its K or V (any head), else
    0; 1 also where the tile's finite sum overflows (such a tile is marked for nothing: `_mark_tile` tests
    each key exactly). Such a tile is marked in VMEM by the kernel that loads it (`_mark_tile`), so the ring
    hands these kernels K/V as given (``Impl.marks_keys``): marked in HBM (``masks.mark_bad_keys``), K and V
    were copied once more, and the copies lived from the forward to the backward (32 of the 105 MiB of temp
    of a 16K-token causal forward+backward on a v5e, 64 of 320 at 32K; JAX 0.10.2, 8 heads, d = 128, bf16;
    `tests/_tpu_compile.py memory`).

    K and V are summed over keys first, in runs of :data:`LANES` (or fewer) keys: adds of whole vectors, one
    pass over each, the same runs whatever the tile (the forward's and the backward's tiles differ; XLA
    computes them once). Summed over d first (``masks.bad_key_sums``, one value a key), the cross-lane sums
    took 56 us for each of K and V on a v5e (8K tokens, 8 heads, d = 128, JAX 0.10.2), these runs 11 us; the
    default call's forward+backward, timed interleaved against that form: 0.2-1.7 % faster at 8K and 16K
    tokens, the same outputs to the bit."""
    b, sk = kv.k.shape[:2]
    run = math.gcd(block_kv, LANES)
    runs = lambda x: jnp.sum(x.reshape(b, sk // run, run, *x.shape[2:]), axis=2, dtype=jnp.float32)  # noqa: E731
    k_runs, v_runs = lax.optimization_barrier((runs(kv.k), runs(kv.v)))  # else XLA sums over d first again
    per_run = k_runs.reshape(b, sk // run, -1).sum(-1) + v_runs.reshape(b, sk // run, -1).sum(-1)
    per_tile = per_run.reshape(b, sk // block_kv, -1).sum(-1)  # (b, n_kv): inf or NaN where flagged
    return (~jnp.isfinite(per_tile)).astype(jnp.int32).reshape(-1)


def _mark_tile(flag, k_ref, v_ref):
    """``masks.mark_bad_keys`` on the K/V tile in VMEM, in place, where ``flag`` (the tile's `_bad_tiles`
    entry) is set: K all-NaN and V 0 for each key whose row holds a nan/inf. A no-op on a marked tile, so a
    block the pipeline keeps for the next grid step may be marked again."""
    @pl.when(flag != 0)
    def _mark():
        k, v = k_ref[...], v_ref[...]  # (block_kv, d), (block_kv, d_v)
        zero_sum = lambda x: jnp.sum(x.astype(jnp.float32) * 0.0, axis=1, keepdims=True)  # noqa: E731
        bad = jnp.isnan(zero_sum(k) + zero_sum(v))  # (block_kv, 1)
        k_ref[...] = jnp.where(bad, jnp.nan, k).astype(k.dtype)
        v_ref[...] = jnp.where(bad, 0, v).astype(v.dtype)


def _positions(qs, kv, cfg):
    """The position inputs (q_pos, k_pos, q_seg, k_seg), int32; segments None when absent. Keys as ``(b, 1,
    sk)`` rows; queries as ``(b, 1, sq)`` rows where `_stat_rows` (block_q a multiple of 128, Mosaic's lane
    rule for a (1, block_q) block), else lane-replicated ``(b, sq, 128)`` columns. A kernel that needs a
    column reads it from the row with a relayout (`_column`), on partial tiles only: lane-replicated query
    columns were 8 MiB of HBM temp per 16K tokens, the key columns of the key-major tiles as much."""
    row = lambda x: None if x is None else x.astype(jnp.int32)[:, None, :]  # noqa: E731
    col = lambda x: None if x is None else jnp.broadcast_to(x.astype(jnp.int32)[:, :, None], x.shape + (LANES,))  # noqa: E731
    q_form = row if _stat_rows(cfg) else col
    return [q_form(qs.pos), row(kv.pos), q_form(qs.seg), row(kv.seg)]


def _pos_block(rows, size, at):
    """The BlockSpec of a tile's positions (or segment ids), ``at(*grid, *prefetch) -> (batch, tile)``: a (1,
    size) row of ``(b, 1, s)`` (``rows``) or a (size, 128) block of lane-replicated ``(b, s, 128)`` columns."""
    if rows:
        return pl.BlockSpec((None, 1, size), lambda *a: (lambda bi, t: (bi, 0, t))(*at(*a)))
    return pl.BlockSpec((None, size, LANES), lambda *a: (lambda bi, t: (bi, t, 0))(*at(*a)))


def _bounds(qb_ref, kb_ref, tile, segments):
    """The scalar-prefetched bounds (``(lo, hi[, seg_lo, seg_hi])``) of Q tile i and K/V tile j of batch row bi;
    ``tile``: (bi, i, j, n_q, n_kv)."""
    bi, i, j, n_q, n_kv = tile
    nb = 4 if segments else 2
    return (tuple(qb_ref[(bi * n_q + i) * 4 + c] for c in range(nb)),
            tuple(kb_ref[(bi * n_kv + j) * 4 + c] for c in range(nb)))


def _by_kind(body, qb_ref, kb_ref, tile, cfg, segments):
    """`tiles.by_kind` for tile ``(bi, i, j)`` of the grid: skipped where empty, ``body(False)`` where full,
    ``body(True)`` on a partial tile, from the bounds tables ``qb``, ``kb`` (`_prefetch`)."""
    by_kind(body, *_bounds(qb_ref, kb_ref, tile, segments), causal=cfg.causal, window=cfg.window)


def _sub_tiles(fold, qsb_ref, ksb_ref, tile, sizes, split, cfg, segments):
    """`tiles.sub_tiles` for a partial tile ``(bi, i, j, n_q, n_kv)`` from the sub-tile bounds tables ``qsb``,
    ``ksb`` (`tiles.tile_bounds` at the sub-tile sides); ``sizes``: (block_q, block_kv)."""
    bi, i, j, n_q, n_kv = tile
    sub_tile = lambda r, c: (bi, i * split + r, j * split + c, n_q * split, n_kv * split)  # noqa: E731
    sub_tiles(fold, lambda r, c: _bounds(qsb_ref, ksb_ref, sub_tile(r, c), segments), sizes, split,
              causal=cfg.causal, window=cfg.window)


def _scaled(x, scale):
    """``x * scale`` in float32, back in x's dtype: a Q (or K) tile pre-scaled once, so the (block_q, block_kv)
    logits need no multiply (splash attention asks its caller for a pre-scaled q; here the kernel does it)."""
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


def _logits(q, k, cfg, fn, *, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref, masked=True, grad=False, prescaled=False,
            part=(slice(None), slice(None))):
    """fp32 [block_q, block_kv] ``scale * q k^T``, soft-capped, scored and masked (``fn``: the tile's
    `tiles.Program`, its consts' refs and the query head), -inf where masked (the built-in mask only when
    ``masked``: a full tile needs none); positions from a query column (`_column`) and a (1, block_kv) key
    row. With ``grad``: ``(s, pullback)`` (`tiles.programmed`). ``prescaled``: q is already
    times the scale (`_scaled`). ``part``: (query rows, key columns) of a sub-tile whose q and k these are."""
    s = _dot(q, k, _NT) if prescaled else cfg.scale * _dot(q, k, _NT)
    prog, const_refs, head = fn
    rows, (qp, kp) = _stat_rows(cfg), part
    q_pos, k_pos = _column(q_pos_ref, rows, qp), k_pos_ref[:, kp]  # (block_q, 1), (1, block_kv)
    q_seg, k_seg = (None, None) if q_seg_ref is None else (_column(q_seg_ref, rows, qp), k_seg_ref[:, kp])
    s, pull = programmed(prog, [r[...] for r in const_refs], s, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg,
                         head=head, grad=grad)
    allow = allowed(q_pos, k_pos, q_seg, k_seg, causal=cfg.causal, window=cfg.window) if masked else None
    s = s if allow is None else jnp.where(allow, s, NEG_INF)
    return (s, pull) if grad else s


def _fwd_kernel(qb_ref, kb_ref, res_ref, bad_ref, qsb_ref, ksb_ref,         # SMEM tables
                q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref,        # inputs (segments: None)
                const_refs,                                                 # the program's consts (a tuple)
                o_ref, lse_ref, count_ref,                                  # outputs (count: None)
                m_sc, l_sc, acc_sc, q_sc, *, cfg, prog, n_q, n_kv, rows, split):
    """Grid (batch, head, Q tile i, K/V tile j): fold tile (i, j) into (m, l, acc) (FA-2 Alg. 1); a partial
    tile by its ``split`` x ``split`` sub-tiles (`_sub_tiles`)."""
    bi, hi, i, j = (pl.program_id(a) for a in range(4))
    counter = (bi * pl.num_programs(1) + hi) * n_q + i
    base2 = _base2(prog)  # s, m in base 2: exp2 below, lse back in natural units at the end
    exp = jnp.exp2 if base2 else jnp.exp
    _mark_tile(bad_ref[bi * n_kv + _resident(res_ref, bi, i, j, n_q, n_kv)], k_ref, v_ref)  # the K/V tile loaded

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        q_sc[...] = _scaled(q_ref[...], _logit_scale(cfg, base2))  # once per Q tile
        if count_ref is not None:
            count_ref[counter] = 0

    def _fold(masked, qp=slice(None), kp=slice(None)):  # the tile, or its sub-tile (query rows qp, key rows kp)
        v = v_ref[kp, :]  # (block_kv, d_v)
        s = _logits(q_sc[qp, :], k_ref[kp, :], cfg, (prog, const_refs, hi), q_pos_ref=q_pos_ref,  # (block_q, block_kv)
                    k_pos_ref=k_pos_ref, q_seg_ref=q_seg_ref, k_seg_ref=k_seg_ref, masked=masked, prescaled=True,
                    part=(qp, kp))
        m_prev = m_sc[qp, :]  # (block_q, 128), lane-replicated
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: exp(-inf) = 0
        p = exp(s - m_safe[:, :1])  # masked: exp(-inf) = 0 (a column: 3-5 % faster than jnp.tile on a v5e)
        alpha = exp(m_prev - m_safe)  # rescales the old l and acc to the new max
        l_sc[qp, :] = alpha * l_sc[qp, :] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[qp, :] = m_new
        acc_sc[qp, :] = alpha[:, :1] * acc_sc[qp, :] + _dot(p.astype(v.dtype), v, _NN)

    def _compute(masked):
        if count_ref is not None:
            count_ref[counter] = count_ref[counter] + 1
        if masked and split > 1:
            _sub_tiles(_fold, qsb_ref, ksb_ref, (bi, i, j, n_q, n_kv), (cfg.block_q, cfg.block_kv), split, cfg,
                       q_seg_ref is not None)
        else:  # rows are independent: each chunk folds its own rows, exactly as the whole tile would
            for qp in _chunks(cfg.block_q, FWD_ROW_CHUNK if prog is None else 0):
                _fold(masked, qp=qp)

    _by_kind(_compute, qb_ref, kb_ref, (bi, i, j, n_q, n_kv), cfg, q_seg_ref is not None)

    @pl.when(j == n_kv - 1)
    def _finish():
        l, m = l_sc[...], m_sc[...]
        empty = l == 0.0  # saw nothing (a NaN l stays NaN)
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = jnp.where(empty[:, :1], 0.0, acc_sc[...] / l_safe[:, :1]).astype(o_ref.dtype)
        lse = jnp.where(empty, NEG_INF, (LN2 * m if base2 else m) + jnp.log(l_safe))  # (block_q, 128), lane-replicated
        lse_ref[...] = jnp.transpose(lse)[:1, :] if rows else lse  # a lane-dense (1, block_q) row


def _block(direct, rows, width, at):
    """The BlockSpec of one head's (rows, width) tile; ``at(*grid, *prefetch) -> (batch, head, tile)``, laid
    out [b, s, h * width] (``direct``, `_direct`) or [b, h, s, width]."""
    if direct:
        return pl.BlockSpec((None, rows, width), lambda *a: (lambda bi, hd, t: (bi, t, hd))(*at(*a)))
    return pl.BlockSpec((None, None, rows, width), lambda *a: (lambda bi, hd, t: (bi, hd, t, 0))(*at(*a)))


def _stat_block(rows, bq, at):
    """The BlockSpec of a Q tile's statistics (`_stat_rows`): a (1, bq) row or a (bq, 128) column block."""
    if rows:
        return pl.BlockSpec((None, None, 1, bq), lambda *a: (lambda bi, hd, t: (bi, hd, 0, t))(*at(*a)))
    return pl.BlockSpec((None, None, bq, LANES), lambda *a: (lambda bi, hd, t: (bi, hd, t, 0))(*at(*a)))


def _qmajor_specs(cfg, d, group, n_q, n_kv, d_v=None):
    """BlockSpecs of grid (b, h, i, j) (forward, dQ). Index maps get the grid indices, then the
    scalar-prefetch refs (`_prefetch`); K/V-side blocks read the resident K/V tile from ``res``.
    ``q``, ``kv``: q and k tiles (d wide); ``o``, ``v``: o / dO and v tiles (``d_v`` wide; None: d)."""
    bq, bk, d_v = cfg.block_q, cfg.block_kv, d if d_v is None else d_v
    direct = _direct(d, d_v)
    kv_tile = lambda bi, i, j, res: _resident(res, bi, i, j, n_q, n_kv)  # noqa: E731
    q_at = lambda bi, hi, i, j, *_: (bi, hi, i)
    kv_at = lambda bi, hi, i, j, qb, kb, res, *_: (bi, hi // group, kv_tile(bi, i, j, res))
    return dict(
        q=_block(direct, bq, d, q_at), o=_block(direct, bq, d_v, q_at),
        kv=_block(direct, bk, d, kv_at), v=_block(direct, bk, d_v, kv_at),
        stat=_stat_block(_stat_rows(cfg), bq, q_at),
        q_pos=_pos_block(_stat_rows(cfg), bq, lambda bi, hi, i, j, *_: (bi, i)),
        k_pos=_pos_block(True, bk, lambda bi, hi, i, j, qb, kb, res, *_: (bi, kv_tile(bi, i, j, res))))


def _kvmajor_specs(cfg, d, group, n_q, n_kv, d_v=None):
    """BlockSpecs of grid (b, kv_head, j, member, i) (dK/dV): the Q-side blocks read the resident Q tile
    from ``res``; query head = ``kv_head * group + member``. Widths as in `_qmajor_specs`."""
    bq, bk, d_v = cfg.block_q, cfg.block_kv, d if d_v is None else d_v
    direct = _direct(d, d_v)
    q_tile = lambda bi, j, i, res: _resident(res, bi, j, i, n_kv, n_q)  # noqa: E731
    q_at = lambda bi, kv_head, j, member, i, qb, kb, res, *_: (bi, kv_head * group + member, q_tile(bi, j, i, res))
    kv_at = lambda bi, kv_head, j, member, i, *_: (bi, kv_head, j)
    return dict(
        q=_block(direct, bq, d, q_at), o=_block(direct, bq, d_v, q_at),
        kv=_block(direct, bk, d, kv_at), v=_block(direct, bk, d_v, kv_at),
        stat=_stat_block(_stat_rows(cfg), bq, q_at),
        q_pos=_pos_block(_stat_rows(cfg), bq, lambda bi, kv_head, j, member, i, qb, kb, res, *_:
                         (bi, q_tile(bi, j, i, res))),
        k_pos=_pos_block(True, bk, lambda bi, kv_head, j, member, i, *_: (bi, j)))


def _pos_specs(sp, segments, prog):
    """Specs of (q_pos, k_pos, q_seg, k_seg): None for the absent segment ids; then the tuple of ``prog``'s
    consts (`tiles.const_specs`: each whole, in every grid step)."""
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return ([sp["q_pos"], sp["k_pos"]] + ([sp["q_pos"], sp["k_pos"]] if segments else [None, None])
            + [const_specs(prog, whole)])


def _consts(prog):
    """``prog``'s consts as the kernels' last input (a tuple; () without a program)."""
    return () if prog is None else prog.consts


@functools.partial(jax.jit, static_argnames=_STATIC + ("count",))
def _forward(qs, kv, *, cfg, interpret, count, vmem_limit):
    """pallas_call for the forward; returns (o, lse, computed K/V tiles per Q tile [b, h, nq] or None)."""
    (b, sq, h, d), (sk, hk), d_v = qs.q.shape, kv.k.shape[1:3], kv.v.shape[-1]
    n_q, n_kv, segments = sq // cfg.block_q, sk // cfg.block_kv, qs.seg is not None
    prog, direct, rows = program(cfg, cfg.block_q, cfg.block_kv), _direct(d, d_v), _stat_rows(cfg)
    split = _split(cfg, prog, interpret)
    prefetch, pos = _prefetch(qs, kv, cfg, split=split), _positions(qs, kv, cfg)
    ops = same_vma(*prefetch, *(_view(x, direct) for x in (qs.q, kv.k, kv.v)), *pos, *_consts(prog))
    q, consts = ops[N_PREFETCH], tuple(ops[len(ops) - len(_consts(prog)):])
    sp = _qmajor_specs(cfg, d, h // hk, n_q, n_kv, d_v)
    counter = pl.BlockSpec(memory_space=pltpu.SMEM)  # debug output: one counter per (batch, head, Q tile)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, prog=prog, n_q=n_q, n_kv=n_kv, rows=rows, split=split),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_PREFETCH, grid=(b, h, n_q, n_kv),
            in_specs=[sp["q"], sp["kv"], sp["v"]] + _pos_specs(sp, segments, prog),
            out_specs=[sp["o"], sp["stat"], counter if count else None],
            scratch_shapes=[pltpu.VMEM((cfg.block_q, LANES), jnp.float32),
                            pltpu.VMEM((cfg.block_q, LANES), jnp.float32),
                            pltpu.VMEM((cfg.block_q, d_v), jnp.float32), pltpu.VMEM((cfg.block_q, d), qs.q.dtype)]),
        out_shape=[out_struct((b, sq, h * d_v) if direct else (b, h, sq, d_v), _out_dtype(cfg), q),
                   out_struct((b, h, 1, sq) if rows else (b, h, sq, LANES), jnp.float32, q),
                   out_struct((b * h * n_q,), jnp.int32, q) if count else None],
        compiler_params=pltpu.CompilerParams(  # the shared SMEM counter needs every axis in order
            dimension_semantics=("arbitrary",) * 4 if count else ("parallel",) * 3 + ("arbitrary",),
            vmem_limit_bytes=vmem_limit),
        interpret=interpret, name="ring_hop_fwd_tpu",
    )(*ops[:len(ops) - len(consts)], consts)
    counts = out[2].reshape(b, h, n_q) if count else None
    return _unview(out[0], h, direct), out[1][:, :, 0, :] if rows else out[1][..., 0], counts


def _tile_grads(s, pull, do, v, lse, delta):
    """FA-2 Alg. 2 lines 11-20 for one tile of masked logits: (p, ds), fp32 [block_q, block_kv];
    lse, delta lane-replicated (block_q, 128); ``pull``: the tile program's pullback (`tiles.programmed`)
    to the scaled logits, or None."""
    p = jnp.exp(s - lse[:, :1])  # P_ij = exp(S_ij - L_i), 0 where masked (lse is finite here)
    dp = _dot(do, v, _NT)  # dP_ij = dO_i V_j^T
    ds = masked_grad(p, dp, delta[:, :1])  # dS_ij = P_ij * (dP_ij - D_i)
    return p, ds if pull is None else pull(ds, p)


def _dq_kernel(qb_ref, kb_ref, res_ref, bad_ref, qsb_ref, ksb_ref,
               q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref,
               const_refs, dq_ref, acc_sc, q_sc, *, cfg, prog, n_q, n_kv, rows):
    """Grid (b, h, i, j): dQ_i += scale * dS_ij K_j over the K/V tiles j (in order)."""
    del qsb_ref, ksb_ref  # whole tiles here
    bi, hi, i, j = (pl.program_id(a) for a in range(4))
    _mark_tile(bad_ref[bi * n_kv + _resident(res_ref, bi, i, j, n_q, n_kv)], k_ref, v_ref)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        q_sc[...] = _scaled(q_ref[...], cfg.scale)

    def _compute(masked):
        k = k_ref[...]
        s, pull = _logits(q_sc[...], k, cfg, (prog, const_refs, hi), q_pos_ref=q_pos_ref, k_pos_ref=k_pos_ref,
                          q_seg_ref=q_seg_ref, k_seg_ref=k_seg_ref, masked=masked, grad=True, prescaled=True)
        _, ds = _tile_grads(s, pull, do_ref[...], v_ref[...], _column(lse_ref, rows), _column(delta_ref, rows))
        acc_sc[...] += _dot(ds.astype(k.dtype), finite_keys(k), _NN)  # a masked NaN key stays out

    _by_kind(_compute, qb_ref, kb_ref, (bi, i, j, n_q, n_kv), cfg, q_seg_ref is not None)

    @pl.when(j == n_kv - 1)
    def _finish():
        dq_ref[...] = (cfg.scale * acc_sc[...]).astype(dq_ref.dtype)  # dQ = scale dS K


def _dkv_kernel(qb_ref, kb_ref, res_ref, bad_ref, qsb_ref, ksb_ref,
                q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref,
                const_refs, dk_ref, dv_ref, dk_sc, dv_sc, *, cfg, prog, n_q, n_kv, group, rows):
    """Grid (b, kv_head, j, member, i): dK_j, dV_j summed over the group's heads and the Q tiles i."""
    del res_ref, qsb_ref, ksb_ref
    bi, kv_head, j, member, i = (pl.program_id(a) for a in range(5))
    _mark_tile(bad_ref[bi * n_kv + j], k_ref, v_ref)

    @pl.when((member == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def _compute(masked):
        q, do = q_ref[...], do_ref[...]
        head = kv_head * group + member
        s, pull = _logits(q, k_ref[...], cfg, (prog, const_refs, head), q_pos_ref=q_pos_ref, k_pos_ref=k_pos_ref,
                          q_seg_ref=q_seg_ref, k_seg_ref=k_seg_ref, masked=masked, grad=True)
        p, ds = _tile_grads(s, pull, do, v_ref[...], _column(lse_ref, rows), _column(delta_ref, rows))
        dv_sc[...] += _dot(p.astype(do.dtype), do, _TN)  # dV_j += P_ij^T dO_i
        dk_sc[...] += cfg.scale * _dot(ds.astype(q.dtype), q, _TN)  # dK_j += dS_ij^T Q_i

    _by_kind(_compute, qb_ref, kb_ref, (bi, i, j, n_q, n_kv), cfg, q_seg_ref is not None)

    @pl.when((member == group - 1) & (i == n_q - 1))
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def key_major_grads(k, q, v, do, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref, cfg, masked,
                    part=(slice(None), slice(None)), base2=False):
    """FA-2 Alg. 2 for one key-major tile, shared by `_dkv_key_major_kernel` and `_bwd_fused_kernel`:
    ``(P^T, dS^T)`` float32 (block_kv, block_q) from S^T = K Q^T (q or k pre-scaled), the built-in mask
    from (1, block_q) query rows and key columns read from (1, block_kv) rows (`_column`) when ``masked``, lse
    and delta the (1, block_q) rows they are stored as. ``part``: (query, key) slices of a sub-tile. ``base2``
    (`_base2`): the pre-scaled operand also carries log2(e), lse (natural units) is brought to base 2 per
    row and P^T = exp2(S^T - lse). dS^T is zeroed where P^T is 0 (`masks.masked_grad`) on masked tiles only:
    a full tile's P^T is 0 only by underflow (``FULL_TILE_WHERE`` restores it there)."""
    qp, kp = part
    st = _dot(k, q, _NT)  # (block_kv, block_q), scaled
    if masked:
        seg = (None, None) if q_seg_ref is None else (q_seg_ref[:, qp], _column(k_seg_ref, True, kp))
        st = jnp.where(allowed(q_pos_ref[:, qp], _column(k_pos_ref, True, kp), *seg, causal=cfg.causal,
                               window=cfg.window), st, NEG_INF)
    pt = jnp.exp2(st - LOG2E * lse_ref[:, qp]) if base2 else jnp.exp(st - lse_ref[:, qp])  # P^T
    dpt = _dot(v, do, _NT)  # dP^T = V dO^T
    if masked or FULL_TILE_WHERE:
        return pt, masked_grad(pt, dpt, delta_ref[:, qp])  # dS^T = P^T (dP^T - D)
    return pt, pt * (dpt - delta_ref[:, qp])


def _dkv_key_major_kernel(qb_ref, kb_ref, res_ref, bad_ref, qsb_ref, ksb_ref,
                  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref,
                  const_refs, dk_ref, dv_ref, dk_sc, dv_sc, k_sc, *, cfg, prog, n_q, n_kv, group, rows):
    """`_dkv_kernel` with the tile transposed (splash attention's dK/dV orientation): S^T = K_j Q_i^T is
    (block_kv, block_q), so lse and delta are the lane-dense rows they are stored as, and dV_j += P^T dO,
    dK_j += dS^T Q are plain matmuls (no transpose of a (block_q, block_kv) operand). Positions: query
    rows, key columns (`key_major_grads`). Only without a program and with `_stat_rows`."""
    del res_ref, qsb_ref, ksb_ref, const_refs, prog, rows
    bi, kv_head, j, member, i = (pl.program_id(a) for a in range(5))
    _mark_tile(bad_ref[bi * n_kv + j], k_ref, v_ref)  # before K is scaled into k_sc

    @pl.when((member == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)
        k_sc[...] = _scaled(k_ref[...], _logit_scale(cfg, _base2(None)))  # once per K/V tile

    def _compute(masked):
        q, do = q_ref[...], do_ref[...]
        pt, dst = key_major_grads(k_sc[...], q, v_ref[...], do, lse_ref, delta_ref, q_pos_ref, k_pos_ref,
                                  q_seg_ref, k_seg_ref, cfg, masked, base2=_base2(None))
        dv_sc[...] += _dot(pt.astype(do.dtype), do, _NN)  # dV_j += P^T dO_i
        dk_sc[...] += _dot(dst.astype(q.dtype), q, _NN)  # dK_j += dS^T Q_i (times the scale at the end)

    _by_kind(_compute, qb_ref, kb_ref, (bi, i, j, n_q, n_kv), cfg, q_seg_ref is not None)

    @pl.when((member == group - 1) & (i == n_q - 1))
    def _finish():
        dk_ref[...] = (cfg.scale * dk_sc[...]).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _bwd_fused_kernel(qb_ref, kb_ref, res_ref, bad_ref, qsb_ref, ksb_ref,
                      q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref,
                      dq_ref, dk_ref, dv_ref, q_sc, dq_sc, dk_sc, dv_sc, *, cfg, n_q, n_kv, group, split):
    """The whole backward in one kernel, 5 matmuls a tile instead of the two kernels' 7 (S and dP once):
    grid (b, kv_head, member, i, j), K/V tiles innermost. dQ_i accumulates in VMEM over j (as in
    `_dq_kernel`); dK and dV of the kv head's whole shard stay in VMEM scratch ([sk, d] float32) over the
    group's heads and every Q tile, and are written once at the end. The tile is key-major
    (`_dkv_key_major_kernel`): dV += P^T dO and dK += dS^T Q are plain matmuls; dQ += dS K takes dS^T transposed
    (as splash attention's fused backward does). Used where no program applies, lse/delta are rows and
    the shard's dK/dV fit VMEM (`_fused_bwd`). A partial tile runs as ``split`` x ``split`` sub-tiles
    (`_sub_tiles`)."""
    bi, kv_head, member, i, j = (pl.program_id(a) for a in range(5))
    bk = cfg.block_kv
    _mark_tile(bad_ref[bi * n_kv + _resident(res_ref, bi, i, j, n_q, n_kv)], k_ref, v_ref)

    @pl.when((member == 0) & (i == 0) & (j == 0))
    def _init_kv():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(j == 0)
    def _init_q():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
        q_sc[...] = _scaled(q_ref[...], _logit_scale(cfg, _base2(None)))

    def _fold(masked, qp=slice(None), kp=slice(None)):  # the tile, or its sub-tile (query rows qp, key rows kp)
        q, do, k = q_sc[qp, :], do_ref[qp, :], k_ref[kp, :]
        pt, dst = key_major_grads(k, q, v_ref[kp, :], do, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref,
                                  k_seg_ref, cfg, masked, part=(qp, kp), base2=_base2(None))
        first, size = (0, bk) if kp.start is None else (kp.start, kp.stop - kp.start)
        rows = pl.ds(pl.multiple_of(j * bk + first, size), size)  # these keys' rows of the shard's dK, dV
        dv_sc[rows, :] += _dot(pt.astype(do.dtype), do, _NN)  # dV_j += P^T dO_i
        dk_sc[rows, :] += _dot(dst.astype(q.dtype), q_ref[qp, :], _NN)  # dK_j += dS^T Q_i (scale at the end)
        dq_sc[qp, :] += _dq_tile(dst, finite_keys(k))  # dQ_i += dS K_j (scale at the end)

    def _compute(masked):
        if masked and split > 1:
            _sub_tiles(_fold, qsb_ref, ksb_ref, (bi, i, j, n_q, n_kv), (cfg.block_q, cfg.block_kv), split, cfg,
                       q_seg_ref is not None)
        else:  # key chunks: each adds its keys' dK/dV rows and its share of dQ_i
            for kp in _chunks(cfg.block_kv, BWD_KEY_CHUNK):
                _fold(masked, kp=kp)

    _by_kind(_compute, qb_ref, kb_ref, (bi, i, j, n_q, n_kv), cfg, q_seg_ref is not None)

    @pl.when(j == n_kv - 1)
    def _finish_q():
        dq_ref[...] = (cfg.scale * dq_sc[...]).astype(dq_ref.dtype)

    @pl.when((member == group - 1) & (i == n_q - 1) & (j == n_kv - 1))
    def _finish_kv():
        dk_ref[...] = (cfg.scale * dk_sc[...]).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_tile(dst, k):
    """dS K from the key-major dS^T (block_kv, block_q) float32 and K (block_kv, d), in the form
    :data:`DQ_FORM` names: ``"transpose"`` dS^T transposed in float32, then cast (splash attention's);
    ``"cast"`` cast to K's dtype first, a 16-bit transpose; ``"tn"`` no transpose written, the matmul
    contracts dS^T's first axis (Mosaic places the transpose)."""
    if DQ_FORM == "cast":
        return _dot(dst.astype(k.dtype).T, k, _NN)
    if DQ_FORM == "tn":
        return _dot(dst.astype(k.dtype), k, _TN)
    return _dot(dst.T.astype(k.dtype), k, _NN)


def _fused_specs(cfg, d, d_v, sk, group, n_q, n_kv):
    """BlockSpecs of `_bwd_fused_kernel`'s grid (b, kv_head, member, i, j): Q-side tiles of query head
    ``kv_head * group + member``, the resident K/V tile (``res``, as `_qmajor_specs`), positions as query
    rows and key columns, and dK/dV as the kv head's whole shard."""
    bq, bk, direct = cfg.block_q, cfg.block_kv, _direct(d, d_v)
    kv_tile = lambda bi, i, j, res: _resident(res, bi, i, j, n_q, n_kv)  # noqa: E731
    q_at = lambda bi, kh, m, i, j, *_: (bi, kh * group + m, i)  # noqa: E731
    kv_at = lambda bi, kh, m, i, j, qb, kb, res, *_: (bi, kh, kv_tile(bi, i, j, res))  # noqa: E731
    whole = lambda bi, kh, *_: (bi, kh, 0)  # noqa: E731
    return dict(q=_block(direct, bq, d, q_at), o=_block(direct, bq, d_v, q_at), kv=_block(direct, bk, d, kv_at),
                v=_block(direct, bk, d_v, kv_at), stat=_stat_block(True, bq, q_at),
                q_pos=_pos_block(True, bq, lambda bi, kh, m, i, j, *_: (bi, i)),
                k_pos=_pos_block(True, bk, lambda bi, kh, m, i, j, qb, kb, res, *_: (bi, kv_tile(bi, i, j, res))),
                dk=_block(direct, sk, d, whole), dv=_block(direct, sk, d_v, whole))


def _fused_scratch(cfg, d, d_v, sk, dtype):
    """(shape, dtype) of `_bwd_fused_kernel`'s VMEM scratch: scaled Q, dQ, and the shard's dK, dV."""
    return [((cfg.block_q, d), dtype), ((cfg.block_q, d), jnp.float32), ((sk, d), jnp.float32),
            ((sk, d_v), jnp.float32)]


def _split_temps(dtype):
    """Score-sized float32 temporaries to add for float32 inputs: at ``jax.default_matmul_precision("highest")``
    Mosaic splits each float32 matmul operand into bfloat16 parts. Without them the fused backward at 1024 x
    1024 tiles (float32, window and segment ids, 2K tokens) asked for 33.24 MiB against the 33 MiB limit
    planned for it and failed to compile under JAX 0.10.2 on a v5e (2026-12-06; at the default precision,
    and under JAX 0.12, it fit)."""
    return 2 if jnp.dtype(dtype) == jnp.float32 else 0


def _fused_footprint(cfg, q_shape, k_shape, dtype, d_v):
    """`budgets.Footprint` of `_bwd_fused_kernel` (its dK/dV scratch and output blocks grow with the shard)."""
    (b, sq, h, d), (sk, hk) = q_shape, k_shape[1:3]
    sp, f32, i32, odt = _fused_specs(cfg, d, d_v, sk, h // hk, sq // cfg.block_q, sk // cfg.block_kv), jnp.float32, \
        jnp.int32, _out_dtype(cfg)
    of = budgets.block_of
    ins = [of(sp["q"], dtype), of(sp["kv"], dtype), of(sp["v"], dtype), of(sp["o"], dtype), of(sp["stat"], f32),
           of(sp["stat"], f32)] + [of(sp["q_pos"], i32), of(sp["k_pos"], i32)] * 2
    outs = [of(sp["q"], odt), of(sp["dk"], odt), of(sp["dv"], odt)]
    n_q, n_kv = sq // cfg.block_q, sk // cfg.block_kv
    smem = _prefetch_smem(b, n_q, n_kv)
    temps = [((cfg.block_kv, cfg.block_q), f32)] * (3 + _split_temps(dtype))
    return budgets.Footprint(budgets.tpu_vmem_bytes(ins + outs, _fused_scratch(cfg, d, d_v, sk, dtype), temps), smem,
                             "ring_hop_bwd_fused_tpu")


DQ_FORM = "transpose"  # how `_bwd_fused_kernel` forms dS K (`_dq_tile`; benchmarks/tpu_checks.py --checks variants)
FUSED_BWD = True  # `_bwd_fused_kernel` where it applies and fits (benchmarks/tune_tpu.py measures both)
KEY_MAJOR_DKV = True  # `_dkv_key_major_kernel` where it applies (benchmarks/tune_tpu.py measures both)


def _key_major(cfg, prog, enabled=None):
    """Whether the dK/dV kernel runs transposed (`_dkv_key_major_kernel`): no program, lse/delta as rows."""
    return (KEY_MAJOR_DKV if enabled is None else enabled) and prog is None and _stat_rows(cfg)


def _bwd_call(kernel, name, grid, *, specs, prefetch, args, out_specs, out_shape, scratch, interpret, vmem_limit):
    """One backward pallas_call: batch, heads and the outer tile axis in parallel, the rest in order."""
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=N_PREFETCH, grid=grid, in_specs=specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * 3 + ("arbitrary",) * (len(grid) - 3), vmem_limit_bytes=vmem_limit),
        interpret=interpret, name=name,
    )(*prefetch, *args)


def _backward(qs, kv, do, lse, delta, *, cfg, interpret, vmem_limit):
    """The backward: one fused pallas_call where `_fused_bwd` allows it, else two (dQ; dK and dV):
    (dq, dk, dv), float32 or ``cfg.out_dtype``."""
    fused = _fused_bwd(cfg, qs.q.shape, kv.k.shape, qs.q.dtype, kv.v.shape[-1], target_chip(interpret))
    return _backward_jit(qs, kv, do, lse, delta, cfg=cfg, interpret=interpret, vmem_limit=vmem_limit,
                         key_major_dkv=KEY_MAJOR_DKV, fused=fused)


def _fused_bwd(cfg, q_shape, k_shape, dtype, d_v, chip):
    """None where the backward does not run as `_bwd_fused_kernel` (``FUSED_BWD`` off, a program, lse/delta
    not rows, or its footprint over the chip's budget), else its ``vmem_limit_bytes``: ``(limit,)``, the
    limit None where the default holds it or when interpreted (``chip`` None)."""
    if not FUSED_BWD or cfg.logit_softcap is not None or cfg.mask_fn is not None or cfg.score_fn is not None \
            or not _stat_rows(cfg):
        return None
    if chip is None:
        return (None,)
    footprint = _fused_footprint(cfg, q_shape, k_shape, dtype, d_v)
    return (budgets.vmem_limit(chip, [footprint]),) if budgets.fits(chip, footprint) else None


@functools.partial(jax.jit, static_argnames=_STATIC + ("key_major_dkv", "fused"))
def _backward_jit(qs, kv, do, lse, delta, *, cfg, interpret, vmem_limit, key_major_dkv, fused):
    """``fused``: `_fused_bwd`'s answer (None: the two kernels)."""
    (b, sq, h, d), (sk, hk), d_v = qs.q.shape, kv.k.shape[1:3], kv.v.shape[-1]
    group, n_q, n_kv, segments = h // hk, sq // cfg.block_q, sk // cfg.block_kv, qs.seg is not None
    prog, direct, rows, odt = program(cfg, cfg.block_q, cfg.block_kv), _direct(d, d_v), _stat_rows(cfg), _out_dtype(cfg)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # a row that saw nothing: every p is masked to 0 anyway
    stats = [_stats_in(x, rows) for x in (lse, delta)]
    operands = [_view(x, direct) for x in (qs.q, kv.k, kv.v, do)] + stats
    if fused is not None:  # no program: no consts; positions for key-major tiles
        split = _split(cfg, prog, interpret)
        ops = same_vma(*_prefetch(qs, kv, cfg, split=split), *operands, *_positions(qs, kv, cfg))
        return _backward_fused(qs, kv, cfg, list(ops[N_PREFETCH:]), ops[:N_PREFETCH], split, interpret=interpret,
                               vmem_limit=fused[0])
    key_major = _key_major(cfg, prog, key_major_dkv)
    ops = same_vma(*_prefetch(qs, kv, cfg), *_prefetch(qs, kv, cfg, transposed=True), *operands, *_positions(qs, kv, cfg),
                   *_consts(prog))
    prefetch_q, prefetch_kv, n_ops = ops[:N_PREFETCH], ops[N_PREFETCH:2 * N_PREFETCH], 2 * N_PREFETCH + len(operands)
    inputs, pos, consts = ops[2 * N_PREFETCH:n_ops], ops[n_ops:n_ops + 4], tuple(ops[n_ops + 4:])
    q, static = inputs[0], dict(cfg=cfg, prog=prog, n_q=n_q, n_kv=n_kv, rows=rows)

    # dQ: grid (b, h, Q tiles, K/V tiles), K/V tiles last.
    sp = _qmajor_specs(cfg, d, group, n_q, n_kv, d_v)
    in_specs = [sp["q"], sp["kv"], sp["v"], sp["o"], sp["stat"], sp["stat"]] + _pos_specs(sp, segments, prog)
    dq = _bwd_call(functools.partial(_dq_kernel, **static), "ring_hop_bwd_dq_tpu", (b, h, n_q, n_kv),
                   specs=in_specs, prefetch=prefetch_q, args=[*inputs, *pos, consts], out_specs=sp["q"],
                   out_shape=out_struct((b, sq, h * d) if direct else (b, h, sq, d), odt, q),
                   scratch=[pltpu.VMEM((cfg.block_q, d), jnp.float32), pltpu.VMEM((cfg.block_q, d), qs.q.dtype)],
                   interpret=interpret, vmem_limit=vmem_limit)

    # dK, dV: grid (b, kv heads, K/V tiles, group heads, Q tiles); the last two accumulate in scratch.
    sp = _kvmajor_specs(cfg, d, group, n_q, n_kv, d_v)
    in_specs = [sp["q"], sp["kv"], sp["v"], sp["o"], sp["stat"], sp["stat"]] + _pos_specs(sp, segments, prog)
    kernel = _dkv_key_major_kernel if key_major else _dkv_kernel
    scratch = [pltpu.VMEM((cfg.block_kv, width), jnp.float32) for width in (d, d_v)]
    dk, dv = _bwd_call(functools.partial(kernel, group=group, **static), "ring_hop_bwd_dkv_tpu",
                       (b, hk, n_kv, group, n_q), specs=in_specs, prefetch=prefetch_kv,
                       args=[*inputs, *pos, consts],
                       out_specs=[sp["kv"], sp["v"]],
                       out_shape=[out_struct((b, sk, hk * width) if direct else (b, hk, sk, width), odt, q)
                                  for width in (d, d_v)],
                       scratch=scratch + ([pltpu.VMEM((cfg.block_kv, d), qs.q.dtype)] if key_major else []),
                       interpret=interpret, vmem_limit=vmem_limit)
    return _unview(dq, h, direct), _unview(dk, hk, direct), _unview(dv, hk, direct)


def _backward_fused(qs, kv, cfg, args, prefetch, split, *, interpret, vmem_limit):
    """The backward as one pallas_call (`_bwd_fused_kernel`). args: q, k, v, do (viewed), lse, delta and
    the key-major positions, as `_backward_jit` builds them; ``split`` (`_split`) and ``vmem_limit`` (`_fused_bwd`)."""
    (b, sq, h, d), (sk, hk), d_v = qs.q.shape, kv.k.shape[1:3], kv.v.shape[-1]
    group, n_q, n_kv, direct, odt = h // hk, sq // cfg.block_q, sk // cfg.block_kv, _direct(d, d_v), _out_dtype(cfg)
    q = args[0]
    sp = _fused_specs(cfg, d, d_v, sk, group, n_q, n_kv)
    segments = qs.seg is not None
    in_specs = [sp["q"], sp["kv"], sp["v"], sp["o"], sp["stat"], sp["stat"], sp["q_pos"], sp["k_pos"]] + (
        [sp["q_pos"], sp["k_pos"]] if segments else [None, None])
    shape = lambda s, heads, w: (b, s, heads * w) if direct else (b, heads, s, w)  # noqa: E731
    dq, dk, dv = pl.pallas_call(
        functools.partial(_bwd_fused_kernel, cfg=cfg, n_q=n_q, n_kv=n_kv, group=group, split=split),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_PREFETCH, grid=(b, hk, group, n_q, n_kv), in_specs=in_specs,
            out_specs=[sp["q"], sp["dk"], sp["dv"]],
            scratch_shapes=[pltpu.VMEM(shape_, dt) for shape_, dt in _fused_scratch(cfg, d, d_v, sk, qs.q.dtype)]),
        out_shape=[out_struct(shape(sq, h, d), odt, q), out_struct(shape(sk, hk, d), odt, q),
                   out_struct(shape(sk, hk, d_v), odt, q)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 2 + ("arbitrary",) * 3,
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret, name="ring_hop_bwd_fused_tpu",
    )(*prefetch, *args)
    return _unview(dq, h, direct), _unview(dk, hk, direct), _unview(dv, hk, direct)


def footprints(cfg, q_shape, k_shape, dtype, backward, d_v=None):
    """The VMEM / SMEM estimate of each pallas_call (`budgets`), from the BlockSpecs and scratch the
    kernels are built with: the forward, or the dQ and the dK/dV kernels. Segment ids are counted
    (they may be absent: an over-estimate of two int32 blocks); ``d_v``: v's width (None: q's); a
    program's consts (a few scalars per head) are not."""
    (b, sq, h, d), (sk, hk) = q_shape, k_shape[1:3]
    d_v = d if d_v is None else d_v
    bq, bk, f32, i32 = cfg.block_q, cfg.block_kv, jnp.float32, jnp.int32
    n_q, n_kv = sq // bq, sk // bk
    smem = _prefetch_smem(b, n_q, n_kv)
    out = []
    for name, sp, scratch in (
            [("ring_hop_fwd_tpu", _qmajor_specs(cfg, d, h // hk, n_q, n_kv, d_v),
              [((bq, LANES), f32)] * 2 + [((bq, d_v), f32), ((bq, d), dtype)])]
            if not backward else
            [("ring_hop_bwd_dq_tpu", _qmajor_specs(cfg, d, h // hk, n_q, n_kv, d_v), [((bq, d), f32), ((bq, d), dtype)]),
             ("ring_hop_bwd_dkv_tpu", _kvmajor_specs(cfg, d, h // hk, n_q, n_kv, d_v),
              [((bk, d), f32), ((bk, d_v), f32), ((bk, d), dtype)])]):
        of = lambda spec, dt: budgets.block_of(spec, dt)  # noqa: E731
        ins = [of(sp["q"], dtype), of(sp["kv"], dtype), of(sp["v"], dtype)]
        ins += [of(sp["o"], dtype), of(sp["stat"], f32), of(sp["stat"], f32)] if backward else []
        ins += [of(sp["q_pos"], i32), of(sp["k_pos"], i32)] * 2
        odt = _out_dtype(cfg)
        outs = ([of(sp["o"], odt), of(sp["stat"], f32)] if not backward else
                [of(sp["q"], odt)] if name.endswith("dq_tpu") else [of(sp["kv"], odt), of(sp["v"], odt)])
        temps = [((bq, bk), f32)] * ((2 if not backward else 3) + _split_temps(dtype))  # s, p (and dp / ds)
        out.append(budgets.Footprint(budgets.tpu_vmem_bytes(ins + outs, scratch, temps), smem, name))
    return out


def _blocks(sq, sk):
    """Tile sides Mosaic's tile rule allows for these shards, largest first (`budgets.candidate_blocks`)."""
    return (budgets.candidate_blocks(sq, multiple=SUBLANES, top=2048),
            budgets.candidate_blocks(sk, multiple=LANES, top=2048))


# Tile sides measured on a TPU v5e (JAX 0.10.2, benchmarks/tune_tpu.py, 2026-12-05; docs/benchmarks.md):
# bfloat16, d = 128, 8 heads, 4K and 16K tokens per device, causal or not, each kernel alone. The forward
# was fastest at 2048 x 2048 in every case (1024 x 1024: 0-10 % slower; 512 x 512: 29-87 % slower); the
# fused backward at 1024 x 1024 (within 2 % of each case's best; 2048 x 2048: up to 2x slower causal).
# A second sweep (tune4: d = 64 and 256 in bfloat16, float32 at d = 128; 1K and 16K tokens): the same, but
# past d = 128 the forward's 2048 x 2048 tile fell off a cliff (2.2x slower than 1024 x 1024 causal at
# d = 256, 16K), so wide heads get "fwd_wide". Every chip gets these targets; its VMEM budget (`budgets`)
# shrinks them where they do not fit.
# At d = 64 and 1K tokens the forward was fastest with two 512-query tiles in the first sweep (0.75 vs 0.94
# ms causal, 0.76 vs 0.78 not): heads of at most NARROW get at least two Q tiles in the forward (at d = 128
# and 256 one 1024 tile was the faster; at 16K, with many tiles either way, nothing changes). At 1K the
# times are mostly dispatch (a 2-GFLOP forward): a second sweep (tune_d64, 2026-12-06) put this default at
# 1.07 / 1.09x its best pair (non-causal / causal), the single 1024 tile at 1.02 / 1.07x; the first, 1.00
# against 1.12x.
TUNED = {"fwd": 2048, "fwd_wide": 1024, "bwd": 1024}
NARROW = 64


def _default(q_shape, k_shape, dtype, device, backward):
    if device.platform != "tpu":
        return None
    est = lambda bq, bk: footprints(HopConfig(block_q=bq, block_kv=bk), q_shape, k_shape, dtype, backward)  # noqa: E731
    top = TUNED[_tuned_key(q_shape, backward)]
    q_top = top if backward or q_shape[-1] > NARROW else min(top, max(q_shape[1] // 2, SUBLANES))
    return budgets.default_tiles(budgets.chip(device.device_kind), est, q_shape[1], k_shape[1],
                                 q_multiple=SUBLANES, kv_multiple=LANES, top=top, q_top=q_top)


def _tuned_key(q_shape, backward):
    """The :data:`TUNED` entry of a kernel: the backward's, or the forward's for heads up to 128 wide or wider."""
    return "bwd" if backward else "fwd" if q_shape[-1] <= LANES else "fwd_wide"


def default_blocks(q_shape, k_shape, dtype, device, *, n=None):
    """The forward's ``(block_q, block_kv)`` when the caller gives none, compiled for ``device`` (q [b, sq, h,
    d], k [b, sk, hk, d] shapes of a host): the largest tiles up to the chip-measured :data:`TUNED` side
    that Mosaic's tile rule allows and that fit the chip; None (use ``default_block``) when interpreted.
    ``n`` (the ring size) does not matter here."""
    return _default(q_shape, k_shape, dtype, device, False)


def default_bwd_blocks(q_shape, k_shape, dtype, device):
    """The backward's ``(block_q, block_kv)`` (``HopConfig.bwd_blocks``), as `default_blocks` for the
    backward kernels and :data:`TUNED`'s backward side."""
    return _default(q_shape, k_shape, dtype, device, True)


hop_fwd, hop_bwd, fwd_tile_counts = hop_kernels(IMPL, _forward, _backward, _tile_rule, Budget(footprints, _blocks))
