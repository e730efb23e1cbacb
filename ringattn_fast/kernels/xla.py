"""``impl="xla"``: one ring hop in XLA: blockwise attention of the local queries against the K/V shard held now.

Implements the per-hop contract of ``docs/design.md`` (the Pallas kernels implement the same one;
``ringattn_ref.hop_attention`` and ``hop_attention_vjp`` are its float64 oracles)::

    hop_fwd(qs: QShard, kv: KVShard, cfg: HopConfig)
        -> o float [b, sq, h, d] normalised within the hop, lse float [b, h, sq]
    hop_bwd(qs, kv, cfg, *, do, lse, delta)
        -> HopGrads(dq [b, sq, h, d], dk, dv [b, sk, hk, d] summed over the GQA group, dbias like kv.bias)

This is the Blockwise Parallel Transformer's inner loop (arXiv:2305.19370 §3; Ring Attention,
arXiv:2310.01889, Algorithm 1) written as FlashAttention-2 (arXiv:2307.08691): queries in ``block_q``
chunks (Br), the K/V shard in ``block_kv`` chunks (Bc), an online softmax ``(o, m, l)`` per query
chunk, so only one ``block_q x block_kv`` tile of logits is alive: temp memory is linear in the local
sequence. Each tile is classified from min/max positions (``masks.tile_kind``): empty tiles are
skipped, full tiles run without a mask, only tiles on a mask boundary pay for it.

Layout for speed: inputs are cut once per hop into chunk-major, head-major pieces
(``[n, b, hk, group*block, d]``), so every tile is a plain batched matmul over ``(b, hk)`` and GQA costs
nothing: the ``group`` query heads that share a kv head are folded into the tile's rows (K/V are never
repeated). The scale is folded into q (``O(s d)`` work instead of ``O(s^2)``). Accumulation is float32
for 16/32-bit inputs and float64 for float64. ``kv.bias`` is ``[b|1, h|1, sq|1, sk|1]``, added to the
scaled logits (mirrors ``ringattn_ref.blockwise``); a -inf bias masks its pair whatever the logit.
``cfg.logit_softcap`` c: the scaled logits become ``c tanh(s / c)`` first (Gemma 2); 1/c is folded into
q's scale too (no O(s^2) division), and the backward multiplies dS by ``1 - tanh(s / c)^2`` and dK by c.
Non-finite keys (``docs/design.md``): the ring hands the hop finite V and an all-NaN K for each key
that held a nan/inf (``masks.mark_bad_keys``), so a mask hides such a key and exactly the rows that
see it turn NaN; the hop only keeps K's NaN out of ``dQ = dS K`` where a mask hid the key.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ringattn_ref.dropout import keep_scale, row_hash

from ringattn_ref.shards import default_block

from ringattn_fast import block_mask, masks
from ringattn_fast.mesh import varying_axes, vary_like
from ringattn_fast.schedule import HopGrads
from ringattn_fast.softmax import acc_dtype


XLA_TPU_BLOCK = 1024


def default_blocks(q_shape, k_shape, dtype, device, *, n=None):
    """``(block_q, block_kv)`` of the XLA hop when the caller gives none: on a TPU the largest divisors of
    the shards up to :data:`XLA_TPU_BLOCK`; elsewhere None (``default_block``'s 128, measured fastest on
    CPU). On a TPU v5e a 32K-token hop at 128 x 128 is 65,536 tiles, whose per-tile control flow (the
    skip/full/partial switch) made a causal hop slower than a plain one (972 vs 664 ms fwd+bwd); large
    tiles are few enough for the skipped ones to save their time."""
    if device.platform != "tpu":
        return None
    return default_block(q_shape[1], XLA_TPU_BLOCK), default_block(k_shape[1], XLA_TPU_BLOCK)


def _q_chunks(x, hk, block):
    """[b, s, h, d] -> [n, b, hk, group*block, d]: chunk-major, head-major, GQA group folded into rows."""
    b, s, h, d = x.shape
    x = x.reshape(b, s // block, block, hk, h // hk, d)
    return jnp.transpose(x, (1, 0, 3, 4, 2, 5)).reshape(s // block, b, hk, (h // hk) * block, d)


def _q_unchunk(x, group):
    """Inverse of :func:`_q_chunks`: [n, b, hk, group*block, d] -> [b, s, h, d]."""
    n, b, hk, gq, d = x.shape
    x = jnp.transpose(x.reshape(n, b, hk, group, gq // group, d), (1, 0, 4, 2, 3, 5))
    return x.reshape(b, n * (gq // group), hk * group, d)


def _kv_chunks(x, block):
    """[b, s, hk, d] -> [n, b, hk, block, d]."""
    b, s, hk, d = x.shape
    return jnp.transpose(x.reshape(b, s // block, block, hk, d), (1, 0, 3, 2, 4))


def _kv_unchunk(x):
    """Inverse of :func:`_kv_chunks`."""
    n, b, hk, block, d = x.shape
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, n * block, hk, d)


def _stat_chunks(x, hk, block):
    """[b, h, s] -> [n, b, hk, group*block] (rows ordered like :func:`_q_chunks`)."""
    b, h, s = x.shape
    x = x.reshape(b, hk, h // hk, s // block, block)
    return jnp.transpose(x, (3, 0, 1, 2, 4)).reshape(s // block, b, hk, (h // hk) * block)


def _stat_unchunk(x, group):
    n, b, hk, gq = x.shape
    return jnp.transpose(x.reshape(n, b, hk, group, gq // group), (1, 2, 3, 0, 4)).reshape(b, hk * group, n * (gq // group))


def _pos_chunks(x, block):
    """[b, s] -> [n, b, block] (None stays None)."""
    if x is None:
        return None
    b, s = x.shape
    return jnp.swapaxes(x.reshape(b, s // block, block), 0, 1)


def _rows(x, start, size, axis):
    """``x[start:start+size]`` along ``axis``; a broadcast (size-1) axis or None is left alone."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _q_scale(cfg):
    """What q is pre-multiplied by: the softmax scale, over c with a soft-cap c, so the logits arrive as
    ``s / c`` and `_softcap` spends no O(s^2) division (the backward multiplies dK by c: `_hop_bwd`)."""
    return cfg.scale if cfg.logit_softcap is None else cfg.scale / cfg.logit_softcap


