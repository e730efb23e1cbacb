"""One ring hop as FlashAttention-2 kernels on Pallas Mosaic TPU (TPU; interpreted on CPU).

Same contract as `pallas_gpu` and `ringattn_fast.hop` (docs/design.md, "Per-hop contract").

Notation: FlashAttention-2 (Dao 2023, arXiv:2307.08691) -> code
  Br, Bc          block_q, block_kv.
  loops           both are grid axes: ``(batch, heads, sq // block_q, sk // block_kv)``; the K/V axis
                  is last and "arbitrary", so Mosaic runs it in order and the running statistics
                  live in VMEM scratch across it (``m_sc``, ``l_sc``, ``acc_sc``).
  skipping        the tiles' position/segment min/max are computed outside (`tiles.tile_bounds`) and
                  scalar-prefetched into SMEM (``PrefetchScalarGridSpec``); ``pl.when(visible)``
                  skips the compute of a tile whose mask is provably empty.
  S_ij, m, l, O   as in FA-2 Alg. 1: ``s = scale * q @ k.T`` (-inf where masked), ``m`` row max,
                  ``l`` row sum of exp(s - m), ``acc`` = unnormalised O (divided by l at the end).
  L_i, D_i        ``lse = m + log l`` (-inf for a row that saw nothing); ``delta = rowsum(dO * O)``.
  backward        Alg. 2 as two kernels: dQ (grid over Q tiles, K/V tiles last) and dK/dV (grid
                  over K/V tiles, then the GQA group's heads and the Q tiles last, so dK/dV are
                  summed over the group in VMEM scratch without atomics).

TPU tiling. Mosaic tiles the last two dims of every block in (8 sublanes x 128 lanes), so:
  * q, k, v, do are given to the kernels heads-major, ``[b, h, s, d]`` (one transpose outside):
    a block is (block_q, d) or (block_kv, d), with d the full last dim;
  * per-row statistics (m, l, lse, delta) and query positions are lane-replicated
    ``(block_q, 128)`` columns; key positions are sublane-replicated ``(8, block_kv)`` rows;
  * on a TPU block_q must be a multiple of 8 and block_kv a multiple of 128, unless the block is
    the whole shard (a block equal to the full dim is always legal).
  Rule for small test shapes: in interpret mode (CPU) block_kv may also be a multiple of 8, so a
  64-token test shard still has several K/V tiles to skip; the kernels are otherwise unchanged.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.tiles import (NEG_INF, check_bwd_args, check_hop_args, out_struct, same_vma,
                                         tile_bounds, tile_mask, tile_schedule, tile_visible)

__all__ = ["hop_fwd", "hop_bwd", "fwd_tile_counts", "tile_schedule", "INTERPRET_PARAMS"]

LANES, SUBLANES = 128, 8
_STATIC = ("scale", "causal", "window", "block_q", "block_kv", "interpret")
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
# Used on CPU. The race detector checks the kernels' VMEM/SMEM accesses (docs: issue 4 tests).
INTERPRET_PARAMS = pltpu.InterpretParams(detect_races=True)


def _interpret():
    """None on a TPU (compile with Mosaic), `INTERPRET_PARAMS` on CPU; other backends cannot run it."""
    backend = jax.default_backend()
    if backend in ("cpu", "tpu"):
        return INTERPRET_PARAMS if backend == "cpu" else False
    raise ValueError(f"impl='pallas_tpu' needs a TPU (or CPU, interpreted); the default backend is "
                     f"{backend!r}: use impl='pallas_gpu' or 'xla' there")


def _prepare(name, q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv):
    """Checks the call (incl. the tiling rule above; outside jit, so every call is checked) and
    returns the kernels' static args."""
    block_q, block_kv, _ = check_hop_args(name, q, k, v, q_pos, k_pos, q_seg, k_seg, bias,
                                          window, block_q, block_kv)
    interpret = _interpret()
    sq, sk, lane = q.shape[1], k.shape[1], SUBLANES if interpret else LANES
    if (block_q != sq and block_q % SUBLANES) or (block_kv != sk and block_kv % lane):
        raise ValueError(f"{name}: TPU tiles need block_q % {SUBLANES} == 0 (or block_q == sq) and "
                         f"block_kv % {lane} == 0 (or block_kv == sk); got block_q={block_q}, sq={sq}, "
                         f"block_kv={block_kv}, sk={sk}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window = None if window is None else tuple(int(w) for w in window)
    return dict(scale=scale, causal=bool(causal), window=window, block_q=block_q, block_kv=block_kv,
                interpret=interpret)


def _layout(q_pos, k_pos, q_seg, k_seg, block_q, block_kv):
    """Scalar-prefetch tile bounds (flat int32) and the lane/sublane-replicated position inputs."""
    b, sq = q_pos.shape
    sk = k_pos.shape[1]
    prefetch = [tile_bounds(q_pos, q_seg, block_q).reshape(-1), tile_bounds(k_pos, k_seg, block_kv).reshape(-1)]
    cols = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, :, None], (b, sq, LANES))  # (b, sq, 128)
    rows = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, None, :], (b, SUBLANES, sk))  # (b, 8, sk)
    pos = [cols(q_pos), rows(k_pos)] + ([cols(q_seg), rows(k_seg)] if q_seg is not None else [])
    return prefetch, pos


