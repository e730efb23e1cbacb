"""Plain softmax attention in float64: the oracle every other path is tested against.

    O = softmax(scale * Q K^T + bias, masked) V        (Vaswani et al. 2017, eq. 1)

It materialises the full ``[batch, heads, seq, seq]`` score matrix on purpose: no blocks, no
online softmax, nothing clever, so that it can be trusted.

A masked pair (a logit of -inf, from the mask or a -inf bias) contributes nothing, whatever the
key's values: :func:`attend_values` multiplies only finite values of V and marks with NaN the rows
that do see a non-finite value (``docs/design.md``, "Non-finite keys").
"""
from __future__ import annotations

import numpy as np

from .masks import allowed
from .validation import check_bias, check_bool, check_qkv, check_scale, check_segment_ids, check_window


def repeat_kv(x, heads):
    """GQA/MQA: repeat kv heads so query head ``h`` uses kv head ``h // (heads // kv_heads)``.

    x: [b, s, kv_heads, d] -> [b, s, heads, d].
    """
    return np.repeat(x, heads // x.shape[2], axis=2)


def attend_values(p, v, live):
    """``p @ v`` where only live pairs count: ``[b, h, q, k] x [b, k, h, d] -> [b, q, h, d]``.

    p: probabilities (0 where not live); v: values with kv heads already repeated; live: bool
    ``[b|1, h|1, q, k]``, the pairs whose logit is not -inf. A non-finite value of a key that is not
    live never enters (``0 * nan`` would); a row that has a live key with a non-finite value is NaN.
    """
    finite = np.isfinite(v)
    o = np.einsum("bhqk,bkhd->bqhd", p, np.where(finite, v, 0.0))
    bad_key = ~finite.all(axis=-1)  # (b, k, h)
    row_bad = np.einsum("bhqk,bkh->bqh", np.broadcast_to(live, p.shape).astype(float), bad_key.astype(float)) > 0
    return np.where(row_bad[..., None], np.nan, o)


def attention(q, k, v, *, causal=False, segment_ids=None, bias=None, window=None, scale=None,
              return_lse=False):
    """Softmax attention of ``q`` over ``k``, ``v`` (all in true token order).

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] with heads % kv_heads == 0.
    causal / segment_ids (int [batch, seq]) / window ``(left, right)``: the mask of ``docs/design.md``.
    bias: broadcastable to [batch, heads, seq, seq], added to the scaled logits.
    scale: defaults to ``dim ** -0.5``.
    Returns o [batch, seq, heads, dim] float64, and lse [batch, heads, seq] if ``return_lse``.
    A row that sees no key gives ``o = 0`` and ``lse = -inf`` (never NaN).
    """
    b, s, h, hk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    causal = check_bool(causal, "causal")
    window = check_window(window, s)
    segment_ids = check_segment_ids(segment_ids, b, s)
    bias = check_bias(bias, b, h, s)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))

    logits = scale * np.einsum("bqhd,bkhd->bhqk", q, repeat_kv(k, h))  # (b, h, s, s)
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    pos = np.arange(s)[None]  # (1, s) true positions
    seg = (None, None) if segment_ids is None else (segment_ids[:, :, None], segment_ids[:, None, :])
    mask = allowed(pos[:, :, None], pos[:, None, :], *seg, causal=causal, window=window)  # (b|1, s, s)
    logits = np.where(mask[:, None], logits, -np.inf)

    m = logits.max(axis=-1, keepdims=True)  # (b, h, s, 1); -inf for a row that sees nothing
    m = np.where(np.isfinite(m), m, 0.0)
    live = logits != -np.inf  # (b, h, s, s): the pairs that count (NaN logits do)
    p = np.where(live, np.exp(logits - m), 0.0)  # (b, h, s, s); exactly 0 where masked
    l = p.sum(axis=-1)  # (b, h, s)
    seen = l > 0
    o = attend_values(p / np.where(seen, l, 1.0)[..., None], repeat_kv(v, h), live)
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m[..., 0] + np.log(np.where(seen, l, 1.0)), -np.inf)  # (b, h, s)
    return o, lse
