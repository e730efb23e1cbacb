"""One ring hop as FlashAttention-2 kernels on the Pallas Triton backend (GPU; interpreted on CPU).

Implements the per-hop contract of docs/design.md on ``(QShard, KVShard, HopConfig)``
(``ringattn_fast.schedule``): ``hop_fwd`` returns this hop's ``(o, lse)`` (``o`` normalised within
the hop), ``hop_bwd`` recomputes each tile from the *final* ``lse`` and returns
``HopGrads(dq, dk, dv, None)``. The ring (Liu et al. 2023, Alg. 1) merges hops with the
(o, lse) merge (``ringattn_fast.softmax``; Rabe & Staats, arXiv:2112.05682).

Notation: FlashAttention-2 (Dao 2023, arXiv:2307.08691) -> code

- Br, Bc: cfg.block_q, cfg.block_kv: rows of a Q tile, rows of a K/V tile.
- outer loop: over Q tiles = the Triton grid ``(batch, heads, sq // block_q)``; one program owns
  one Q tile (FA-2 §3.2: parallel over Q blocks, no atomics).
- inner loop: over K/V tiles = ``lax.fori_loop``; a tile that ``masks.bounds_empty`` proves empty
  (from the min/max of the tile's positions and segment ids) is skipped with ``lax.cond``
  (`_unless_empty`); ``count=True`` also counts the computed tiles (`fwd_tile_counts`).
- S_ij: ``s = scale * q @ k.T`` (fp32), then ``HopConfig``'s soft-cap, ``score_fn`` and ``mask_fn``
  (`tiles.programmed`; the backward takes dS back through them, ``score_fn`` by ``jax.vjp`` on the
  tile), -inf where ``masks.allowed`` or ``mask_fn`` is False.
- m_i, l_i: ``m`` running row max, ``l`` running row sum of exp(s - m) (Alg. 1 lines 8-10).
- O_i: ``o`` kept unnormalised during the loop, divided by ``l`` once at the end (§3.1.1).
- L_i: ``lse = m + log(l)``, the only statistic saved; -inf for a row that saw nothing.
- D_i: ``delta = rowsum(dO * O)`` (Alg. 2 line 4), computed by the caller from the final O.
- backward: Alg. 2 split in two kernels, so no atomics: ``_dq_kernel`` (grid over Q tiles, loop
  over K/V tiles) and ``_dkv_kernel`` (grid over K/V tiles, loop over the GQA group's heads and the
  Q tiles; dK/dV are summed over the group in registers). ``group`` is the GQA group size
  (``heads // kv_heads``), ``member`` a query head's place in its group.

K/V arrive marked by ``masks.mark_bad_keys`` (the ring does it once): a key that held a nan/inf has
V = 0 and an all-NaN K, so a masked one contributes nothing and exactly the rows that see it are NaN;
the backward keeps its NaN out of dQ (``masks.finite_part``) and zeroes dS where P is 0
(``masks.masked_grad``).

Refs are named and fixed: absent segment ids (and the tile counter when not counting) are ``None``
refs with a ``None`` BlockSpec, as in ``jax/experimental/pallas/ops/gpu/attention.py``.

GQA: query head h reads kv head ``h // (heads // kv_heads)`` through the BlockSpec index map; K/V
are never repeated in memory. Inputs are float16, bfloat16 or float32 (one dtype for q, k, v,
``dispatch.check_kernel_dtypes``), multiplied with fp32 accumulation; outputs are float32.

Triton needs power-of-two tensor sizes: on a GPU, block_q and block_kv must be powers of two
(>= 16, the smallest ``tl.dot``), and a head dim that is not a power of two is zero-padded (zeros
change neither q.k nor o's first ``dim`` columns): q and k to one width, v (and o, dO, dV) to its
own, so v may be ``d_v`` wide (MLA). On CPU (``interpret=True``) any divisor works.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ringattn_fast.kernels import budgets
from ringattn_fast.kernels.tiles import (NEG_INF, Budget, const_specs, hop_kernels, out_struct, program, programmed,
                                         same_vma)
from ringattn_fast.kernels import GPU_PLATFORMS
from ringattn_fast.masks import allowed, bounds_empty, finite_part, masked_grad
from ringattn_fast.schedule import HopConfig

__all__ = ["hop_fwd", "hop_bwd", "fwd_tile_counts", "default_blocks", "footprints"]

IMPL = "pallas_gpu"
_STATIC = ("cfg", "interpret", "vmem_limit")


def _preload(interpret, q):
    """Interpreting under shard_map with check_vma: read loop operands before the loop (`_Rows`)."""
    return bool(interpret and jax.typeof(q).mat.varying)


def _dot(a, b, trans_a=False, trans_b=False):
    """fp32-accumulating matmul; exact fp32 (no TF32) when the inputs are fp32."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=not exact)