def _visible(qb_ref, kb_ref, bi, i, j, n_q, n_kv, causal, window):
    """The skip predicate from the scalar-prefetched bounds of Q tile i and K/V tile j."""
    qb = [qb_ref[(bi * n_q + i) * 4 + c] for c in range(4)]
    kb = [kb_ref[(bi * n_kv + j) * 4 + c] for c in range(4)]
    return tile_visible(qb[0], qb[1], kb[0], kb[1], qb[2], qb[3], kb[2], kb[3], causal=causal, window=window)


def _mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, window):
    """[block_q, block_kv] mask from a (block_q, 128) query column and an (8, block_kv) key row."""
    seg = qs_ref is not None
    return tile_mask(qp_ref[:, :1], kp_ref[:1, :], qs_ref[:, :1] if seg else None,
                     ks_ref[:1, :] if seg else None, causal=causal, window=window)


def _fwd_kernel(qb_ref, kb_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, scale, causal, window,
                segments, count, n_q, n_kv):
    refs = list(refs) if segments else [None, None, *refs]
    if not count:
        refs.insert(4, None)
    qs_ref, ks_ref, o_ref, lse_ref, count_ref, m_sc, l_sc, acc_sc = refs
    bi, hi, i, j = (pl.program_id(a) for a in range(4))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if count:
            count_ref[(bi * pl.num_programs(1) + hi) * n_q + i] = 0

    @pl.when(_visible(qb_ref, kb_ref, bi, i, j, n_q, n_kv, causal, window))
    def _compute():
        v = v_ref[...]
        s = scale * lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32)
        s = jnp.where(_mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, window), s, NEG_INF)  # (block_q, block_kv)
        m_prev = m_sc[...]  # (block_q, 128), lane-replicated
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: exp(-inf) = 0
        p = jnp.exp(s - m_safe[:, :1])
        alpha = jnp.exp(m_prev - m_safe)  # rescales the old l and acc to the new max
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_sc[...] = alpha[:, :1] * acc_sc[...] + pv
        if count:
            idx = (bi * pl.num_programs(1) + hi) * n_q + i
            count_ref[idx] = count_ref[idx] + 1

    @pl.when(j == n_kv - 1)
    def _finish():
        l, m = l_sc[...], m_sc[...]
        seen = l > 0.0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = jnp.where(seen[:, :1], acc_sc[...] / l_safe[:, :1], 0.0)
        lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), NEG_INF)


