"""One ring hop as FlashAttention-2 kernels on the Pallas Triton backend (GPU; interpreted on CPU).

Implements the per-hop contract of docs/design.md: ``hop_fwd`` returns this hop's ``(o, lse)``
(``o`` normalised within the hop), ``hop_bwd`` recomputes each tile from the *final* ``lse`` and
returns ``(dq, dk, dv, None)``. The ring (Liu et al. 2023, Alg. 1) merges hops with FA-2's combine.

Notation: FlashAttention-2 (Dao 2023, arXiv:2307.08691) -> code
  Br, Bc          block_q, block_kv: rows of a Q tile, rows of a K/V tile.
  outer loop      over Q tiles = the Triton grid ``(batch, heads, sq // block_q)``; one program
                  owns one Q tile (FA-2 §3.2: parallel over Q blocks, no atomics).
  inner loop      over K/V tiles = ``lax.fori_loop``; a tile whose mask is empty is skipped with
                  ``lax.cond`` (predicate `tiles.tile_visible` on the tiles' position min/max).
  S_ij            ``s = scale * q @ k.T`` with masked entries set to -inf (fp32).
  m_i, l_i        ``m`` running row max, ``l`` running row sum of exp(s - m) (Alg. 1 lines 8-10).
  O_i             ``o`` kept unnormalised during the loop, divided by ``l`` once at the end (§3.1.1).
  L_i             ``lse = m + log(l)``, the only statistic saved; -inf for a row that saw nothing.
  D_i             ``delta = rowsum(dO * O)`` (Alg. 2 line 4), computed by the caller from the final O.
  backward        Alg. 2 split in two kernels, so no atomics: ``_dq_kernel`` (grid over Q tiles,
                  loop over K/V tiles) and ``_dkv_kernel`` (grid over K/V tiles, loop over the GQA
                  group's heads and the Q tiles; dK/dV are summed over the group in registers).

GQA: query head h reads kv head ``h // (heads // kv_heads)`` through the BlockSpec index map; K/V
are never repeated in memory. bf16/fp16 inputs are multiplied with fp32 accumulation.

Triton needs power-of-two tensor sizes: on a GPU, block_q and block_kv must be powers of two
(>= 16, the smallest ``tl.dot``), and a head dim that is not a power of two is zero-padded (zeros
change neither q.k nor o's first ``dim`` columns). On CPU (``interpret=True``) any divisor works.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ringattn_fast.kernels.tiles import (NEG_INF, check_bwd_args, check_hop_args, out_struct, same_vma,
                                         tile_mask, tile_schedule, tile_visible)

__all__ = ["hop_fwd", "hop_bwd", "fwd_tile_counts", "tile_schedule"]

_STATIC = ("scale", "causal", "window", "block_q", "block_kv", "interpret")


def _interpret():
    """True on CPU (Triton interpreter), False on a GPU; any other backend cannot run this kernel."""
    backend = jax.default_backend()
    if backend in ("cpu", "gpu"):
        return backend == "cpu"
    raise ValueError(f"impl='pallas_gpu' needs a GPU (or CPU, interpreted); the default backend is "
                     f"{backend!r}: use impl='pallas_tpu' or 'xla' there")


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


def _bounds(pos, seg):
    """(pos_min, pos_max, seg_min, seg_max) of one tile, as in `tiles.tile_bounds`."""
    if seg is None:
        return jnp.min(pos), jnp.max(pos), 0, 0
    return jnp.min(pos), jnp.max(pos), jnp.min(seg), jnp.max(seg)


def _fwd_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, scale, causal, window, block_kv, segments, preload):
    qs_ref, ks_ref, o_ref, lse_ref, count_ref = refs if segments else (None, None, *refs)
    n_kv = k_ref.shape[0] // block_kv
    k_rows, v_rows, kp_rows = (_Rows(r, preload) for r in (k_ref, v_ref, kp_ref))
    ks_rows = _Rows(ks_ref, preload) if segments else None
    q, q_pos = q_ref[...], qp_ref[...]  # (block_q, d), (block_q,)
    q_seg = qs_ref[...] if segments else None
    q_lo, q_hi, qs_lo, qs_hi = _bounds(q_pos, q_seg)
    block_q, d = q.shape

    def kv_tile(j, carry):
        kv = pl.ds(j * block_kv, block_kv)
        k_pos, k_seg = kp_rows[kv], (ks_rows[kv] if segments else None)  # (block_kv,)
        k_lo, k_hi, ks_lo, ks_hi = _bounds(k_pos, k_seg)

        def compute(carry):
            o, m, l, n = carry
            k, v = k_rows[kv, :], v_rows[kv, :]  # (block_kv, d)
            mask = tile_mask(q_pos[:, None], k_pos[None, :], None if q_seg is None else q_seg[:, None],
                             None if k_seg is None else k_seg[None, :], causal=causal, window=window)
            s = jnp.where(mask, scale * _dot(q, k, trans_b=True), NEG_INF)  # (block_q, block_kv)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: exp(-inf) = 0
            p = jnp.exp(s - m_safe[:, None])
            alpha = jnp.exp(m - m_safe)  # rescales the old l and o to the new max
            l = alpha * l + jnp.sum(p, axis=1)
            o = alpha[:, None] * o + _dot(p.astype(v.dtype), v)
            return o, m_new, l, n + 1

        visible = tile_visible(q_lo, q_hi, k_lo, k_hi, qs_lo, qs_hi, ks_lo, ks_hi, causal=causal, window=window)
        return lax.cond(visible, compute, lambda c: c, carry)

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), NEG_INF, jnp.float32),
            jnp.zeros((block_q,), jnp.float32), jnp.int32(0))
    o, m, l, n = lax.fori_loop(0, n_kv, kv_tile, init)
    seen = l > 0.0
    o_ref[...] = jnp.where(seen[:, None], o / jnp.where(seen, l, 1.0)[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    count_ref[...] = jnp.full(count_ref.shape, n, jnp.int32)


def _pad_dim(x, d_pad):
    return x if x.shape[-1] == d_pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d_pad - x.shape[-1])])


def _prepare(name, q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv):
    """Checks the call (outside jit, so every call is checked) and returns the kernels' static args."""
    block_q, block_kv, _ = check_hop_args(name, q, k, v, q_pos, k_pos, q_seg, k_seg, bias,
                                          window, block_q, block_kv)
    interpret = _interpret()
    if not interpret and any(bl < 16 or bl & (bl - 1) for bl in (block_q, block_kv)):
        raise ValueError(f"{name}: on a GPU block_q and block_kv must be powers of two >= 16; "
                         f"got block_q={block_q}, block_kv={block_kv}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window = None if window is None else tuple(int(w) for w in window)
    return dict(scale=scale, causal=bool(causal), window=window, block_q=block_q, block_kv=block_kv,
                interpret=interpret)


def _params(d):
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window, block_q, block_kv, interpret):
    """pallas_call for the forward; returns (o, lse, computed K/V tiles per Q tile [b, h, nq])."""
    q, k, v, q_pos, k_pos, q_seg, k_seg = same_vma(q, k, v, q_pos, k_pos, q_seg, k_seg)
    (b, sq, h, d), (sk, hk) = q.shape, k.shape[1:3]
    group, d_pad = h // hk, pl.next_power_of_2(d)
    segments = q_seg is not None
    q_tile = pl.BlockSpec((None, block_q, None, d_pad), lambda bi, hi, i: (bi, i, hi, 0))
    kv_all = pl.BlockSpec((None, sk, None, d_pad), lambda bi, hi, i: (bi, 0, hi // group, 0))
    q_row = pl.BlockSpec((None, block_q), lambda bi, hi, i: (bi, i))
    k_row = pl.BlockSpec((None, sk), lambda bi, hi, i: (bi, 0))
    stat = pl.BlockSpec((None, None, block_q), lambda bi, hi, i: (bi, hi, i))
    count = pl.BlockSpec((None, None, 1), lambda bi, hi, i: (bi, hi, i))
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, window=window,
                               block_kv=block_kv, segments=segments, preload=_preload(interpret, q))
    o, lse, counts = pl.pallas_call(
        kernel,
        grid=(b, h, sq // block_q),
        in_specs=[q_tile, kv_all, kv_all, q_row, k_row] + ([q_row, k_row] if segments else []),
        out_specs=[q_tile, stat, count],
        out_shape=[out_struct((b, sq, h, d_pad), jnp.float32, q),
                   out_struct((b, h, sq), jnp.float32, q),
                   out_struct((b, h, sq // block_q), jnp.int32, q)],
        compiler_params=_params(d_pad), interpret=interpret, name="ring_hop_fwd",
    )(_pad_dim(q, d_pad), _pad_dim(k, d_pad), _pad_dim(v, d_pad), q_pos.astype(jnp.int32),
      k_pos.astype(jnp.int32), *([q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)] if segments else []))
    return o[..., :d], lse, counts


def hop_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window, block_q, block_kv):
    """One hop's attention: o float32 [b, sq, h, d] (normalised within the hop), lse float32 [b, h, sq].

    q [b, sq, h, d]; k, v [b, sk, hk, d]; q_pos [b, sq], k_pos [b, sk] int32 true positions;
    q_seg, k_seg int32 or None; bias must be None (ValueError otherwise); window (left, right) or None.
    """
    o, lse, _ = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, **_prepare(
        "pallas_gpu.hop_fwd", q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv))
    return o, lse


def fwd_tile_counts(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, scale=None, causal, window,
                    block_q, block_kv):
    """int32 [b, h, sq // block_q]: K/V tiles the forward kernel actually computed per Q tile.

    Counted inside the kernel (the ``lax.cond`` that skips a tile also skips the increment); equals
    ``tile_schedule(...).sum(-1)`` broadcast over heads.
    """
    return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, **_prepare(
        "pallas_gpu.fwd_tile_counts", q, k, v, q_pos, k_pos, q_seg, k_seg, None, scale, causal, window,
        block_q, block_kv))[2]


def _tile_grads(q, k, v, do, lse, delta, mask, scale):
    """FA-2 Alg. 2 lines 11-20 for one tile: returns (p, ds), both fp32 [block_q, block_kv]."""
    s = scale * _dot(q, k, trans_b=True)
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)  # P_ij = exp(S_ij - L_i), 0 where masked
    dp = _dot(do, v, trans_b=True)  # dP_ij = dO_i V_j^T
    return p, p * (dp - delta[:, None])  # dS_ij = P_ij * (dP_ij - D_i)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
               scale, causal, window, block_kv, segments, preload):
    qs_ref, ks_ref, dq_ref = refs if segments else (None, None, *refs)
    n_kv = k_ref.shape[0] // block_kv
    k_rows, v_rows, kp_rows = (_Rows(r, preload) for r in (k_ref, v_ref, kp_ref))
    ks_rows = _Rows(ks_ref, preload) if segments else None
    q, do, lse, delta, q_pos = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], qp_ref[...]
    q_seg = qs_ref[...] if segments else None
    q_lo, q_hi, qs_lo, qs_hi = _bounds(q_pos, q_seg)

    def kv_tile(j, dq):
        kv = pl.ds(j * block_kv, block_kv)
        k_pos, k_seg = kp_rows[kv], (ks_rows[kv] if segments else None)
        k_lo, k_hi, ks_lo, ks_hi = _bounds(k_pos, k_seg)

        def compute(dq):
            k, v = k_rows[kv, :], v_rows[kv, :]
            mask = tile_mask(q_pos[:, None], k_pos[None, :], None if q_seg is None else q_seg[:, None],
                             None if k_seg is None else k_seg[None, :], causal=causal, window=window)
            _, ds = _tile_grads(q, k, v, do, lse, delta, mask, scale)
            return dq + scale * _dot(ds.astype(k.dtype), k)  # dQ_i += dS_ij K_j

        visible = tile_visible(q_lo, q_hi, k_lo, k_hi, qs_lo, qs_hi, ks_lo, ks_hi, causal=causal, window=window)
        return lax.cond(visible, compute, lambda c: c, dq)

    dq_ref[...] = lax.fori_loop(0, n_kv, kv_tile, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
                scale, causal, window, block_q, group, segments, preload):
    qs_ref, ks_ref, dk_ref, dv_ref = refs if segments else (None, None, *refs)
    n_q = q_ref.shape[0] // block_q
    q_rows, do_rows, lse_rows, delta_rows, qp_rows = (
        _Rows(r, preload) for r in (q_ref, do_ref, lse_ref, delta_ref, qp_ref))
    qs_rows = _Rows(qs_ref, preload) if segments else None
    k, v, k_pos = k_ref[...], v_ref[...], kp_ref[...]  # (block_kv, d), (block_kv,)
    k_seg = ks_ref[...] if segments else None
    k_lo, k_hi, ks_lo, ks_hi = _bounds(k_pos, k_seg)
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32))
    for g in range(group):  # the query heads that share this kv head (GQA): dK, dV summed over them

        def q_tile(i, carry, g=g):
            rows = pl.ds(i * block_q, block_q)
            q_pos, q_seg = qp_rows[rows], (qs_rows[rows] if segments else None)
            q_lo, q_hi, qs_lo, qs_hi = _bounds(q_pos, q_seg)

            def compute(carry):
                dk, dv = carry
                q, do = q_rows[rows, g, :], do_rows[rows, g, :]  # (block_q, d)
                mask = tile_mask(q_pos[:, None], k_pos[None, :], None if q_seg is None else q_seg[:, None],
                                 None if k_seg is None else k_seg[None, :], causal=causal, window=window)
                p, ds = _tile_grads(q, k, v, do, lse_rows[g, rows], delta_rows[g, rows], mask, scale)
                dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # dV_j += P_ij^T dO_i
                dk = dk + scale * _dot(ds.astype(q.dtype), q, trans_a=True)  # dK_j += dS_ij^T Q_i
                return dk, dv

            visible = tile_visible(q_lo, q_hi, k_lo, k_hi, qs_lo, qs_hi, ks_lo, ks_hi, causal=causal, window=window)
            return lax.cond(visible, compute, lambda c: c, carry)

        carry = lax.fori_loop(0, n_q, q_tile, carry)
    dk_ref[...], dv_ref[...] = carry