class _Rows:
    """Reads ``ref[idx]`` (idx holds one ``pl.ds``) inside a kernel loop.

    Triton reads the rows straight from the ref. Under ``shard_map(check_vma=True)`` the Triton
    *interpreter* cannot thread a ref through a loop (the ref's value varies over the mesh, the traced
    loop body's does not), so with ``preload`` the whole block is read once before the loop and
    sliced as a value. Same arithmetic either way; only used when interpreting on CPU.
    """

    def __init__(self, ref, preload):
        self.ref, self.value = ref, (ref[...] if preload else None)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if self.value is None:
            return self.ref[idx]
        axis = next(a for a, i in enumerate(idx) if isinstance(i, pl.Slice))
        x = lax.dynamic_slice_in_dim(self.value, idx[axis].start, idx[axis].size, axis)
        return x[tuple(slice(None) if a == axis else i for a, i in enumerate(idx))]


def _rows(ref, preload):
    """`_Rows` of ``ref``, or None for an absent input (segment ids)."""
    return None if ref is None else _Rows(ref, preload)


def _bounds(pos, seg):
    """(pos_min, pos_max) of one tile, and (seg_min, seg_max) with segment ids: a `bounds_empty` side."""
    return (jnp.min(pos), jnp.max(pos)) + (() if seg is None else (jnp.min(seg), jnp.max(seg)))


def _unless_empty(compute, carry, q_bounds, k_bounds, cfg):
    """``compute(carry)`` unless `bounds_empty` proves the tile empty (then ``carry`` unchanged)."""
    empty = bounds_empty(q_bounds, k_bounds, causal=cfg.causal, window=cfg.window)
    return compute(carry) if empty is None else lax.cond(empty, lambda c: c, compute, carry)


def _logits(q, k, cfg, fn, *, q_pos, k_pos, q_seg, k_seg, grad=False):
    """S_ij = scale * q k^T, fp32 [block_q, block_kv], soft-capped, scored and masked (``fn``: the tile's
    `tiles.Program`, its consts and the query head), -inf where a mask forbids the pair; with ``grad``
    ``(S_ij, pullback)`` (`tiles.programmed`; None without a program)."""
    s = cfg.scale * _dot(q, k, trans_b=True)
    prog, consts, head = fn
    s, pull = programmed(prog, consts, s, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, head=head, grad=grad)
    allow = allowed(q_pos[:, None], k_pos[None, :], None if q_seg is None else q_seg[:, None],
                    None if k_seg is None else k_seg[None, :], causal=cfg.causal, window=cfg.window)
    s = s if allow is None else jnp.where(allow, s, NEG_INF)
    return (s, pull) if grad else s