def _softcap(s, softcap):
    """Gemma 2's soft-capping ``c * tanh(s / c)`` of logits that arrive as ``s / c`` (`_q_scale`; None: s
    as it is) and its derivative ``1 - tanh^2`` (with respect to s)."""
    if softcap is None:
        return s, None
    t = jnp.tanh(s)
    return softcap * t, 1.0 - t * t


class _UserFns(NamedTuple):
    """A tile's user functions (``HopConfig.mask_fn`` / ``score_fn``, ``ringattn_ref.variants``) and the
    grid they are called on: q_pos, q_seg [b, 1, bq, 1], k_pos, k_seg [b, 1, 1, bkv], head [1, h, 1, 1]."""
    mask_fn: Callable | None
    score_fn: Callable | None
    grid: tuple


def _user_fns(cfg, q_pos, k_pos, q_seg, k_seg, heads, masked=True, head_offset=None):
    """The tile's :class:`_UserFns`, or None when the config has neither function (``mask_fn`` only on a
    ``masked`` tile: a full one needs no mask at all). head_offset: the global index of this host's first
    query head where the heads are split over hosts (Ulysses, ``head_axis``), else None (0)."""
    mask_fn = cfg.mask_fn if masked else None
    if mask_fn is None and cfg.score_fn is None:
        return None
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    qs = jnp.zeros_like(qp) if q_seg is None else q_seg[:, None, :, None]
    ks = jnp.zeros_like(kp) if k_seg is None else k_seg[:, None, None, :]
    head = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    head = head if head_offset is None else head + head_offset.astype(jnp.int32)
    return _UserFns(mask_fn, cfg.score_fn, (qp, kp, qs, ks, head))


