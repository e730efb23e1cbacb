"""Blockwise attention (BPT, arXiv:2305.19370 §3) on one device, tile by tile.

The query is cut into ``block_q`` rows and the keys into ``block_kv`` columns (FA-2's ``B_r`` and
``B_c``). The outer loop runs over query blocks, the inner loop over key blocks, and each tile is
folded into the running ``(m, l, o)`` with :func:`ringattn_ref.softmax.online_update`; the full
``seq x seq`` score matrix never exists, only one ``block_q x block_kv`` tile at a time.

:func:`attend_kv_shard` is the unit of work a ring host performs per hop (``ring.py``): the same
loop, run against the K/V shard the host holds at that step. :func:`hop_attention` is that hop on its
own, on the per-hop contract of ``ringattn_fast``'s kernels (``QShard``, ``KVShard``, ``HopConfig``
of ``shards.py``): the oracle to test a kernel against.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .attention import call_mask_fn, call_score_fn, repeat_kv
from .dropout import dropout_mask
from .masks import allowed, as_rows, mark_bad_keys, tile_is_empty
from .shards import DEFAULT_BLOCK, HopConfig, KVShard, QShard, default_block  # noqa: F401  (re-exported)
from .softmax import finalize, init_state, online_update
from .validation import (check_bias, check_block, check_bool, check_positions, check_qkv, check_scale,
                         check_segment_ids, check_softcap, check_window)


def bias_tile(bias, q_pos, k_pos):
    """The part of a full bias for queries ``q_pos`` and keys ``k_pos`` (true positions).

    bias: [b|1, h|1, s|1, s|1] in true order; q_pos [b|1, tq], k_pos [b|1, tk] (one row of positions
    per example, or one row for all) -> [b|1, h|1, tq|1, tk|1]; broadcast dims stay 1.
    """
    if bias is None:
        return None
    rows_per_example = []
    for i in range(max(bias.shape[0], q_pos.shape[0], k_pos.shape[0])):
        bi = bias[min(i, bias.shape[0] - 1)]  # (h|1, s|1, s|1)
        rows = q_pos[min(i, q_pos.shape[0] - 1)] if bias.shape[2] > 1 else [0]
        cols = k_pos[min(i, k_pos.shape[0] - 1)] if bias.shape[3] > 1 else [0]
        rows_per_example.append(bi[:, rows][:, :, cols])
    return np.stack(rows_per_example)


def _rows(x, rows, axis=1):
    """``x[rows]`` along ``axis`` (a broadcast axis of size 1, or None, stays as it is)."""
    if x is None or x.shape[axis] == 1:
        return x
    return np.take(x, np.arange(rows.start, rows.stop), axis=axis)


def q_tile(qs, rows):
    """The tile ``rows`` (a slice) of a :class:`QShard`."""
    return QShard(qs.q[:, rows], _rows(qs.pos, rows), _rows(qs.seg, rows))


def kv_tile(kv, cols, rows):
    """The tile of a :class:`KVShard` for keys ``cols`` and (its bias block's) queries ``rows``."""
    bias = None if kv.bias is None else _rows(_rows(kv.bias, rows, 2), cols, 3)
    return KVShard(kv.k[:, cols], kv.v[:, cols], _rows(kv.pos, cols), _rows(kv.seg, cols), bias)


def scaled_logits(qs, kv, cfg):
    """``scale * q k^T`` of one tile, nothing else: [b, h, tq, tk]."""
    return cfg.scale * np.einsum("bqhd,bkhd->bhqk", qs.q, repeat_kv(kv.k, qs.q.shape[2]))


def tile_logits(qs, kv, cfg):
    """Masked logits of one tile: ``scale * q k^T + bias`` with -inf where the mask forbids: [b, h, tq, tk].

    qs: the tile's queries (q [b, tq, h, d], positions [b|1, tq], segment ids or None); kv: its keys
    (k [b, tk, hk, d], positions [b|1, tk], segment ids, and the bias block of this tile
    ``[b|1, h|1, tq|1, tk|1]`` or None); cfg: a resolved :class:`HopConfig` (scale, logit_softcap, causal,
    window, mask_fn, score_fn). The order of ``docs/design.md``: soft-cap, ``score_fn``, bias, then the
    built-in mask *and* ``mask_fn``, both called on the tile's true positions (``variants.py``).
    """
    s = scaled_logits(qs, kv, cfg)  # (b, h, tq, tk)
    b, h = s.shape[:2]
    if cfg.logit_softcap is not None:  # Gemma 2: c * tanh(s / c), before the bias and the mask
        s = cfg.logit_softcap * np.tanh(s / cfg.logit_softcap)
    if cfg.score_fn is not None:
        s = call_score_fn(cfg.score_fn, s, qs.pos, kv.pos, h)
    if kv.bias is not None:
        s = np.where(kv.bias == -np.inf, -np.inf, s + kv.bias)  # -inf masks even a NaN logit
    seg = (None, None) if qs.seg is None else (qs.seg[:, :, None], kv.seg[:, None, :])
    mask = allowed(qs.pos[:, :, None], kv.pos[:, None, :], *seg, causal=cfg.causal, window=cfg.window)  # (b|1, tq, tk)
    mask = mask[:, None]  # (b|1, 1, tq, tk)
    if cfg.mask_fn is not None:
        mask = mask & call_mask_fn(cfg.mask_fn, qs.pos, kv.pos, qs.seg, kv.seg, b, h)  # (b|1, h|1, tq, tk)
    return np.where(mask, s, -np.inf)


def attend_kv_shard(state, qs, kv, cfg, *, dropout=None, kinds=None):
    """Fold the attention of ``qs`` over one K/V shard into ``state = (m, l, o)``, in place.

    - qs: :class:`QShard` (q [b, sq, h, d], true positions [b|1, sq], segment ids [b, sq] or None);
    - kv: :class:`KVShard` (k, v [b, sk, hk, d], positions [b|1, sk], segment ids, and the bias of
      this hop ``[b|1, h|1, sq|1, sk|1]`` or None);
    - cfg: a resolved :class:`HopConfig` (every field set; tile sides dividing the shards);
    - m, l: [b, h, sq]; o: [b, sq, h, d] unnormalised;
    - dropout: ``(seed, rate)`` or None: each tile's ``P V`` uses the mask of ``dropout.dropout_mask``
      at the tile's true positions (the same entries whatever the tiling);
    - kinds: int8 ``[sq / block_q, sk / block_kv]`` from ``block_mask.tile_kinds`` (0 = empty) or None.

    Tiles whose mask is provably empty are skipped (:func:`ringattn_ref.masks.tile_is_empty`), and so
    are those ``kinds`` calls empty (a ``mask_fn``'s, which bounds cannot prove).
    Returns ``(tiles_computed, tiles_skipped)``.
    """
    m, l, o = state
    b, sq, h, _ = qs.q.shape
    computed = skipped = 0
    for qi in range(sq // cfg.block_q):  # FA-2: outer loop over query blocks (B_r rows)
        rows = slice(qi * cfg.block_q, (qi + 1) * cfg.block_q)
        qt = q_tile(qs, rows)
        for kj in range(kv.k.shape[1] // cfg.block_kv):  # inner loop over key blocks (B_c columns)
            kt = kv_tile(kv, slice(kj * cfg.block_kv, (kj + 1) * cfg.block_kv), rows)
            if (tile_is_empty(qt.pos, kt.pos, qt.seg, kt.seg, causal=cfg.causal, window=cfg.window)
                    or (kinds is not None and kinds[qi, kj] == 0)):
                skipped += 1
                continue
            s = tile_logits(qt, kt, cfg)  # (b, h, tq, tk)
            keep = None if dropout is None else dropout_mask(*dropout, b, h, qt.pos, kt.pos)  # (b, h, tq, tk)
            m[:, :, rows], l[:, :, rows], o[:, rows] = online_update(m[:, :, rows], l[:, :, rows], o[:, rows],
                                                                     s, repeat_kv(kt.v, h), keep)
            computed += 1
    return computed, skipped


def check_hop(qs, kv, cfg):
    """Validate a per-hop call; returns ``(qs, kv, cfg)`` in float64 with per-example position rows, K/V
    marked (``masks.mark_bad_keys``) and ``cfg`` resolved (scale, tile sides)."""
    b, sq, h, d = qs.q.shape
    sk = kv.k.shape[1]
    q_pos, k_pos = as_rows(qs.pos, b), as_rows(kv.pos, b)
    check_positions(q_pos, b, sq, "qs.pos"), check_positions(k_pos, b, sk, "kv.pos")
    cfg = cfg.resolve(d, sq, sk)
    cfg = dataclasses.replace(cfg, scale=check_scale(cfg.scale, d), causal=check_bool(cfg.causal, "causal"),
                              logit_softcap=check_softcap(cfg.logit_softcap),
                              window=check_window(cfg.window), block_q=check_block(cfg.block_q, sq, "block_q"),
                              block_kv=check_block(cfg.block_kv, sk, "block_kv"))
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    k, v = mark_bad_keys(kv.k, kv.v)
    return QShard(f64(qs.q), q_pos, qs.seg), KVShard(k, v, k_pos, kv.seg, f64(kv.bias)), cfg


def hop_attention(qs, kv, cfg=HopConfig()):
    """One hop's normalised partial result: ``(o, lse)`` of ``qs`` over one K/V shard, float64.

    The per-hop oracle, on the contract of ``ringattn_fast``'s per-hop functions and kernels (test your
    own kernel against it): qs = ``QShard(q [b, sq, h, d], pos [b, sq] (or [sq]: one row for all),
    seg [b, sq] or None)``; kv = ``KVShard(k, v [b, sk, hk, d], pos [b, sk], seg or None, bias
    [b|1, h|1, sq|1, sk|1] or None)``; cfg: :class:`HopConfig` (scale None = ``dim ** -0.5``, tile sides
    None = :func:`default_block`).

    Returns o [b, sq, h, d] and lse [b, h, sq] (-inf where the row saw nothing in this shard).
    Partials over disjoint shards combine with ``softmax.merge`` in any order.
    """
    qs, kv, cfg = check_hop(qs, kv, cfg)
    b, sq, h, _ = qs.q.shape
    state = init_state(b, h, sq, kv.v.shape[-1])  # o as wide as v (MLA: d_v != d)
    attend_kv_shard(state, qs, kv, cfg)
    return finalize(*state)


def blockwise_attention(q, k, v, *, block_q=None, block_kv=None, causal=False, segment_ids=None,
                        bias=None, window=None, scale=None, return_lse=False, logit_softcap=None):
    """Attention computed tile by tile with the online softmax (BPT on one device).

    Same arguments and result as :func:`ringattn_ref.attention` plus ``block_q`` / ``block_kv``,
    which must divide ``seq`` (default: :func:`default_block` of ``seq``). This is the
    ``n_hosts=1`` path of the ring.
    """
    b, s, h, hk, d = check_qkv(q, k, v, value_width=True)
    cfg = HopConfig(scale=check_scale(scale, d), causal=check_bool(causal, "causal"), window=check_window(window, s),
                    logit_softcap=check_softcap(logit_softcap),
                    block_q=check_block(default_block(s) if block_q is None else block_q, s, "block_q"),
                    block_kv=check_block(default_block(s) if block_kv is None else block_kv, s, "block_kv"))
    segment_ids = check_segment_ids(segment_ids, b, s)
    bias = check_bias(bias, b, h, s)  # in true order, all queries x all keys: the whole hop's bias block
    pos = np.arange(s)[None]  # (1, s)
    o, lse = hop_attention(QShard(q, pos, segment_ids), KVShard(k, v, pos, segment_ids, bias), cfg)
    return (o, lse) if return_lse else o