def _fwd_kernel(q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref, const_refs, o_ref, lse_ref,
                count_ref, *, cfg, prog, preload):
    """One Q tile against every K/V tile (FA-2 Alg. 1). q_seg_ref, k_seg_ref: None without segments;
    const_refs: ``prog``'s captured arrays (a tuple); count_ref: None unless counting."""
    n_kv, segments = k_ref.shape[0] // cfg.block_kv, q_seg_ref is not None
    k_rows, v_rows, k_pos_rows, k_seg_rows = (_rows(r, preload) for r in (k_ref, v_ref, k_pos_ref, k_seg_ref))
    q, q_pos = q_ref[...], q_pos_ref[...]  # (block_q, d), (block_q,)
    q_seg = q_seg_ref[...] if segments else None
    fn = (prog, [r[...] for r in const_refs], pl.program_id(1))  # the query head
    block_q, d_v = q.shape[0], o_ref.shape[-1]

    def kv_tile(j, carry):
        kv = pl.ds(j * cfg.block_kv, cfg.block_kv)
        k_pos, k_seg = k_pos_rows[kv], (k_seg_rows[kv] if segments else None)  # (block_kv,)

        def compute(carry):
            o, m, l, n = carry
            k, v = k_rows[kv, :], v_rows[kv, :]  # (block_kv, d), (block_kv, d_v)
            s = _logits(q, k, cfg, fn, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)  # (block_q, block_kv)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: exp(-inf) = 0
            p = jnp.exp(s - m_safe[:, None])  # masked: exp(-inf) = 0
            alpha = jnp.exp(m - m_safe)  # rescales the old l and o to the new max
            o = alpha[:, None] * o + _dot(p.astype(v.dtype), v)
            return o, m_new, alpha * l + jnp.sum(p, axis=1), n + 1

        return _unless_empty(compute, carry, _bounds(q_pos, q_seg), _bounds(k_pos, k_seg), cfg)

    init = (jnp.zeros((block_q, d_v), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
            jnp.zeros((block_q,), jnp.float32), jnp.int32(0))
    o, m, l, n = lax.fori_loop(0, n_kv, kv_tile, init)
    empty = l == 0.0  # saw nothing (a NaN l stays NaN below)
    o_ref[...] = jnp.where(empty[:, None], 0.0, o / jnp.where(empty, 1.0, l)[:, None])
    lse_ref[...] = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))
    if count_ref is not None:
        count_ref[...] = jnp.full(count_ref.shape, n, jnp.int32)


def _pad_dim(x, d_pad):
    return x if x.shape[-1] == d_pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d_pad - x.shape[-1])])


def _tile_rule(cfg, sq, sk, interpret):
    """Triton's tile rule on a GPU: power-of-two blocks of at least 16 (interpreted: any divisor)."""
    if not interpret and any(bl < 16 or bl & (bl - 1) for bl in (cfg.block_q, cfg.block_kv)):
        raise ValueError(f"impl={IMPL!r}: on a GPU block_q and block_kv must be powers of two >= 16; "
                         f"got block_q={cfg.block_q}, block_kv={cfg.block_kv}")


def _params(d):
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=budgets.TRITON_STAGES)


def _widths(qs, kv):
    """(d, d_v) and their padded widths (`pl.next_power_of_2`): q, k are ``d`` wide, v and o ``d_v``."""
    d, d_v = qs.q.shape[-1], kv.v.shape[-1]
    return d, d_v, pl.next_power_of_2(d), pl.next_power_of_2(d_v)


def _inputs(qs, kv, prog, *extra):
    """Kernel operands, typed alike under shard_map: q, k (padded to d_pad), v (to dv_pad), ``extra``, int32
    positions and segment ids (None without segments), then ``prog``'s consts (a tuple)."""
    _, _, d_pad, dv_pad = _widths(qs, kv)
    ints = lambda x: None if x is None else x.astype(jnp.int32)
    consts = () if prog is None else prog.consts
    q, k, v, *rest = same_vma(qs.q, kv.k, kv.v, *extra, ints(qs.pos), ints(kv.pos), ints(qs.seg), ints(kv.seg),
                              *consts)
    rest, consts = rest[:len(rest) - len(consts)], tuple(rest[len(rest) - len(consts):])
    return (_pad_dim(q, d_pad), _pad_dim(k, d_pad), _pad_dim(v, dv_pad), *rest, consts)


