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
from .validation import (broadcasts_to, check_attention_shapes, check_bias, check_bool, check_positions, check_scale,
                         check_segment_ids, check_sinks, check_softcap, check_window)


def repeat_kv(x, heads):
    """GQA/MQA: repeat kv heads so query head ``h`` uses kv head ``h // (heads // kv_heads)``.

    x: [b, s, kv_heads, d] -> [b, s, heads, d].
    """
    return np.repeat(x, heads // x.shape[2], axis=2)


def attention(q, k, v, *, causal=False, segment_ids=None, bias=None, window=None, scale=None,
              return_lse=False, padding_segment=None, dropout_rate=0.0, dropout_key=None, logit_softcap=None,
              sinks=None, mask_fn=None, score_fn=None, positions=None, kv_positions=None, kv_segment_ids=None):
    """Softmax attention of ``q`` over ``k``, ``v``.

    - q: [batch, t, heads, dim]; k: [batch, s, kv_heads, dim]; v: [batch, s, kv_heads, dim_v], with
      heads % kv_heads == 0 (GQA/MQA); ``t != s`` is cross-attention, ``dim_v != dim`` a value width
      of its own (MLA);
    - positions [batch, t] / kv_positions [batch, s]: true positions (int >= 0). Defaults: keys
      ``0 .. s-1``, queries the *last* t of them, ``s - t .. s - 1`` (so causal means
      ``k_pos <= q_pos + s - t`` in query index terms; with ``t == s`` both are ``0 .. s-1``);
    - causal / segment_ids (int [batch, t]; kv_segment_ids [batch, s], default segment_ids when
      ``t == s``) / window ``(left, right)``: the mask of ``docs/design.md``;
    - mask_fn / score_fn: user functions of true positions (``ringattn_ref.variants``), applied densely
      here: a pair attends iff the built-in mask *and* ``mask_fn`` allow it;
    - bias: broadcastable to [batch, heads, t, s], added to the logits;
    - scale: defaults to ``dim ** -0.5``; logit_softcap ``c``: ``s = c * tanh(s / c)`` on the scaled
      logits (Gemma 2), then ``score_fn``, then the bias, then the mask: capped before the bias, so a
      ``-inf`` bias still masks and a bias keeps its range (``variants.softcap`` says why; Tokamax caps
      after the bias);
    - sinks: float [heads], a logit per query head that joins every row's softmax denominator and
      brings no value (gpt-oss): ``o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))``;
    - padding_segment: a segment id whose keys no query sees and whose queries see nothing
      (MaxText's padding 0; ``ringattn_ref.packing``);
    - dropout_rate / dropout_key: attention dropout, ``P * M / (1 - rate)`` in ``P V`` with the mask of
      ``dropout.dropout_mask`` (a function of the key, batch row, head and true positions); lse is
      that of the undropped ``P``.

    Returns o [batch, t, heads, dim_v] float64, and lse [batch, heads, t] if ``return_lse`` (with
    sinks, the sink's term included). A row that sees no key gives ``o = 0`` and ``lse = -inf`` (the
    sink alone with sinks), never NaN.
    """
    b, t, s, h, hk, d, dv = check_attention_shapes(q, k, v)
    scale = check_scale(scale, d)
    causal = check_bool(causal, "causal")
    positions = check_positions(positions, b, t)
    kv_positions = check_positions(kv_positions, b, s, "kv_positions")
    window = check_window(window, s if positions is None and kv_positions is None and t <= s else None)
    segment_ids = check_segment_ids(segment_ids, b, t)
    if kv_segment_ids is None and segment_ids is not None and t != s:
        raise ValueError(f"segment_ids has the queries' length t = {t}; with keys of another length s = {s} "
                         f"pass kv_segment_ids [batch, s] too")
    kv_segment_ids = segment_ids if kv_segment_ids is None else check_segment_ids(kv_segment_ids, b, s,
                                                                                   "kv_segment_ids")
    if (kv_segment_ids is None) != (segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids for the queries too")
    bias = check_bias(bias, b, h, t, s)
    logit_softcap = check_softcap(logit_softcap)
    sinks = None if check_sinks(sinks, h) is None else np.asarray(sinks, np.float64)
    dropout_rate, seed = check_dropout(dropout_rate, dropout_key)
    q = np.asarray(q, dtype=np.float64)
    k, v = mark_bad_keys(k, v)

    logits = scale * np.einsum("bqhd,bkhd->bhqk", q, repeat_kv(k, h))  # (b, h, t, s)
    if logit_softcap is not None:
        logits = logit_softcap * np.tanh(logits / logit_softcap)
    q_pos = (np.arange(t) + s - t)[None] if positions is None else np.asarray(positions, np.int64)  # (b|1, t)
    k_pos = np.arange(s)[None] if kv_positions is None else np.asarray(kv_positions, np.int64)  # (b|1, s)
    if score_fn is not None:
        logits = call_score_fn(score_fn, logits, q_pos, k_pos, h)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        logits = np.where(bias == -np.inf, -np.inf, logits + bias)  # -inf masks even a NaN logit
    if padding_segment is not None and segment_ids is None:
        raise ValueError("padding_segment names a segment of segment_ids; pass segment_ids too")
    seg = (None, None) if segment_ids is None else (segment_ids[:, :, None], kv_segment_ids[:, None, :])
    if padding_segment is not None:  # its queries get an id no key has: they see nothing
        q_seg = np.asarray(seg[0], np.int64)
        seg = (np.where(q_seg == padding_segment, np.iinfo(np.int64).min, q_seg), seg[1])
    mask = allowed(q_pos[:, :, None], k_pos[:, None, :], *seg, causal=causal, window=window)  # (b|1, t, s)
    mask = mask[:, None]  # (b|1, 1, t, s)
    if mask_fn is not None:
        mask = mask & call_mask_fn(mask_fn, q_pos, k_pos, segment_ids, kv_segment_ids, b, h)
    logits = np.where(mask, logits, -np.inf)

    m = logits.max(axis=-1, keepdims=True)  # (b, h, t, 1); -inf for a row that sees nothing
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)  # (b, h, t, s); exactly 0 where masked
    l = p.sum(axis=-1)  # (b, h, t)
    if sinks is not None:
        l = l + np.exp(sinks[None, :, None] - m[..., 0])  # the sink's share: in the denominator only
    seen = l != 0  # NaN (a row that sees a bad key) counts as seen: it stays NaN
    p = p / np.where(seen, l, 1.0)[..., None]
    if seed is not None:
        p = p * dropout_mask(seed, dropout_rate, b, h, q_pos, k_pos)
    o = np.einsum("bhqk,bkhd->bqhd", p, repeat_kv(v, h))  # (b, t, h, dv)
    if not return_lse:
        return o
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m[..., 0] + np.log(np.where(seen, l, 1.0)), -np.inf)  # (b, h, t)
    return o, lse


