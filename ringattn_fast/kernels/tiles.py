"""What the Pallas kernels share: tile bounds and the empty-tile table, their preconditions, the per-hop
entry points, interpret mode and ``shard_map`` typing.

Masks come from ``ringattn_fast.masks`` (the vocabulary of ``ringattn_ref.masks``): a kernel calls
`bounds_empty` on the min/max of a tile's positions and segment ids (computed in the kernel, or
computed here by `tile_bounds` and scalar-prefetched) to skip it, and `allowed` on a column of query
positions against a row of key positions for the tile's mask. Both use differences of positions only,
so int32 positions in ``[0, 2**31)`` never overflow. `empty_tiles` evaluates the test for all tiles at
once (tests, cost models, figures, and the fused kernel's SMEM tables).

A kernel assumes a validated call (``ringattn_fast.front`` checks every argument once) and checks only
its own preconditions here (`check_kernel_call`): no bias, 16/32-bit inputs of one dtype, tiles that
divide the shard. Non-finite keys (docs/design.md): the kernels take K/V as the ring hands them, marked
once per ring by ``masks.mark_bad_keys``; what is left to them (``masks.finite_part``,
``masks.masked_grad``, shared with the XLA hop): dQ multiplies dS with the finite part of K, and dS is
zeroed with ``where`` where P is 0 (never ``0 * nan``).

Programmable attention (docs/design.md): `Program` is what a kernel applies to a tile's scaled logits
beyond the built-in mask, in the XLA hop's order: ``logit_softcap``, ``score_fn``, ``mask_fn``. The
user functions are traced once at the kernel's tile shapes and their captured arrays (ALiBi's slopes)
become kernel inputs: a ``pallas_call`` refuses a kernel that captures an array.
"""
import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast._compat import check_fused_interpreter
from ringattn_fast.dispatch import check_kernel_dtypes
from ringattn_fast.kernels import IMPLS, budgets
from ringattn_fast.masks import bounds_empty, bounds_full
from ringattn_fast.mesh import current_device, vary_like, varying_axes
from ringattn_fast.schedule import HopGrads

NEG_INF = float("-inf")


# ---------------------------------------------------------------- tiles and the empty-tile table

def tile_bounds(pos, seg, block):
    """Per-tile (pos_min, pos_max, seg_min, seg_max): int32 [batch, n_tiles, 4].

    pos: int32 [batch, seq]; seg: int32 [batch, seq] or None (then the segment range is (0, 0)).
    """
    b, s = pos.shape
    n = s // block
    pos_t = pos.astype(jnp.int32).reshape(b, n, block)  # (b, n, block)
    seg_t = jnp.zeros_like(pos_t) if seg is None else seg.astype(jnp.int32).reshape(b, n, block)
    return jnp.stack([pos_t.min(-1), pos_t.max(-1), seg_t.min(-1), seg_t.max(-1)], axis=-1)


def by_kind(body, q_bounds, k_bounds, *, causal, window, skip_empty=True):
    """Run ``body(masked)`` in a TPU kernel for one tile, by its kind, from the tile's scalar bounds (SMEM
    reads, `masks.bounds_empty`'s ``(lo, hi[, seg_lo, seg_hi])``): not at all where `bounds_empty` proves it
    empty (``skip_empty``; off for a caller that tested it already), ``body(False)`` (no built-in mask
    computed) where `masks.bounds_full` proves every pair visible, ``body(True)`` on a partial tile. Without
    a built-in mask: ``body(False)``. Shared by the per-hop kernels (``pallas_tpu``) and the fused ring's
    (``fused_ring``), as splash attention's mask info does it: on a causal hop only the diagonal is masked."""
    full = bounds_full(q_bounds, k_bounds, causal=causal, window=window)
    if full is None:
        body(False)
        return
    partial = jnp.logical_not(full)
    if skip_empty:
        live = jnp.logical_not(bounds_empty(q_bounds, k_bounds, causal=causal, window=window))
        full, partial = live & full, live & partial
    pl.when(full)(lambda: body(False))
    pl.when(partial)(lambda: body(True))