def _whole(shape):
    """A BlockSpec of the whole array in every program (a program's captured constants)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=_STATIC + ("count",))
def _forward(qs, kv, *, cfg, interpret, count, vmem_limit):
    """pallas_call for the forward: (o, lse, computed K/V tiles per Q tile [b, h, nq] or None).
    ``vmem_limit`` is always None here (a TPU setting; shared memory is only checked, `footprints`)."""
    (b, sq, h, _), (sk, hk) = qs.q.shape, kv.k.shape[1:3]
    (_, d_v, d_pad, dv_pad), group, bq = _widths(qs, kv), h // hk, cfg.block_q
    prog = program(cfg, bq, cfg.block_kv)
    args = _inputs(qs, kv, prog)
    q_side, kv_side = (lambda bi, hi, i: (bi, i, hi, 0)), (lambda bi, hi, i: (bi, 0, hi // group, 0))
    seg = lambda spec: None if qs.seg is None else spec
    tile = lambda width: pl.BlockSpec((None, bq, None, width), q_side)  # noqa: E731
    kv_all = lambda width: pl.BlockSpec((None, sk, None, width), kv_side)  # noqa: E731
    q_row = pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i))
    k_row = pl.BlockSpec((None, sk), lambda bi, hi, i: (bi, 0))
    stat = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    counter = pl.BlockSpec((None, None, 1), lambda bi, hi, i: (bi, hi, i))
    o, lse, counts = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, prog=prog, preload=_preload(interpret, args[0])),
        grid=(b, h, sq // bq),
        in_specs=[tile(d_pad), kv_all(d_pad), kv_all(dv_pad), q_row, k_row, seg(q_row), seg(k_row),
                  const_specs(prog, _whole)],
        out_specs=[tile(dv_pad), stat, counter if count else None],
        out_shape=[out_struct((b, sq, h, dv_pad), jnp.float32, args[0]),
                   out_struct((b, h, sq), jnp.float32, args[0]),
                   out_struct((b, h, sq // bq), jnp.int32, args[0]) if count else None],
        compiler_params=_params(max(d_pad, dv_pad)), interpret=interpret, name="ring_hop_fwd",
    )(*args)
    return o[..., :d_v], lse, counts


def _tile_grads(s, pull, do, v, lse, delta):
    """FA-2 Alg. 2 lines 11-20 for one tile of masked logits ``s``: (p, ds), fp32 [block_q, block_kv];
    ``pull``: the tile program's pullback (`tiles.programmed`) to the scaled logits, or None."""
    p = jnp.exp(s - lse[:, None])  # P_ij = exp(S_ij - L_i), 0 where masked (lse is finite here)
    dp = _dot(do, v, trans_b=True)  # dP_ij = dO_i V_j^T
    ds = masked_grad(p, dp, delta[:, None])  # dS_ij = P_ij * (dP_ij - D_i)
    return p, ds if pull is None else pull(ds, p)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref, const_refs,
               dq_ref, *, cfg, prog, preload):
    """dQ of one Q tile, looping over the K/V tiles (q_seg_ref, k_seg_ref: None without segments)."""
    n_kv, segments = k_ref.shape[0] // cfg.block_kv, q_seg_ref is not None
    k_rows, v_rows, k_pos_rows, k_seg_rows = (_rows(r, preload) for r in (k_ref, v_ref, k_pos_ref, k_seg_ref))
    q, do, lse, delta, q_pos = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], q_pos_ref[...]
    q_seg = q_seg_ref[...] if segments else None
    fn = (prog, [r[...] for r in const_refs], pl.program_id(1))

    def kv_tile(j, dq):
        kv = pl.ds(j * cfg.block_kv, cfg.block_kv)
        k_pos, k_seg = k_pos_rows[kv], (k_seg_rows[kv] if segments else None)

        def compute(dq):
            k, v = k_rows[kv, :], v_rows[kv, :]
            s, pull = _logits(q, k, cfg, fn, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, grad=True)
            _, ds = _tile_grads(s, pull, do, v, lse, delta)
            return dq + cfg.scale * _dot(ds.astype(k.dtype), finite_part(k))  # dQ_i += dS_ij K_j (a masked NaN K: 0)

        return _unless_empty(compute, dq, _bounds(q_pos, q_seg), _bounds(k_pos, k_seg), cfg)

    dq_ref[...] = lax.fori_loop(0, n_kv, kv_tile, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, q_seg_ref, k_seg_ref, const_refs,
                dk_ref, dv_ref, *, cfg, prog, group, preload):
    """dK, dV of one K/V tile, looping over the GQA group's heads and the Q tiles."""
    n_q, segments = q_ref.shape[0] // cfg.block_q, q_seg_ref is not None
    q_rows, do_rows, lse_rows, delta_rows, q_pos_rows, q_seg_rows = (
        _rows(r, preload) for r in (q_ref, do_ref, lse_ref, delta_ref, q_pos_ref, q_seg_ref))
    k, v, k_pos = k_ref[...], v_ref[...], k_pos_ref[...]  # (block_kv, d), (block_kv, d_v), (block_kv,)
    k_seg = k_seg_ref[...] if segments else None
    consts, kv_head = [r[...] for r in const_refs], pl.program_id(1)  # read here: not inside a loop (the interpreter)
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for member in range(group):  # the query heads that share this kv head (GQA): dK, dV summed over them

        def q_tile(i, carry, member=member):
            rows = pl.ds(i * cfg.block_q, cfg.block_q)
            q_pos, q_seg = q_pos_rows[rows], (q_seg_rows[rows] if segments else None)

            def compute(carry):
                dk, dv = carry
                q, do = q_rows[rows, member, :], do_rows[rows, member, :]  # (block_q, d), (block_q, d_v)
                fn = (prog, consts, kv_head * group + member)  # the query head
                s, pull = _logits(q, k, cfg, fn, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, grad=True)
                p, ds = _tile_grads(s, pull, do, v, lse_rows[member, rows], delta_rows[member, rows])
                dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # dV_j += P_ij^T dO_i
                dk = dk + cfg.scale * _dot(ds.astype(q.dtype), q, trans_a=True)  # dK_j += dS_ij^T Q_i
                return dk, dv

            return _unless_empty(compute, carry, _bounds(q_pos, q_seg), _bounds(k_pos, k_seg), cfg)

        carry = lax.fori_loop(0, n_q, q_tile, carry)
    dk_ref[...], dv_ref[...] = carry