def _heads_first(x, heads):
    """(b, hk, group*bq, bkv) -> (b, h, bq, bkv): query head ``h = kv_head * group + member``."""
    b, _, gq, bkv = x.shape
    return x.reshape(b, heads, gq * x.shape[1] // heads, bkv)


def _rows_first(x, hk):
    """Inverse of :func:`_heads_first`: (b, h, bq, bkv) -> (b, hk, group*bq, bkv)."""
    b, h, bq, bkv = x.shape
    return x.reshape(b, hk, (h // hk) * bq, bkv)


def _user_mask(fns, shape, hk):
    """``mask_fn`` on the tile, laid out like the logits (b, hk, group*bq, bkv)."""
    qp, kp, qs, ks, head = fns.grid
    b, _, gq, bkv = shape
    h = head.shape[1]
    return _rows_first(jnp.broadcast_to(fns.mask_fn(qp, kp, qs, ks, head), (b, h, gq * hk // h, bkv)), hk)


def _logits(q_i, k_j, bias_ij, mask_ij, group, acc, *, softcap=None, fns=None):
    """Biased, masked logits of one tile: q_i (b, hk, group*bq, d) pre-scaled, k_j (b, hk, bkv, d);
    soft-capped first with ``softcap``, then ``fns.score_fn``; ``fns.mask_fn`` masks with the built-ins."""
    s = jnp.einsum("bkqd,bksd->bkqs", q_i, k_j, preferred_element_type=acc)  # (b, hk, group*bq, bkv)
    s, _ = _softcap(s, softcap)
    hk = s.shape[1]
    if fns is not None and fns.score_fn is not None:
        qp, kp, _, _, head = fns.grid
        s = _rows_first(fns.score_fn(_heads_first(s, head.shape[1]), qp, kp, head).astype(acc), hk)
    if fns is not None and fns.mask_fn is not None:
        s = jnp.where(_user_mask(fns, s.shape, hk), s, -jnp.inf)
    if bias_ij is None and mask_ij is None:
        return s
    b, hk, gq, bkv = s.shape
    s = s.reshape(b, hk, group, gq // group, bkv)
    if bias_ij is not None:
        bb, bh, bq, bk = bias_ij.shape
        bias_b = bias_ij.astype(acc).reshape(bb, hk if bh > 1 else 1, group if bh > 1 else 1, bq, bk)
        s = jnp.where(bias_b == -jnp.inf, -jnp.inf, s + bias_b)  # -inf masks even a NaN logit
    if mask_ij is not None:
        s = jnp.where(mask_ij[:, None, None], s, -jnp.inf)
    return s.reshape(b, hk, gq, bkv)


def _forward_order(n_kv_tiles):
    """Whether the backward recomputes the logits as the forward's own product (`_logits_t`): where the
    hop's keys are one tile (``n_kv_tiles == 1``: few keys, so each ``P`` is large and every key's dV sums
    its error over all the queries), off a TPU. XLA CPU sums ``K Q^T`` in another order than ``Q K^T``; the
    barrier that keeps the forward's order costs a transpose of every tile (8 % of the default CPU
    benchmark's forward+backward, where a hop holds 8 key tiles and the mismatch is far below float32
    tolerances), and on a TPU a pass through HBM per tile, where the MXU's order is its own anyway."""
    return n_kv_tiles == 1 and jax.default_backend() != "tpu"


def _logits_t(k_j, q_i, bias_ij, mask_ij, group, acc, *, softcap=None, fns=None, forward_order=True):
    """The tile's logits transposed, ``S^T`` (b, hk, bkv, group*bq), for the backward: k_j (b, hk, bkv, d),
    q_i (b, hk, group*bq, d) pre-scaled; bias, mask, softcap and user functions as in :func:`_logits`.
    Returns ``(S^T, d softcap / d s, score_vjp)``: the softcap's derivative (None without one) and the
    pullback of ``score_fn`` on dS^T (None without one: autodiff of the user's function, per tile).

    ``S`` is the forward's own product (:func:`_logits`' einsum, same operands and layout), transposed
    after: ``P = exp(S - lse)`` then uses the very logits ``lse`` came from. Written as ``K Q^T`` (or
    with the transpose folded into the dot, which XLA does unless a barrier stops it), XLA CPU sums the
    ``d`` products in another order (2x the error on 64 positive terms) and ``P`` no longer matches
    ``lse``: with 256 queries on 8 keys dV summed that mismatch to 3e-5 (``jax.nn``: 1e-5). Without
    ``forward_order`` (several key tiles, or a TPU: `_forward_order`) ``S^T = K Q^T`` directly, no
    transpose of the tile."""
    if forward_order:  # q_i: Q (b, hk, group*bq, d)
        s = jnp.einsum("bkqd,bksd->bkqs", q_i, k_j, preferred_element_type=acc)  # (b, hk, group*bq, bkv)
        st = jnp.swapaxes(lax.optimization_barrier(s), -1, -2)  # the barrier keeps the transpose out of the dot
    else:  # q_i: Q^T (b, hk, d, group*bq), laid out once per hop: a plain matmul
        st = jnp.einsum("bksd,bkdq->bksq", k_j, q_i, preferred_element_type=acc)  # (b, hk, bkv, group*bq)
    st, dcap = _softcap(st, softcap)
    hk, score_vjp = st.shape[1], None
    if fns is not None and fns.score_fn is not None:
        qp, kp, _, _, head = fns.grid
        flip = lambda x: jnp.swapaxes(x, -1, -2)  # noqa: E731
        scored, pull = jax.vjp(lambda s: fns.score_fn(s, qp, kp, head).astype(acc),
                               _heads_first(flip(st), head.shape[1]))
        st = flip(_rows_first(scored, hk))
        score_vjp = lambda dst: flip(_rows_first(pull(_heads_first(flip(dst), head.shape[1]))[0], hk))  # noqa: E731
    if fns is not None and fns.mask_fn is not None:
        st = jnp.where(jnp.swapaxes(_user_mask(fns, jnp.swapaxes(st, -1, -2).shape, hk), -1, -2), st, -jnp.inf)
    if bias_ij is None and mask_ij is None:
        return st, dcap, score_vjp
    b, hk, bkv, gq = st.shape
    st = st.reshape(b, hk, bkv, group, gq // group)
    if bias_ij is not None:  # (bb, bh, bq, bk) -> (bb, hk|1, bk, group|1, bq)
        bb, bh, bq, bk = bias_ij.shape
        bias_t = bias_ij.astype(acc).reshape(bb, hk if bh > 1 else 1, group if bh > 1 else 1, bq, bk)
        bias_t = jnp.transpose(bias_t, (0, 1, 4, 2, 3))
        st = jnp.where(bias_t == -jnp.inf, -jnp.inf, st + bias_t)
    if mask_ij is not None:  # (b, bq, bkv) -> (b, 1, bkv, 1, bq)
        st = jnp.where(jnp.swapaxes(mask_ij, 1, 2)[:, None, :, None, :], st, -jnp.inf)
    return st.reshape(b, hk, bkv, gq), dcap, score_vjp


def _drop_rows(drop, q_pos, hk, group, block):
    """Dropout row hashes of every query chunk, rows ordered like :func:`_q_chunks`: [n, b, hk, group*block]
    (uint32), or None without dropout. q_pos: [b, sq] true positions."""
    if drop is None:
        return None
    b, sq = q_pos.shape
    batch = (jnp.arange(b, dtype=jnp.uint32) + drop.batch_offset)[:, None, None, None]  # (b, 1, 1, 1)
    head = (jnp.arange(hk * group, dtype=jnp.uint32) + drop.head_offset).reshape(1, hk, group, 1)
    rows = row_hash(drop.seed, batch, head, q_pos[:, None, None, :])  # (b, hk, group, sq)
    rows = rows.reshape(b, hk, group, sq // block, block)
    return jnp.transpose(rows, (3, 0, 1, 2, 4)).reshape(sq // block, b, hk, group * block)


def _by_kind(tile, carry, skipped, where, cfg, *, per_tile, user_kind=None):
    """Run ``tile(carry, True)`` on a partial tile, ``tile(carry, False)`` on a full one, and
    return ``skipped(carry)`` on an empty one; no branch at all unless ``per_tile``.
    where: the tile's ``(q_pos, k_pos, q_seg, k_seg)`` (segment ids None without them); user_kind: the
    tile's kind in ``mask_fn``'s static block mask (``ringattn_fast.block_mask``), or None: then a
    ``mask_fn`` makes every tile that the built-ins leave non-empty partial."""
    if not per_tile:
        return tile(carry, False)
    kind = _with_user(cfg, masks.tile_kind(*where, causal=cfg.causal, window=cfg.window), user_kind)
    return lax.switch(kind, [skipped, lambda c: tile(c, False), lambda c: tile(c, True)], carry)


def _with_user(cfg, kind, user_kind):
    """The built-in masks' tile kind(s) with ``mask_fn``'s: combined with its block mask's ``user_kind``, or
    without one, every tile the built-ins leave non-empty partial (nothing proves ``mask_fn`` full there)."""
    if user_kind is not None:
        return block_mask.combine(kind, user_kind)
    return jnp.where(kind == 0, 0, 2) if cfg.mask_fn is not None else kind


def _whole_hop(run, qs, kv, cfg, tiles=None):
    """``run(per_tile=False)`` when the whole hop is provably visible (one branch for the hop, none
    per tile), else ``run(per_tile=True)``: tiles classified one by one (``masks.tile_kind``, and
    ``tiles``, the hop's kinds in a ``mask_fn``'s block mask)."""
    builtin = masks.can_be_empty(cfg.causal, cfg.window, qs.seg is not None)
    if cfg.mask_fn is not None and tiles is None:
        return run(per_tile=True)  # nothing proves a tile full: each evaluates mask_fn
    if not builtin and cfg.mask_fn is None:
        return run(per_tile=False)
    full = jnp.all(tiles == 1) if cfg.mask_fn is not None else jnp.asarray(True)
    if builtin:
        full &= masks.tile_is_full(qs.pos, kv.pos, qs.seg, kv.seg, causal=cfg.causal, window=cfg.window)
    return lax.cond(full, lambda: run(per_tile=False), lambda: run(per_tile=True))


SPAN_MIN_TILE = 512 * 512  # block_q * block_kv from which a hop loops over its span of tiles (`_span_loop`)


def _spans(cfg):
    """Whether tiles are looped over their span (`_span_loop`) rather than switched one by one (`_by_kind`):
    for large tiles (a TPU's defaults). There, on a v5e, slicing a skipped tile's operands and branching
    around it cost more than the tile saved (a causal hop took 0.77-0.81x the plain one's time at 16K-32K
    tokens), while a loop over the span's tiles costs little (its full ones unmasked); small tiles (the
    CPU's 128) switch."""
    return cfg.block_q * cfg.block_kv >= SPAN_MIN_TILE


def _kinds(cfg, pos, seg, other_pos, other_seg, user, *, keys_vary):
    """The kinds (``masks.tile_kind``) of one row of tiles: query chunk ``pos`` [b, bq] against every key
    chunk ``other_pos`` [n, b, bkv] (``keys_vary``), or key chunk ``pos`` against every query chunk; combined
    with ``user`` (the row of ``mask_fn``'s block mask, or None). int32 [n]."""
    def kind(o_pos, o_seg):
        where = (pos, o_pos, seg, o_seg) if keys_vary else (o_pos, pos, o_seg, seg)
        return masks.tile_kind(*where, causal=cfg.causal, window=cfg.window)
    return _with_user(cfg, jax.vmap(kind)(other_pos, other_seg), user)


def _span_loop(step, carry, xs, kinds, ys=None):
    """``carry = step(carry, xs[j], masked)`` (``step`` -> ``(carry, y)``) for ``j`` from the first to the last
    tile that ``kinds`` leaves non-empty: while loops of dynamic length, no iteration, slicing or branch for
    the empty tiles outside the span. The full tiles, where they are one run (a causal row's, a window's),
    go through a loop of their own without a mask; the rest of the span is masked (an empty tile inside it
    adds nothing). ``ys``: a zero buffer [n, ...] that collects the ``y``s (skipped tiles keep 0), or None."""
    n = kinds.shape[0]
    lo, hi = _run(kinds != 0, n)
    f_lo, f_hi = _run(kinds == 1, n)
    one_run = jnp.sum(kinds == 1) == f_hi - f_lo  # else mask them all: one full run is all this skips
    f_lo, f_hi = jnp.where(one_run, f_lo, lo), jnp.where(one_run, f_hi, lo)
    before = f_lo - lo  # the masked tiles: [lo, f_lo), then [f_hi, hi)

    def body(masked, index):
        def run(t, state):
            carry, ys = state
            j = index(t)
            carry, y = step(carry, jax.tree.map(lambda x: x[j], xs), masked)
            return carry, ys if ys is None else lax.dynamic_update_index_in_dim(ys, y.astype(ys.dtype), j, 0)
        return run
    state = lax.fori_loop(f_lo, f_hi, body(False, lambda t: t), (carry, ys))
    return lax.fori_loop(0, before + hi - f_hi, body(True, lambda t: jnp.where(t < before, lo + t, f_hi + t - before)),
                         state)


def _run(flags, n):
    """``(first, last + 1)`` of the True entries of ``flags`` [n] (``(first, first)`` when there are none)."""
    lo = jnp.argmax(flags)
    return lo, jnp.where(jnp.any(flags), n - jnp.argmax(flags[::-1]), lo)


def hop_fwd(qs, kv, cfg, drop=None, tiles=None, head_offset=None):
    """Attention of ``qs.q`` against one K/V shard: ``(o, lse)``, o 0 and lse -inf where a row saw nothing.

    drop: a ``schedule.Dropout`` when ``cfg.dropout_rate > 0``: ``P V`` uses ``P * M / (1 - rate)``
    (``ringattn_ref.dropout``), lse is that of the undropped ``P``. tiles: int8 [sq / block_q, sk / block_kv],
    the kinds of this hop's tiles in ``cfg.mask_fn``'s block mask (``ringattn_fast.block_mask``), or None;
    head_offset: int32 scalar, the global index of the first query head here (heads split), or None."""
    cfg = cfg.resolve(qs.q.shape[-1], qs.q.shape[1], kv.k.shape[1])
    return _whole_hop(partial(_hop_fwd, qs, kv, cfg, drop, tiles, head_offset), qs, kv, cfg, tiles)


def _hop_fwd(qs, kv, cfg, drop, tiles, head_offset, *, per_tile):
    (q, q_pos, q_seg), (k, v, k_pos, k_seg, bias) = qs, kv
    block_q, block_kv = cfg.block_q, cfg.block_kv
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group, acc = h // hk, acc_dtype(q.dtype)
    axes = varying_axes(q, k, v, q_pos, k_pos, q_seg, k_seg, bias)
    nq, nk = sq // block_q, sk // block_kv
    qc = _q_chunks(q.astype(acc) * _q_scale(cfg), hk, block_q)  # (nq, b, hk, group*bq, d); over c: `_softcap`
    kc, vc = _kv_chunks(k, block_kv), _kv_chunks(v, block_kv)  # (nk, b, hk, bkv, d)
    kv_xs = (jnp.arange(nk), kc, vc, _pos_chunks(k_pos, block_kv), _pos_chunks(k_seg, block_kv))
    span = per_tile and _spans(cfg)

    def q_block(xs):  # one Br chunk of queries against all of the shard's keys
        i, q_i, q_pos_i, q_seg_i, rows_i = xs
        bias_i = _rows(bias, i * block_q, block_q, 2)

        def kv_block(carry, xs, span_masked=None):  # one Bc chunk: the online-softmax update (FA-2 Algorithm 1)
            j, k_j, v_j, k_pos_j, k_seg_j = xs

            def tile(carry, masked):
                o, m, l = carry  # (b, hk, group*bq, d), (b, hk, group*bq), (b, hk, group*bq)
                mask = masks.allowed(q_pos_i[:, :, None], k_pos_j[:, None, :], *_seg_pair(q_seg_i, k_seg_j),
                                     causal=cfg.causal, window=cfg.window) if masked else None
                fns = _user_fns(cfg, q_pos_i, k_pos_j, q_seg_i, k_seg_j, h, masked, head_offset)
                s = _logits(q_i, k_j, _rows(bias_i, j * block_kv, block_kv, 3), mask, group, acc,
                            softcap=cfg.logit_softcap, fns=fns)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
                p = jnp.exp(s - m_safe[..., None])  # masked -> exp(-inf) = 0
                alpha = jnp.exp(m - m_safe)
                if rows_i is not None:  # dropout: P V with P * M / (1 - rate); l keeps the undropped P
                    p_v = p * keep_scale(rows_i[..., None], k_pos_j[:, None, None, :], cfg.dropout_rate, acc)
                else:
                    p_v = p
                pv = jnp.einsum("bkqs,bksd->bkqd", p_v, v_j.astype(acc))
                return alpha[..., None] * o + pv, m_new, alpha * l + p.sum(axis=-1)

            if span:  # `_span_loop` says whether this tile needs the mask
                return tile(carry, span_masked), None
            where = (q_pos_i, k_pos_j, q_seg_i, k_seg_j)
            user_kind = None if tiles is None else tiles[i, j]
            return _by_kind(tile, carry, lambda c: c, where, cfg, per_tile=per_tile, user_kind=user_kind), None

        o0 = jnp.zeros(q_i.shape[:-1] + v.shape[-1:], acc)  # o is as wide as v (MLA: d_v != d)
        init = vary_like((o0, jnp.full(q_i.shape[:-1], -jnp.inf, acc), jnp.zeros(q_i.shape[:-1], acc)), axes)
        if span:
            kinds = _kinds(cfg, q_pos_i, q_seg_i, kv_xs[3], kv_xs[4], None if tiles is None else tiles[i],
                           keys_vary=True)
            (o, m, l), _ = _span_loop(kv_block, init, kv_xs, kinds)
        else:
            (o, m, l), _ = lax.scan(kv_block, init, kv_xs)
        o = o / jnp.where(l == 0, 1.0, l)[..., None]
        return o, jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))

    o, lse = lax.map(q_block, (jnp.arange(nq), qc, _pos_chunks(q_pos, block_q), _pos_chunks(q_seg, block_q),
                               _drop_rows(drop, q_pos, hk, group, block_q)))
    return _q_unchunk(o, group), _stat_unchunk(lse, group)


def _seg_pair(q_seg, k_seg):
    """Segment ids as a column of queries and a row of keys for ``masks.allowed`` (or Nones)."""
    return (None, None) if q_seg is None else (q_seg[:, :, None], k_seg[:, None, :])


def _sum_to(x, shape):
    """Sum ``x`` over the axes where ``shape`` is 1 (the bias's broadcast axes), keeping dims."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def hop_bwd(qs, kv, cfg, *, do, lse, delta, drop=None, tiles=None, head_offset=None):
    """FlashAttention-2 backward (Algorithm 2) of one hop, recomputing each tile from ``q, k, lse``.

    Outer loop over K/V chunks (dK_j, dV_j accumulate over the query chunks), inner loop over query
    chunks; per tile ``P = exp(S - lse)``, ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - delta)``,
    ``dQ += scale dS K``, ``dK += scale dS^T Q``, ``dbias = dS`` (summed over broadcast axes).
    dQ is accumulated (transposed) in place, block by block, in the loop carry.

    The tile is worked on transposed (``S^T``, ``P^T``, ``dS^T``), with ``K^T`` laid out once per key
    chunk, so the other four matmuls contract a last axis or the lhs's last with the rhs's first
    (``dQ^T = K^T dS^T``): XLA CPU runs ``P^T dO`` written on the untransposed ``P`` (both operands
    contracted on their row axis) 1.4-3x slower (measured at 128 and 1024 tiles). Where the hop's keys are
    one tile, ``S`` is the forward's product, transposed behind an optimization barrier (:func:`_logits_t`,
    `_forward_order`: ``P`` comes from the very logits ``lse`` came from).

    do: [b, sq, h, d]; lse, delta: [b, h, sq] over all hops (delta = rowsum(do * o_final)); drop: as
    in :func:`hop_fwd` (with the keep multiplier ``keep``: ``dV += (P keep)^T dO``, ``dP = (dO V^T) keep``; D is
    unchanged); tiles, head_offset: as in :func:`hop_fwd`. Returns :class:`HopGrads` in float32 (float64 for float64).
    """
    cfg = cfg.resolve(qs.q.shape[-1], qs.q.shape[1], kv.k.shape[1])
    run = partial(_hop_bwd, qs, kv, cfg, do=do, lse=lse, delta=delta, drop=drop, tiles=tiles,
                  head_offset=head_offset)
    return HopGrads(*_whole_hop(run, qs, kv, cfg, tiles))


def _hop_bwd(qs, kv, cfg, *, do, lse, delta, drop, tiles, head_offset, per_tile):
    (q, q_pos, q_seg), (k, v, k_pos, k_seg, bias) = qs, kv
    scale, block_q, block_kv = cfg.scale, cfg.block_q, cfg.block_kv
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group, acc = h // hk, acc_dtype(q.dtype)
    axes = varying_axes(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg, bias)
    nq, nk = sq // block_q, sk // block_kv
    bias_rows = bias is not None and bias.shape[2] > 1
    bias_cols = bias is not None and bias.shape[3] > 1
    bias_rows_shape = (bias.shape[0], bias.shape[1], block_q, block_kv if bias_cols else 1) if bias_rows else None
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw nothing: every p below is masked to 0
    span, order = per_tile and _spans(cfg), _forward_order(nk)
    qc = _q_chunks(q.astype(acc) * _q_scale(cfg), hk, block_q)  # (nq, b, hk, group*bq, d): as the forward's
    qc = qc if order else jnp.swapaxes(qc, -1, -2)  # Q for the forward's product, else Q^T (`_logits_t`)
    q_xs = (jnp.arange(nq), qc, _q_chunks(do.astype(acc), hk, block_q),
            _stat_chunks(lse, hk, block_q), _stat_chunks(delta, hk, block_q), _pos_chunks(q_pos, block_q),
            _pos_chunks(q_seg, block_q), _drop_rows(drop, q_pos, hk, group, block_q))
    kv_xs = (jnp.arange(nk), _kv_chunks(k, block_kv), _kv_chunks(v, block_kv), _pos_chunks(k_pos, block_kv),
             _pos_chunks(k_seg, block_kv))

    def kv_block(dqt, xs):  # one Bc chunk of keys; its dK_j, dV_j stay in the inner carry
        j, k_j, v_j, k_pos_j, k_seg_j = xs
        bias_j = _rows(bias, j * block_kv, block_kv, 3)
        k_j, v_j = k_j.astype(acc), v_j.astype(acc)  # (b, hk, bkv, d)
        kt_j = jnp.swapaxes(masks.finite_part(k_j), -1, -2)  # K_j^T: (b, hk, d, bkv); a masked key's nan stays out of dQ

        def q_block(carry, xs, span_masked=None):
            i, q_i, do_i, lse_i, delta_i, q_pos_i, q_seg_i, rows_i = xs  # Q or Q^T, dO (b, hk, group*bq, d), 3 x (b, hk, group*bq)
            bias_ij = _rows(bias_j, i * block_q, block_q, 2)

            def tile(carry, masked):
                dk_j, dv_j, db_j, dqt = carry
                mask = masks.allowed(q_pos_i[:, :, None], k_pos_j[:, None, :], *_seg_pair(q_seg_i, k_seg_j),
                                     causal=cfg.causal, window=cfg.window) if masked else None
                fns = _user_fns(cfg, q_pos_i, k_pos_j, q_seg_i, k_seg_j, h, masked, head_offset)
                st, dcap, score_vjp = _logits_t(k_j, q_i, bias_ij, mask, group, acc, softcap=cfg.logit_softcap,
                                                fns=fns, forward_order=order)  # S^T: (b, hk, bkv, group*bq)
                pt = jnp.exp(st - lse_i[:, :, None])  # P^T; masked -> 0
                keep_t = None if rows_i is None else keep_scale(rows_i[:, :, None, :], k_pos_j[:, None, :, None],
                                                                cfg.dropout_rate, acc)  # dropout: keep^T
                pt_v = pt if keep_t is None else pt * keep_t  # the P that multiplied V in the forward
                dv_j = dv_j + jnp.einsum("bksq,bkqd->bksd", pt_v, do_i)  # dV += P^T dO
                dpt = jnp.einsum("bksd,bkqd->bksq", v_j, do_i)  # dP^T = V dO^T
                dpt = dpt if keep_t is None else dpt * keep_t
                dsb = masks.masked_grad(pt, dpt, delta_i[:, :, None])  # dS^T of the final logits: the bias's
                dst = dsb  # 0 where P is 0, even in a NaN row
                if score_vjp is not None:  # back through score_fn (before the bias, after the softcap)
                    dst = jnp.where(pt == 0, 0.0, score_vjp(dst))
                if dcap is not None:  # through c tanh(s / c); still 0 where P is 0 (dcap is NaN for a bad key)
                    dst = jnp.where(pt == 0, 0.0, dst * dcap)
                dqt_i = jnp.einsum("bkds,bksq->bkdq", kt_j, dst) * scale  # dQ^T = K^T dS^T: (b, hk, d, group*bq)
                dk_j = dk_j + jnp.einsum("bksq,bkqd->bksd" if order else "bksq,bkdq->bksd", dst, q_i)  # dK += dS^T Q
                # (q carried scale / c: times c below)
                db = None
                if bias is not None:  # dS: (b, hk, bkv, group, bq) -> (b, h, bq, bkv)
                    ds = jnp.transpose(dsb.reshape(b, hk, block_kv, group, block_q), (0, 1, 3, 4, 2))
                    db = _sum_to(ds.reshape(b, h, block_q, block_kv), bias_ij.shape)
                    db_j = db if bias_rows else db_j + db
                dqt = lax.dynamic_update_index_in_dim(dqt, dqt[i] + dqt_i, i, 0)  # in place
                return (dk_j, dv_j, None if bias_rows else db_j, dqt), db if bias_rows else None

            if span:  # `_span_loop` says whether this tile needs the mask
                return tile(carry, span_masked)
            zeros = vary_like(jnp.zeros(bias_ij.shape, acc), axes) if bias_rows else None
            where = (q_pos_i, k_pos_j, q_seg_i, k_seg_j)
            user_kind = None if tiles is None else tiles[i, j]
            return _by_kind(tile, carry, lambda c: (c, zeros), where, cfg, per_tile=per_tile, user_kind=user_kind)

        db0 = jnp.zeros(bias_j.shape, acc) if bias is not None and not bias_rows else None
        init = vary_like((jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc), db0), axes) + (dqt,)
        if span:
            kinds = _kinds(cfg, k_pos_j, k_seg_j, q_xs[5], q_xs[6], None if tiles is None else tiles[:, j],
                           keys_vary=False)
            buf = vary_like(jnp.zeros((nq,) + bias_rows_shape, acc), axes) if bias_rows else None
            (dk_j, dv_j, db_j, dqt), db_blocks = _span_loop(q_block, init, q_xs, kinds, buf)
        else:
            (dk_j, dv_j, db_j, dqt), db_blocks = lax.scan(q_block, init, q_xs)
        if bias_rows:  # (nq, bb, bh, bq, bkv|1) -> (bb, bh, sq, bkv|1)
            db_j = jnp.einsum("nbhqs->bhnqs", db_blocks).reshape(db_blocks.shape[1:3] + (sq, -1))
        return dqt, (dk_j, dv_j, db_j)  # dQ^T: (nq, b, hk, d, group*bq)

    dq0 = vary_like(jnp.zeros((nq, b, hk, d, group * block_q), acc), axes)
    if bias is not None and not bias_cols:  # one dbias for all key chunks: accumulate in the carry
        def kv_block_acc(carry, xs):
            dq, db = carry
            dq, (dk_j, dv_j, db_j) = kv_block(dq, xs)
            return (dq, db + db_j), (dk_j, dv_j)
        (dq, dbias), (dk, dv) = lax.scan(kv_block_acc, (dq0, vary_like(jnp.zeros(bias.shape, acc), axes)), kv_xs)
    else:
        dq, (dk, dv, db_blocks) = lax.scan(kv_block, dq0, kv_xs)
        dbias = None
        if bias is not None:  # (nk, bb, bh, sq|1, bkv) -> (bb, bh, sq|1, sk)
            dbias = jnp.einsum("nbhqs->bhqns", db_blocks).reshape(db_blocks.shape[1:4] + (sk,))
    if cfg.logit_softcap is not None:  # q carried scale / c: dK = dS^T Q scale = c (dS^T (Q scale / c))
        dk = dk * cfg.logit_softcap
    return _q_unchunk(jnp.swapaxes(dq, -1, -2), group), _kv_unchunk(dk), _kv_unchunk(dv), dbias