def sub_tiles(fold, sub_bounds, sizes, split, *, causal, window):
    """A partial tile as ``split`` x ``split`` sub-tiles, each by its own kind (`by_kind` on ``sub_bounds(r,
    c)``, the (q, k) bounds of sub-tile row r, column c): an empty one skipped, a full one unmasked, only a
    partial one masked. ``fold(masked, query rows, key rows)`` computes one, with static slices of the
    tile's ``sizes`` = (block_q, block_kv), whichever way round the kernel's tile is. On the diagonal of a
    causal hop this skips a quarter of the tile at ``split`` = 2 (splash attention's compute sub-blocks do
    this along the keys)."""
    sub_q, sub_kv = sizes[0] // split, sizes[1] // split
    for r in range(split):
        for c in range(split):
            qp, kp = slice(r * sub_q, (r + 1) * sub_q), slice(c * sub_kv, (c + 1) * sub_kv)
            by_kind(lambda masked, qp=qp, kp=kp: fold(masked, qp, kp), *sub_bounds(r, c), causal=causal,
                    window=window)


def empty_tiles(q_pos, k_pos, q_seg=None, k_seg=None, *, causal, window, block_q, block_kv):
    """bool [batch, sq // block_q, sk // block_kv]: True for each tile the kernels skip (provably empty).

    The kernels' own test (`bounds_empty` on `tile_bounds`); heads do not change it. With 4
    contiguous tokens per host, causal, block 2: q_pos = [0..3], k_pos = [4..7] gives all True (a
    future K/V shard), k_pos = [0..3] gives [[F, T], [F, F]].
    """
    nb = 4 if q_seg is not None else 2
    qb = jnp.moveaxis(tile_bounds(q_pos, q_seg, block_q)[:, :, None, :nb], -1, 0)  # (nb, b, nq, 1)
    kb = jnp.moveaxis(tile_bounds(k_pos, k_seg, block_kv)[:, None, :, :nb], -1, 0)  # (nb, b, 1, nk)
    empty = bounds_empty(tuple(qb), tuple(kb), causal=causal, window=window)
    shape = (q_pos.shape[0], qb.shape[2], kb.shape[3])
    return jnp.zeros(shape, bool) if empty is None else jnp.broadcast_to(empty, shape)


def resident_blocks(empty):
    """int32 like ``empty [..., n]``: the block to hold at each step of the last (inner) axis.

    A computed step holds its own block; an empty (skipped) step keeps the block of the last computed
    step before it (or, before the first computed one, that one), so a pipelined kernel whose index map
    reads this table issues no DMA for a skipped tile (JAX's TPU flash / splash kernels do the same).
    Example: empty [T, F, T, T, F, T] -> [1, 1, 1, 1, 4, 4]; every step empty -> all 0.
    """
    n = empty.shape[-1]
    steps = jnp.arange(n, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(empty, -1, steps), axis=empty.ndim - 1)
    first = jnp.argmin(empty, axis=-1).astype(jnp.int32)[..., None]  # 0 when every step is empty
    return jnp.where(last >= 0, last, first).astype(jnp.int32)


# ---------------------------------------------------------------- preconditions and interpret mode

def interpret_mode(impl, device=None):
    """What ``pallas_call(interpret=...)`` needs for ``impl`` on ``device`` (default: the mesh in context,
    ``mesh.current_device``: inside ``shard_map`` its mesh's devices, real or abstract), never on
    ``jax.default_backend()``: lowering for an abstract TPU mesh on a CPU host lowers the real kernel.

    pallas_gpu: True on CPU (Triton interpreter), False on a GPU. pallas_tpu, pallas_tpu_fused: the
    TPU interpreter with race detection on CPU, False on a TPU. ValueError naming the impl and the
    platform anywhere else. pallas_tpu_fused interpreted on a JAX older than the fused interpreter
    needs: a RuntimeError naming the version (`_compat.check_fused_interpreter`), never a hang.
    """
    device = current_device() if device is None else device
    platform, row = device.platform, IMPLS[impl]
    if platform in row.interpreted:
        if impl == "pallas_tpu_fused":
            check_fused_interpreter()
        return True if impl == "pallas_gpu" else pltpu.InterpretParams(detect_races=True)
    if platform in row.compiled:
        return False
    other = "impl='pallas_tpu' or 'xla'" if impl == "pallas_gpu" else "impl='pallas_gpu' or 'xla'"
    raise ValueError(f"impl={impl!r} needs {'a GPU' if impl == 'pallas_gpu' else 'a TPU'} (or CPU, "
                     f"interpreted); the mesh's platform is {platform!r}: use {other} there")