def hop_bwd(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window,
            block_q, block_kv):
    """One hop's gradients (FA-2 Alg. 2) from the final lse and delta = rowsum(do * o_final).

    lse, delta float32 [b, h, sq]. Returns dq float32 [b, sq, h, d], dk, dv float32 [b, sk, hk, d]
    (summed over the GQA group), and None for dbias.
    """
    check_bwd_args("pallas_gpu.hop_bwd", q, do, lse, delta)
    return _backward(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, **_prepare(
        "pallas_gpu.hop_bwd", q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _backward(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window, block_q,
              block_kv, interpret):
    """The two backward pallas_calls (dQ; dK and dV)."""
    q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg = same_vma(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg)
    (b, sq, h, d), (sk, hk) = q.shape, k.shape[1:3]
    group, d_pad = h // hk, pl.next_power_of_2(d)
    segments = q_seg is not None
    q, k, v, do = (_pad_dim(x, d_pad) for x in (q, k, v, do))
    pos = [q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)]
    pos += [q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)] if segments else []
    args = (q, k, v, do, lse.astype(jnp.float32), delta.astype(jnp.float32), *pos)
    static = dict(scale=scale, causal=causal, window=window, segments=segments, preload=_preload(interpret, q))

    # dQ: one program per (batch, head, Q tile), looping over K/V tiles.
    q_tile = pl.BlockSpec((None, block_q, None, d_pad), lambda bi, hi, i: (bi, i, hi, 0))
    kv_all = pl.BlockSpec((None, sk, None, d_pad), lambda bi, hi, i: (bi, 0, hi // group, 0))
    stat = pl.BlockSpec((None, None, block_q), lambda bi, hi, i: (bi, hi, i))
    q_row = pl.BlockSpec((None, block_q), lambda bi, hi, i: (bi, i))
    k_row = pl.BlockSpec((None, sk), lambda bi, hi, i: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_kv=block_kv, **static),
        grid=(b, h, sq // block_q),
        in_specs=[q_tile, kv_all, kv_all, q_tile, stat, stat, q_row, k_row] + ([q_row, k_row] if segments else []),
        out_specs=q_tile, out_shape=out_struct((b, sq, h, d_pad), jnp.float32, q),
        compiler_params=_params(d_pad), interpret=interpret, name="ring_hop_bwd_dq",
    )(*args)

    # dK, dV: one program per (batch, kv head, K/V tile), looping over its group's heads and Q tiles.
    q_all = pl.BlockSpec((None, sq, group, d_pad), lambda bi, gi, j: (bi, 0, gi, 0))
    kv_tile = pl.BlockSpec((None, block_kv, None, d_pad), lambda bi, gi, j: (bi, j, gi, 0))
    stat_all = pl.BlockSpec((None, group, sq), lambda bi, gi, j: (bi, gi, 0))
    q_row = pl.BlockSpec((None, sq), lambda bi, gi, j: (bi, 0))
    k_row = pl.BlockSpec((None, block_kv), lambda bi, gi, j: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=block_q, group=group, **static),
        grid=(b, hk, sk // block_kv),
        in_specs=[q_all, kv_tile, kv_tile, q_all, stat_all, stat_all, q_row, k_row]
        + ([q_row, k_row] if segments else []),
        out_specs=[kv_tile, kv_tile],
        out_shape=[out_struct((b, sk, hk, d_pad), jnp.float32, q)] * 2,
        compiler_params=_params(d_pad), interpret=interpret, name="ring_hop_bwd_dkv",
    )(*args)
    return dq[..., :d], dk[..., :d], dv[..., :d], None