@functools.partial(jax.jit, static_argnames=_STATIC)
def _backward(qs, kv, do, lse, delta, *, cfg, interpret, vmem_limit):
    """The two backward pallas_calls (dQ; dK and dV): (dq, dk, dv) float32."""
    (b, sq, h, _), (sk, hk) = qs.q.shape, kv.k.shape[1:3]
    (d, d_v, d_pad, dv_pad), group, bq, bk = _widths(qs, kv), h // hk, cfg.block_q, cfg.block_kv
    prog = program(cfg, bq, bk)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # a row that saw nothing: every p is masked to 0 anyway
    q, k, v, do, lse, delta, *ints, consts = _inputs(qs, kv, prog, do, lse.astype(jnp.float32),
                                                     delta.astype(jnp.float32))
    args = (q, k, v, _pad_dim(do, dv_pad), lse, delta, *ints, consts)
    seg = lambda spec: None if qs.seg is None else spec
    preload, fns = _preload(interpret, q), const_specs(prog, _whole)
    params = _params(max(d_pad, dv_pad))

    # dQ: one program per (batch, head, Q tile), looping over K/V tiles.
    q_side, kv_side = (lambda bi, hi, i: (bi, i, hi, 0)), (lambda bi, hi, i: (bi, 0, hi // group, 0))
    q_tile = lambda width: pl.BlockSpec((None, bq, None, width), q_side)  # noqa: E731
    kv_all = lambda width: pl.BlockSpec((None, sk, None, width), kv_side)  # noqa: E731
    stat = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    q_row = pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i))
    k_row = pl.BlockSpec((None, sk), lambda bi, hi, i: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, prog=prog, preload=preload),
        grid=(b, h, sq // bq),
        in_specs=[q_tile(d_pad), kv_all(d_pad), kv_all(dv_pad), q_tile(dv_pad), stat, stat, q_row, k_row, seg(q_row),
                  seg(k_row), fns],
        out_specs=q_tile(d_pad), out_shape=out_struct((b, sq, h, d_pad), jnp.float32, q),
        compiler_params=params, interpret=interpret, name="ring_hop_bwd_dq",
    )(*args)

    # dK, dV: one program per (batch, kv head, K/V tile), looping over its group's heads and Q tiles.
    q_side, kv_side = (lambda bi, kv_head, j: (bi, 0, kv_head, 0)), (lambda bi, kv_head, j: (bi, j, kv_head, 0))
    q_all = lambda width: pl.BlockSpec((None, sq, group, width), q_side)  # noqa: E731
    kv_tile = lambda width: pl.BlockSpec((None, bk, None, width), kv_side)  # noqa: E731
    stat_all = pl.BlockSpec((None, group, sq), lambda bi, kv_head, j: (bi, kv_head, 0))
    q_row = pl.BlockSpec((None, sq), lambda bi, kv_head, j: (bi, 0))
    k_row = pl.BlockSpec((None, bk), lambda bi, kv_head, j: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, prog=prog, group=group, preload=preload),
        grid=(b, hk, sk // bk),
        in_specs=[q_all(d_pad), kv_tile(d_pad), kv_tile(dv_pad), q_all(dv_pad), stat_all, stat_all, q_row, k_row,
                  seg(q_row), seg(k_row), fns],
        out_specs=[kv_tile(d_pad), kv_tile(dv_pad)],
        out_shape=[out_struct((b, sk, hk, d_pad), jnp.float32, q), out_struct((b, sk, hk, dv_pad), jnp.float32, q)],
        compiler_params=params, interpret=interpret, name="ring_hop_bwd_dkv",
    )(*args)
    return dq[..., :d], dk[..., :d], dv[..., :d_v]