def target_chip(interpret):
    """The `budgets.Chip` a compiled kernel is lowered for (the mesh's ``device_kind``), or None when
    interpreting (the interpreters have no VMEM or shared-memory limit)."""
    return None if interpret is not False else budgets.chip(current_device().device_kind)


def check_budget(impl, chip, estimate, cfg, *, q_blocks, kv_blocks, every_pass=None, shape=""):
    """``vmem_limit_bytes`` for ``cfg``'s tiles on ``chip`` (None: the default limit holds them) or a
    ValueError naming block_q / block_kv (`budgets.check_fit`). ``estimate(cfg)`` -> [Footprint] of this
    call's kernels; ``every_pass(cfg)``: those of the forward and every backward kernel, which a
    suggested pair must fit (None: ``estimate``); ``shape``: what the message names if none fits."""
    tiles = lambda bq, bk: estimate(dataclasses.replace(cfg, block_q=bq, block_kv=bk))  # noqa: E731
    every = None if every_pass is None else (
        lambda bq, bk: every_pass(dataclasses.replace(cfg, block_q=bq, block_kv=bk)))  # noqa: E731
    return budgets.check_fit(impl, chip, tiles, block_q=cfg.block_q, block_kv=cfg.block_kv,
                             q_blocks=q_blocks, kv_blocks=kv_blocks, hint_estimate=every, shape=shape)


def finite_keys(k):
    """``masks.finite_part(k)`` for a kernel: the non-finite test in float32, the result in k's dtype.

    Mosaic's non-finite test (``tpu.weird``) takes float32 vectors only: on a bfloat16 or float16 K the
    TPU backward kernels failed verification (``'tpu.weird' op Input type must be F32``)."""
    return jnp.where(jnp.isfinite(k.astype(jnp.float32)), k, jnp.zeros((), k.dtype))


def check_kernel_call(impl, qs, kv, cfg):
    """A kernel's own preconditions on (QShard, KVShard, HopConfig); returns ``cfg.resolve(...)`` (scale
    and tile sides filled in, tiles clamped to the shard).

    Everything else about the call was validated at the front door (``ringattn_fast.front``). Raises
    ValueError naming the impl, the argument, what was received and what is needed. ``logit_softcap``,
    ``mask_fn``, ``score_fn`` (`Program`) and a value width of its own (v [b, sk, hk, d_v]) are every
    kernel's.
    """
    if kv.bias is not None:
        raise ValueError(f"impl={impl!r}: the Pallas kernels take no bias; use impl='xla' (got bias of "
                         f"shape {getattr(kv.bias, 'shape', None)})")
    check_kernel_dtypes(impl, qs.q, kv.k, kv.v)
    sq, sk = qs.q.shape[1], kv.k.shape[1]
    cfg = cfg.resolve(qs.q.shape[-1], sq, sk)
    if sq % cfg.block_q or sk % cfg.block_kv:
        raise ValueError(f"impl={impl!r}: block_q must divide sq and block_kv must divide sk; got "
                         f"block_q={cfg.block_q}, sq={sq}, block_kv={cfg.block_kv}, sk={sk}")
    return cfg


# ---------------------------------------------------------------- programmable logits

class Program(NamedTuple):
    """``HopConfig``'s soft-cap and user functions as a kernel applies them to one tile (`program`).

    In order on the scaled logits ``s`` (``kernels/xla.py``'s ``_logits``): ``softcap`` c (``c tanh(s / c)``,
    Gemma 2), ``score`` (``score_fn``), ``mask`` (``mask_fn``, beside the built-in mask). ``score`` and
    ``mask`` are the user functions traced at the kernel's tile shapes (``ringattn_ref.variants``'
    conventions with the batch and head axes of one tile: q_pos, q_seg int32 [1, 1, bq, 1], k_pos, k_seg
    [1, 1, 1, bk], head [1, 1, 1, 1], s float32 [1, 1, bq, bk]) as jaxprs, or None; the arrays they
    captured are ``consts`` (``n_score`` of them the score's, then the mask's), which the kernel takes as
    inputs (`const_specs`) and hands back, read, to `programmed`.
    """
    softcap: float | None
    score: object
    mask: object
    consts: tuple
    n_score: int


