"""Plain softmax attention in float64: the oracle every other path is tested against.

Vaswani et al. 2017, eq. 1::

    O = softmax(scale * Q K^T + bias, masked) V

It materialises the full ``[batch, heads, seq, seq]`` score matrix on purpose: no blocks, no
online softmax, nothing clever, so that it can be trusted.

A masked pair (by the mask or a -inf bias) contributes nothing, whatever the key holds; a row that
may see a key holding a nan/inf is NaN (``masks.mark_bad_keys``; ``docs/design.md``, "Non-finite keys").
"""
from __future__ import annotations

import numpy as np

from .dropout import check_dropout, dropout_mask
from .masks import allowed, mark_bad_keys
from .validation import check_bias, check_bool, check_qkv, check_scale, check_segment_ids, check_window


def repeat_kv(x, heads):
    """GQA/MQA: repeat kv heads so query head ``h`` uses kv head ``h // (heads // kv_heads)``.

    x: [b, s, kv_heads, d] -> [b, s, heads, d].
    """
    return np.repeat(x, heads // x.shape[2], axis=2)


def attention(q, k, v, *, causal=False, segment_ids=None, bias=None, window=None, scale=None,
              return_lse=False, padding_segment=None, dropout_rate=0.0, dropout_key=None):
    """Softmax attention of ``q`` over ``k``, ``v`` (all in true token order).

    - q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] with heads % kv_heads == 0;
    - causal / segment_ids (int [batch, seq]) / window ``(left, right)``: the mask of
      ``docs/design.md``;
    - bias: broadcastable to [batch, heads, seq, seq], added to the scaled logits;
    - scale: defaults to ``dim ** -0.5``;
    - padding_segment: a segment id whose keys no query sees and whose queries see nothing
      (MaxText's padding 0; ``ringattn_ref.packing``);
    - dropout_rate / dropout_key: attention dropout, ``P * M / (1 - rate)`` in ``P V`` with the mask of
      ``dropout.dropout_mask`` (a function of the key, batch row, head and true positions); lse is
      that of the undropped ``P``.

    Returns o [batch, seq, heads, dim] float64, and lse [batch, heads, seq] if ``return_lse``.
    A row that sees no key gives ``o = 0`` and ``lse = -inf`` (never NaN).
    """
    b, s, h, hk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    causal = check_bool(causal, "causal")
    window = check_window(window, s)
    segment_ids = check_segment_ids(segment_ids, b, s)
    bias = check_bias(bias, b, h, s)
    dropout_rate, seed = check_dropout(dropout_rate, dropout_key)
    q = np.asarray(q, dtype=np.float64)
    k, v = mark_bad_keys(k, v)

    logits = scale * np.einsum("bqhd,bkhd->bhqk", q, repeat_kv(k, h))  # (b, h, s, s)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        logits = np.where(bias == -np.inf, -np.inf, logits + bias)  # -inf masks even a NaN logit
    pos = np.arange(s)[None]  # (1, s) true positions
    if padding_segment is not None and segment_ids is None:
        raise ValueError("padding_segment names a segment of segment_ids; pass segment_ids too")
    seg = (None, None) if segment_ids is None else (segment_ids[:, :, None], segment_ids[:, None, :])
    if padding_segment is not None:  # its queries get an id no key has: they see nothing
        q_seg = np.asarray(seg[0], np.int64)
        seg = (np.where(q_seg == padding_segment, np.iinfo(np.int64).min, q_seg), seg[1])
    mask = allowed(pos[:, :, None], pos[:, None, :], *seg, causal=causal, window=window)  # (b|1, s, s)
    logits = np.where(mask[:, None], logits, -np.inf)

    m = logits.max(axis=-1, keepdims=True)  # (b, h, s, 1); -inf for a row that sees nothing
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)  # (b, h, s, s); exactly 0 where masked
    l = p.sum(axis=-1)  # (b, h, s)
    seen = l != 0  # NaN (a row that sees a bad key) counts as seen: it stays NaN
    p = p / np.where(seen, l, 1.0)[..., None]
    if seed is not None:
        p = p * dropout_mask(seed, dropout_rate, b, h, pos, pos)
    o = np.einsum("bhqk,bkhd->bqhd", p, repeat_kv(v, h))
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m[..., 0] + np.log(np.where(seen, l, 1.0)), -np.inf)  # (b, h, s)
    return o, lse