def footprints(cfg, q_shape, k_shape, dtype, backward, d_v=None):
    """Shared memory of each Triton program (`budgets.triton_smem_bytes`), from the tiles each kernel
    loads: the forward streams K/V tiles past one Q tile; dQ streams K/V past Q and dO; dK/dV streams
    Q and dO past one K/V tile. The head dims are the padded ones (`pl.next_power_of_2`); ``d_v``: v's
    width (None: q's)."""
    d, bq, bk = pl.next_power_of_2(q_shape[-1]), cfg.block_q, cfg.block_kv
    d_v = d if d_v is None else pl.next_power_of_2(d_v)
    smem = lambda name, looped, once: budgets.Footprint(  # noqa: E731
        budgets.triton_smem_bytes(looped=looped, once=once, score=(bq, bk), dtype=dtype), 0, name)
    q_tile, k_tile, v_tile, do_tile = (bq, d), (bk, d), (bk, d_v), (bq, d_v)
    if not backward:
        return [smem("ring_hop_fwd", [k_tile, v_tile], [q_tile])]
    return [smem("ring_hop_bwd_dq", [k_tile, v_tile], [q_tile, do_tile]),
            smem("ring_hop_bwd_dkv", [q_tile, do_tile], [k_tile, v_tile])]


def _blocks(sq, sk, top=256):
    """Tile sides Triton allows (powers of two >= 16 dividing the shard), largest first."""
    pick = lambda s: [p for p in budgets.candidate_blocks(s, multiple=16, top=top) if p & (p - 1) == 0]  # noqa: E731
    return pick(sq), pick(sk)


def default_blocks(q_shape, k_shape, dtype, device, *, n=None):
    """``(block_q, block_kv)`` when the caller gives none, compiled for ``device``: the largest
    power-of-two tiles up to 128 whose forward and backward programs fit the GPU's shared memory (on an
    A100, bfloat16 d=128: 64 x 64; float32: 32 x 32); None (``default_block``) when interpreted. ``n``
    (the ring size) does not matter here."""
    if device.platform not in GPU_PLATFORMS:
        return None
    chip, cfg = budgets.chip(device.device_kind), HopConfig()
    est = lambda bq, bk: [f for bwd in (False, True)  # noqa: E731
                          for f in footprints(dataclasses.replace(cfg, block_q=bq, block_kv=bk), q_shape, k_shape,
                                               dtype, bwd)]
    return budgets.largest_fitting(chip, est, *_blocks(q_shape[1], k_shape[1], top=128))


hop_fwd, hop_bwd, fwd_tile_counts = hop_kernels(IMPL, _forward, _backward, _tile_rule, Budget(footprints, _blocks))