def program(cfg, block_q, block_kv):
    """The :class:`Program` of a resolved ``cfg`` for ``block_q x block_kv`` tiles, or None (nothing to apply)."""
    if cfg.logit_softcap is None and cfg.score_fn is None and cfg.mask_fn is None:
        return None
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    col, row, head = i32((1, 1, block_q, 1)), i32((1, 1, 1, block_kv)), i32((1, 1, 1, 1))
    s = jax.ShapeDtypeStruct((1, 1, block_q, block_kv), jnp.float32)
    trace = lambda fn, *args: (None, ()) if fn is None else _hoisted(jax.make_jaxpr(fn)(*args))  # noqa: E731
    score, score_consts = trace(cfg.score_fn, s, col, row, head)
    mask, mask_consts = trace(cfg.mask_fn, col, row, col, row, head)
    return Program(cfg.logit_softcap, score, mask, score_consts + mask_consts, len(score_consts))


def _hoisted(closed):
    """(jaxpr, its captured arrays as jax arrays): a ClosedJaxpr's consts, to be passed in, not captured."""
    return closed.jaxpr, tuple(jnp.asarray(c) for c in closed.consts)


def const_specs(prog, spec):
    """The in_specs of ``prog.consts`` (a tuple, one ref each in the kernel; () without a program):
    ``spec(shape)`` -> a BlockSpec holding the whole array in every program."""
    return () if prog is None else tuple(spec(c.shape) for c in prog.consts)


def programmed(prog, consts, s, *, q_pos, k_pos, q_seg, k_seg, head, grad=False):
    """One tile's logits after ``prog``: ``(s, pullback)``; ``(s, None)`` without a program or ``grad``.

    s: float32 [bq, bk] scaled logits (before any mask); q_pos, q_seg: the tile's bq query positions and
    segment ids in any shape (a (bq,) vector, a (bq, 1) column), k_pos, k_seg the bk keys' (None segment
    ids: zeros, as the oracle gives the functions); head: the query head, an int32 scalar; consts: the
    values of ``prog.consts`` read from their refs. ``mask_fn`` sets -inf where False (built-in masks are
    the caller's). ``pullback(ds, p)`` takes dS of the returned logits (0 where P is 0) back to the scaled
    logits: through ``score_fn`` by ``jax.vjp`` of the traced function on the tile, then times
    ``1 - tanh^2``, each 0 where ``p`` is 0 (a masked pair's gradient stays 0, NaN or not).
    """
    if prog is None:
        return s, None
    bq, bk = s.shape
    if prog.score is not None or prog.mask is not None:  # (a soft-cap alone reads no positions)
        qp, kp = jnp.reshape(q_pos, (1, 1, bq, 1)), jnp.reshape(k_pos, (1, 1, 1, bk))
        qseg = jnp.zeros_like(qp) if q_seg is None else jnp.reshape(q_seg, (1, 1, bq, 1))
        kseg = jnp.zeros_like(kp) if k_seg is None else jnp.reshape(k_seg, (1, 1, 1, bk))
        hd = jnp.full((1, 1, 1, 1), head, jnp.int32)
    dcap = score_pull = None
    if prog.softcap is not None:
        t = jnp.tanh(s / prog.softcap)
        s, dcap = prog.softcap * t, 1.0 - t * t
    if prog.score is not None:
        score = lambda x: jax.core.eval_jaxpr(prog.score, consts[:prog.n_score], x, qp, kp, hd)[0]  # noqa: E731
        x = jnp.reshape(s, (1, 1, bq, bk))
        if grad:
            x, score_pull = jax.vjp(lambda x: score(x).astype(jnp.float32), x)
        else:
            x = score(x).astype(jnp.float32)
        s = jnp.reshape(x, (bq, bk))
    if prog.mask is not None:
        ok = jax.core.eval_jaxpr(prog.mask, consts[prog.n_score:], qp, kp, qseg, kseg, hd)[0]
        s = jnp.where(jnp.reshape(jnp.broadcast_to(ok, (1, 1, bq, bk)), (bq, bk)), s, NEG_INF)
    if not grad:
        return s, None

    def pullback(ds, p):
        if score_pull is not None:
            ds = jnp.where(p == 0, 0.0, jnp.reshape(score_pull(jnp.reshape(ds, (1, 1, bq, bk)))[0], (bq, bk)))
        if dcap is not None:  # dcap is NaN for a bad key: kept out where P is 0
            ds = jnp.where(p == 0, 0.0, ds * dcap)
        return ds
    return s, pullback


# ---------------------------------------------------------------- the per-hop entry points

class HopKernels(NamedTuple):
    """A per-hop kernel module's public functions (``docs/design.md``, "Per-hop contract")."""
    hop_fwd: Callable
    hop_bwd: Callable
    fwd_tile_counts: Callable