def _grid(q_pos, k_pos, q_seg, k_seg, heads):
    """The arguments of a user function on the whole grid: ``[b|1, 1, t, 1]``, ``[b|1, 1, 1, s]``, head
    ``[1, heads, 1, 1]`` (segment ids 0 where the call has none)."""
    q_seg = np.zeros_like(q_pos) if q_seg is None else np.asarray(q_seg, np.int64)
    k_seg = np.zeros_like(k_pos) if k_seg is None else np.asarray(k_seg, np.int64)
    head = np.arange(heads)[None, :, None, None]
    return q_pos[:, None, :, None], k_pos[:, None, None, :], q_seg[:, None, :, None], k_seg[:, None, None, :], head


def _shapes(*arrays):
    return ", ".join(str(tuple(np.shape(a))) for a in arrays)


def call_mask_fn(mask_fn, q_pos, k_pos, q_seg, k_seg, batch, heads):
    """``mask_fn`` on the whole grid, checked: a bool array that broadcasts to ``[b, heads, t, s]``."""
    qp, kp, qs, ks, head = _grid(q_pos, k_pos, q_seg, k_seg, heads)
    need = (batch, heads, qp.shape[2], kp.shape[3])
    try:
        out = np.asarray(mask_fn(qp, kp, qs, ks, head))
    except Exception as e:  # noqa: BLE001 - the user's function: say how it was called
        raise ValueError(f"mask_fn raised {type(e).__name__}: {e}; it was called with q_pos, k_pos, q_seg, "
                         f"k_seg, head of shapes {_shapes(qp, kp, qs, ks, head)}") from e
    if out.dtype != np.bool_ or not broadcasts_to(out.shape, need):
        raise ValueError(f"mask_fn must return a bool array that broadcasts to [batch, heads, t, s] = {need}; got "
                         f"{out.dtype} {out.shape} from q_pos, k_pos, q_seg, k_seg, head of shapes "
                         f"{_shapes(qp, kp, qs, ks, head)}")
    return out


def call_score_fn(score_fn, logits, q_pos, k_pos, heads):
    """``score_fn`` on the whole grid, checked: it returns the logits' shape."""
    qp, kp, _, _, head = _grid(q_pos, k_pos, None, None, heads)
    try:
        out = np.asarray(score_fn(logits, qp, kp, head), np.float64)
    except Exception as e:  # noqa: BLE001 - the user's function: say how it was called
        raise ValueError(f"score_fn raised {type(e).__name__}: {e}; it was called with s, q_pos, k_pos, head of "
                         f"shapes {_shapes(logits, qp, kp, head)}") from e
    if out.shape != logits.shape:
        raise ValueError(f"score_fn must return the shape of s, {logits.shape}; got {out.shape} (called with s, "
                         f"q_pos, k_pos, head of shapes {_shapes(logits, qp, kp, head)})")
    return out
