"""Blockwise attention (BPT, arXiv:2305.19370 §3) on one device, tile by tile.

The query is cut into ``block_q`` rows and the keys into ``block_kv`` columns (FA-2's ``B_r`` and
``B_c``). The outer loop runs over query blocks, the inner loop over key blocks, and each tile is
folded into the running ``(m, l, o)`` with :func:`ringattn_ref.softmax.online_update`; the full
``seq x seq`` score matrix never exists, only one ``block_q x block_kv`` tile at a time.

:func:`attend_kv_block` is the unit of work a ring host performs per hop (``ring.py``): the same
loop, run against the K/V block the host holds at that step.
"""
from __future__ import annotations

import numpy as np

from .attention import repeat_kv
from .dropout import dropout_mask
from .masks import allowed, as_rows, mark_bad_keys, tile_is_empty
from .softmax import finalize, init_state, online_update
from .validation import (check_bias, check_block, check_bool, check_positions, check_qkv, check_scale,
                         check_segment_ids, check_window)

DEFAULT_BLOCK = 128


def default_block(shard, target=DEFAULT_BLOCK):
    """The default tile size: the largest divisor of ``shard`` that is ``<= target`` (128).

    128 keeps one float64 score tile at ``128 * 128 * 8 B = 128 KiB`` per (batch, head) while leaving
    several tiles per shard at realistic lengths, so tile skipping has something to skip.
    """
    return max(c for c in range(1, min(shard, target) + 1) if shard % c == 0)


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


def tile_logits(q, k, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window):
    """Masked logits of one tile: ``scale * q k^T + bias`` with -inf where the mask forbids.

    q: [b, tq, h, d]; k: [b, tk, hk, d]; q_pos [b|1, tq], k_pos [b|1, tk] true positions;
    q_seg [b, tq], k_seg [b, tk] or None; bias: full bias in true order or None. Returns [b, h, tq, tk].
    """
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, repeat_kv(k, q.shape[2]))  # (b, h, tq, tk)
    if bias is not None:
        b_t = bias_tile(bias, q_pos, k_pos)
        s = np.where(b_t == -np.inf, -np.inf, s + b_t)  # -inf masks even a NaN logit
    seg = (None, None) if q_seg is None else (q_seg[:, :, None], k_seg[:, None, :])
    mask = allowed(q_pos[:, :, None], k_pos[:, None, :], *seg, causal=causal, window=window)  # (b|1, tq, tk)
    return np.where(mask[:, None], s, -np.inf)