class Budget(NamedTuple):
    """What a kernel module tells `hop_kernels` about its memory: ``estimate(cfg, q_shape, k_shape,
    dtype, backward, d_v=v's width)`` -> [budgets.Footprint] (one per pallas_call, from its own block
    specs), and ``blocks(sq, sk)`` -> (block_q candidates, block_kv candidates) its tile rule allows on
    the chip."""
    estimate: Callable
    blocks: Callable


def hop_kernels(impl, forward, backward, tile_rule=None, budget=None):
    """The public functions of a per-hop kernel module from its two jitted halves.

    ``forward(qs, kv, *, cfg, interpret, count, vmem_limit) -> (o, lse, counts | None)``;
    ``backward(qs, kv, do, lse, delta, *, cfg, interpret, vmem_limit) -> (dq, dk, dv)``;
    ``tile_rule(cfg, sq, sk, interpret)``: the backend's own tile-shape rule (raises), or None;
    ``budget``: a :class:`Budget`, checked for every compiled call on the mesh's chip (`check_budget`)
    before anything is lowered; ``vmem_limit`` is what the chip needs set (None: its default).
    Every call is checked outside ``jit`` (`check_kernel_call`), so every call is checked.
    """
    def prepare(qs, kv, cfg, backward_pass):
        cfg, interpret = check_kernel_call(impl, qs, kv, cfg), interpret_mode(impl)
        sq, sk = qs.q.shape[1], kv.k.shape[1]
        if tile_rule is not None:
            tile_rule(cfg, sq, sk, interpret)
        chip, limit = target_chip(interpret), None
        if chip is not None and budget is not None:
            pass_ = lambda c, bwd: budget.estimate(c, qs.q.shape, kv.k.shape, qs.q.dtype, bwd,  # noqa: E731
                                                   d_v=kv.v.shape[-1])
            q_blocks, kv_blocks = budget.blocks(sq, sk)
            limit = check_budget(impl, chip, lambda c: pass_(c, backward_pass), cfg, q_blocks=q_blocks,
                                 kv_blocks=kv_blocks, every_pass=lambda c: pass_(c, False) + pass_(c, True),
                                 shape=f"head dim {qs.q.shape[-1]}, {jnp.dtype(qs.q.dtype).name}")
        return dict(cfg=cfg, interpret=interpret, vmem_limit=limit)

    def hop_fwd(qs, kv, cfg):
        """One hop's attention: o float32 [b, sq, h, d] (normalised within the hop; 0 where the row saw
        nothing), lse float32 [b, h, sq] (-inf there). qs: QShard(q [b, sq, h, d], pos int32 [b, sq],
        seg or None); kv: KVShard(k, v [b, sk, hk, d], pos, seg, bias None); cfg: HopConfig."""
        o, lse, _ = forward(qs, kv, count=False, **prepare(qs, kv, cfg, False))
        return o, lse

    def hop_bwd(qs, kv, cfg, *, do, lse, delta):
        """One hop's gradients (FA-2 Alg. 2) from the final lse and delta = rowsum(do * o_final) (minus
        the lse cotangent, if any). do like q; lse, delta float32 [b, h, sq]. Returns HopGrads(dq
        float32 [b, sq, h, d], dk, dv float32 [b, sk, hk, d] summed over the GQA group, None), at the
        tiles of ``cfg.bwd_blocks`` when it names them."""
        return HopGrads(*backward(qs, kv, do, lse, delta, **prepare(qs, kv, backward_cfg(cfg), True)), None)

    def fwd_tile_counts(qs, kv, cfg):
        """int32 [b, h, sq // block_q]: K/V tiles the forward kernel computed per Q tile (counted inside
        the kernel, where the skip test skips the increment too); equals ``(~empty_tiles(...)).sum(-1)``
        broadcast over heads."""
        return forward(qs, kv, count=True, **prepare(qs, kv, cfg, False))[2]

    return HopKernels(hop_fwd, hop_bwd, fwd_tile_counts)


def backward_cfg(cfg):
    """``cfg`` with the backward's own tiles (``HopConfig.bwd_blocks``) as its tiles, if it has them."""
    if cfg.bwd_blocks is None:
        return cfg
    block_q, block_kv = cfg.bwd_blocks
    return dataclasses.replace(cfg, block_q=block_q, block_kv=block_kv, bwd_blocks=None)


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