@functools.partial(jax.jit, static_argnames=_STATIC + ("count",))
def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window, block_q, block_kv, interpret, count):
    """pallas_call for the forward; returns (o, lse, computed K/V tiles per Q tile [b, h, nq] or None)."""
    q, k, v, q_pos, k_pos, q_seg, k_seg = same_vma(q, k, v, q_pos, k_pos, q_seg, k_seg)
    (b, sq, h, d), (sk, hk) = q.shape, k.shape[1:3]
    group = h // hk
    n_q, n_kv, segments = sq // block_q, sk // block_kv, q_seg is not None
    prefetch, pos = _layout(q_pos, k_pos, q_seg, k_seg, block_q, block_kv)
    q_tile = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    kv_tile = pl.BlockSpec((None, None, block_kv, d), lambda bi, hi, i, j, *_: (bi, hi // group, j, 0))
    q_col = pl.BlockSpec((None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, i, 0))
    k_row = pl.BlockSpec((None, SUBLANES, block_kv), lambda bi, hi, i, j, *_: (bi, 0, j))
    stat = pl.BlockSpec((None, None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    out_specs = [q_tile, stat]
    out_shape = [out_struct((b, h, sq, d), jnp.float32, q), out_struct((b, h, sq, LANES), jnp.float32, q)]
    if count:  # debug output: a counter per (batch, head, Q tile) in SMEM
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        out_shape.append(out_struct((b * h * n_q,), jnp.int32, q))
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, window=window, segments=segments,
                               count=count, n_q=n_q, n_kv=n_kv)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, h, n_q, n_kv),
            in_specs=[q_tile, kv_tile, kv_tile, q_col, k_row] + ([q_col, k_row] if segments else []),
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
                            pltpu.VMEM((block_q, d), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",) * 4 if count else ("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="ring_hop_fwd_tpu",
    )(*prefetch, q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), *pos)
    counts = out[2].reshape(b, h, n_q) if count else None
    return out[0].swapaxes(1, 2), out[1][..., 0], counts


def hop_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window, block_q, block_kv):
    """One hop's attention: o float32 [b, sq, h, d] (normalised within the hop), lse float32 [b, h, sq].

    q [b, sq, h, d]; k, v [b, sk, hk, d]; q_pos [b, sq], k_pos [b, sk] int32 true positions;
    q_seg, k_seg int32 or None; bias must be None (ValueError otherwise); window (left, right) or None.
    """
    o, lse, _ = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, count=False, **_prepare(
        "pallas_tpu.hop_fwd", q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv))
    return o, lse


def fwd_tile_counts(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, scale=None, causal, window,
                    block_q, block_kv):
    """int32 [b, h, sq // block_q]: K/V tiles the forward kernel computed per Q tile (debug build).

    Incremented in SMEM inside the kernel's ``pl.when(visible)`` body; equals
    ``tile_schedule(...).sum(-1)`` broadcast over heads.
    """
    return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, count=True, **_prepare(
        "pallas_tpu.fwd_tile_counts", q, k, v, q_pos, k_pos, q_seg, k_seg, None, scale, causal, window,
        block_q, block_kv))[2]


def _tile_grads(q, k, v, do, lse, delta, mask, scale):
    """FA-2 Alg. 2 lines 11-20 for one tile: (p, ds), fp32 [block_q, block_kv]; lse, delta (block_q, 128)."""
    s = scale * lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    p = jnp.where(mask, jnp.exp(s - lse[:, :1]), 0.0)  # P_ij = exp(S_ij - L_i), 0 where masked
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)  # dP_ij = dO_i V_j^T
    return p, p * (dp - delta[:, :1])  # dS_ij = P_ij * (dP_ij - D_i)


def _dq_kernel(qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
               scale, causal, window, segments, n_q, n_kv):
    qs_ref, ks_ref, dq_ref, acc_sc = refs if segments else (None, None, *refs)
    bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_visible(qb_ref, kb_ref, bi, i, j, n_q, n_kv, causal, window))
    def _compute():
        k = k_ref[...]
        mask = _mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, window)
        _, ds = _tile_grads(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], mask, scale)
        acc_sc[...] += scale * lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)  # dQ_i += dS_ij K_j

    @pl.when(j == n_kv - 1)
    def _finish():
        dq_ref[...] = acc_sc[...]


def _dkv_kernel(qb_ref, kb_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
                scale, causal, window, segments, n_q, n_kv, group):
    qs_ref, ks_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs if segments else (None, None, *refs)
    bi, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_visible(qb_ref, kb_ref, bi, i, j, n_q, n_kv, causal, window))
    def _compute():
        q, do = q_ref[...], do_ref[...]
        mask = _mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, window)
        p, ds = _tile_grads(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask, scale)
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
        dk_sc[...] += scale * lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)

    @pl.when((g == group - 1) & (i == n_q - 1))
    def _finish():
        dk_ref[...] = dk_sc[...]
        dv_ref[...] = dv_sc[...]