def attend_kv_block(state, q, k, v, q_pos, k_pos, q_seg, k_seg, bias, *, scale, causal, window,
                    block_q, block_kv, dropout=None):
    """Fold the attention of ``q`` over one K/V block into ``state = (m, l, o)``, in place.

    - q: [b, sq, h, d]; k, v: [b, sk, hk, d]; q_pos [b|1, sq], k_pos [b|1, sk] true positions;
    - segments [b, sq] / [b, sk] or None; bias: full bias in true order or None;
    - m, l: [b, h, sq]; o: [b, sq, h, d] unnormalised;
    - dropout: ``(seed, rate)`` or None: each tile's ``P V`` uses the mask of ``dropout.dropout_mask``
      at the tile's true positions (the same entries whatever the tiling).

    Tiles whose mask is provably empty are skipped (:func:`ringattn_ref.masks.tile_is_empty`).
    Returns ``(tiles_computed, tiles_skipped)``.
    """
    m, l, o = state
    computed = skipped = 0
    for qi in range(q.shape[1] // block_q):  # FA-2: outer loop over query blocks (B_r rows)
        qs = slice(qi * block_q, (qi + 1) * block_q)
        for kj in range(k.shape[1] // block_kv):  # inner loop over key blocks (B_c columns)
            ks = slice(kj * block_kv, (kj + 1) * block_kv)
            q_seg_t, k_seg_t = (None, None) if q_seg is None else (q_seg[:, qs], k_seg[:, ks])
            if tile_is_empty(q_pos[:, qs], k_pos[:, ks], q_seg_t, k_seg_t, causal=causal, window=window):
                skipped += 1
                continue
            s = tile_logits(q[:, qs], k[:, ks], q_pos[:, qs], k_pos[:, ks], q_seg_t, k_seg_t, bias,
                            scale=scale, causal=causal, window=window)  # (b, h, tq, tk)
            v_tile = repeat_kv(v[:, ks], q.shape[2])  # (b, tk, h, d)
            keep = None if dropout is None else dropout_mask(*dropout, q.shape[0], q.shape[2], q_pos[:, qs],
                                                             k_pos[:, ks])  # (b, h, tq, tk)
            m[:, :, qs], l[:, :, qs], o[:, qs] = online_update(m[:, :, qs], l[:, :, qs], o[:, qs],
                                                               s, v_tile, keep)
            computed += 1
    return computed, skipped


def hop_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, bias=None, *, scale=None,
                  causal=False, window=None, block_q=None, block_kv=None):
    """One hop's normalised partial result: ``(o, lse)`` of ``q`` over one K/V block, float64.

    The per-hop oracle (the contract of ``ringattn_fast.hop`` and the Pallas kernels; test your own
    kernel against it).

    - q: [b, sq, h, d]; k, v: [b, sk, hk, d];
    - q_pos [b, sq] / k_pos [b, sk] true positions, one row per example (or ``[sq]`` / ``[sk]`` for
      all); q_seg [b, sq], k_seg [b, sk] or None;
    - bias: full bias ``[b|1, h|1, S|1, S|1]`` indexed by true positions, or None;
    - block_q / block_kv: tile sides (default: the whole block).

    Returns o [b, sq, h, d] and lse [b, h, sq] (-inf where the row saw nothing in this block).
    Partials over disjoint blocks combine with ``softmax.merge`` in any order.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    q_pos, k_pos = as_rows(q_pos, b), as_rows(k_pos, b)
    check_positions(q_pos, b, sq, "q_pos"), check_positions(k_pos, b, sk, "k_pos")
    state = init_state(b, h, sq, d)
    attend_kv_block(state, np.asarray(q, np.float64), *mark_bad_keys(k, v), q_pos, k_pos, q_seg, k_seg,
                    None if bias is None else np.asarray(bias, np.float64),
                    scale=check_scale(scale, d), causal=check_bool(causal, "causal"),
                    window=check_window(window), block_q=check_block(block_q, sq, "block_q"),
                    block_kv=check_block(block_kv, sk, "block_kv"))
    return finalize(*state)


def blockwise_attention(q, k, v, *, block_q=None, block_kv=None, causal=False, segment_ids=None,
                        bias=None, window=None, scale=None, return_lse=False):
    """Attention computed tile by tile with the online softmax (BPT on one device).

    Same arguments and result as :func:`ringattn_ref.attention` plus ``block_q`` / ``block_kv``,
    which must divide ``seq`` (default: :func:`default_block` of ``seq``). This is the
    ``n_hosts=1`` path of the ring.
    """
    b, s, h, hk, d = check_qkv(q, k, v)
    block_q = check_block(default_block(s) if block_q is None else block_q, s, "block_q")
    block_kv = check_block(default_block(s) if block_kv is None else block_kv, s, "block_kv")
    scale = check_scale(scale, d)
    causal = check_bool(causal, "causal")
    window = check_window(window, s)
    segment_ids = check_segment_ids(segment_ids, b, s)
    bias = None if check_bias(bias, b, h, s) is None else np.asarray(bias, np.float64)
    pos = np.arange(s)[None]  # (1, s)
    o, lse = hop_attention(q, k, v, pos, pos, segment_ids, segment_ids, bias, scale=scale,
                           causal=causal, window=window, block_q=block_q, block_kv=block_kv)
    return (o, lse) if return_lse else o