def hop_bwd(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window,
            block_q, block_kv):
    """One hop's gradients (FA-2 Alg. 2) from the final lse and delta = rowsum(do * o_final).

    lse, delta float32 [b, h, sq]. Returns dq float32 [b, sq, h, d], dk, dv float32 [b, sk, hk, d]
    (summed over the GQA group), and None for dbias.
    """
    check_bwd_args("pallas_tpu.hop_bwd", q, do, lse, delta)
    return _backward(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, **_prepare(
        "pallas_tpu.hop_bwd", q, k, v, q_pos, k_pos, q_seg, k_seg, bias, scale, causal, window, block_q, block_kv))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _backward(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window, block_q,
              block_kv, interpret):
    """The two backward pallas_calls (dQ; dK and dV)."""
    q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg = same_vma(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg)
    (b, sq, h, d), (sk, hk) = q.shape, k.shape[1:3]
    group = h // hk
    n_q, n_kv, segments = sq // block_q, sk // block_kv, q_seg is not None
    prefetch, pos = _layout(q_pos, k_pos, q_seg, k_seg, block_q, block_kv)
    stats = [jnp.broadcast_to(x.astype(jnp.float32)[..., None], (b, h, sq, LANES)) for x in (lse, delta)]
    args = (*prefetch, q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), do.swapaxes(1, 2), *stats, *pos)
    static = dict(scale=scale, causal=causal, window=window, segments=segments, n_q=n_q, n_kv=n_kv)
    params = lambda n_grid: pltpu.CompilerParams(  # batch, heads, Q or K/V tiles in parallel; the rest in order
        dimension_semantics=("parallel",) * 3 + ("arbitrary",) * (n_grid - 3))

    # dQ: grid (b, h, Q tiles, K/V tiles), K/V tiles last.
    q_tile = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    kv_tile = pl.BlockSpec((None, None, block_kv, d), lambda bi, hi, i, j, *_: (bi, hi // group, j, 0))
    stat = pl.BlockSpec((None, None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0))
    q_col = pl.BlockSpec((None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, i, 0))
    k_row = pl.BlockSpec((None, SUBLANES, block_kv), lambda bi, hi, i, j, *_: (bi, 0, j))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, h, n_q, n_kv),
            in_specs=[q_tile, kv_tile, kv_tile, q_tile, stat, stat, q_col, k_row]
            + ([q_col, k_row] if segments else []),
            out_specs=q_tile, scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)]),
        out_shape=out_struct((b, h, sq, d), jnp.float32, q),
        compiler_params=params(4), interpret=interpret, name="ring_hop_bwd_dq_tpu",
    )(*args)

    # dK, dV: grid (b, kv heads, K/V tiles, group heads, Q tiles); the last two accumulate in scratch.
    q_tile = pl.BlockSpec((None, None, block_q, d), lambda bi, gi, j, g, i, *_: (bi, gi * group + g, i, 0))
    kv_tile = pl.BlockSpec((None, None, block_kv, d), lambda bi, gi, j, g, i, *_: (bi, gi, j, 0))
    stat = pl.BlockSpec((None, None, block_q, LANES), lambda bi, gi, j, g, i, *_: (bi, gi * group + g, i, 0))
    q_col = pl.BlockSpec((None, block_q, LANES), lambda bi, gi, j, g, i, *_: (bi, i, 0))
    k_row = pl.BlockSpec((None, SUBLANES, block_kv), lambda bi, gi, j, g, i, *_: (bi, 0, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, group=group, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, hk, n_kv, group, n_q),
            in_specs=[q_tile, kv_tile, kv_tile, q_tile, stat, stat, q_col, k_row]
            + ([q_col, k_row] if segments else []),
            out_specs=[kv_tile, kv_tile],
            scratch_shapes=[pltpu.VMEM((block_kv, d), jnp.float32)] * 2),
        out_shape=[out_struct((b, hk, sk, d), jnp.float32, q)] * 2,
        compiler_params=params(5), interpret=interpret, name="ring_hop_bwd_dkv_tpu",
    )(*args)
    return dq.swapaxes(1, 2), dk.swapaxes(1, 2), dv.swapaxes(1, 2), None
