"""Argument checks shared by ``ringattn_ref`` and ``ringattn_fast``.

Every public function validates at its boundary with these helpers, so both packages raise the same
``ValueError`` messages: the argument's name, what was received, and what is needed. They look only
at ``.shape`` / ``.dtype``, so they work for numpy and JAX arrays (also under ``jax.jit`` tracing).
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("contiguous", "striped", "zigzag")


def is_float_dtype(dtype):
    """True for numpy floats and for the ml_dtypes floats JAX uses (bfloat16, float8_*), which numpy
    does not count as ``np.floating``."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or dtype.name.startswith(("bfloat", "float"))


def check_qkv(q, k, v):
    """Check q/k/v shapes and dtypes; return ``(batch, seq, heads, kv_heads, dim)``.

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] with heads % kv_heads == 0.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, dim]; got shape {tuple(x.shape)}")
        if not is_float_dtype(x.dtype):
            raise ValueError(f"{name} must be a floating-point array; got dtype {x.dtype}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    b, s, h, d = q.shape
    kb, ks, kh, kd = k.shape
    if (kb, ks, kd) != (b, s, d):
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: need "
            f"[batch={b}, seq={s}, kv_heads, dim={d}]")
    if kh < 1 or h % kh:
        raise ValueError(f"q heads ({h}) must be divisible by k/v heads ({kh}) for GQA/MQA; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return b, s, h, kh, d


def check_scale(scale, dim):
    """Return the logit scale: ``dim ** -0.5`` unless given; must be a positive finite number."""
    if scale is None:
        return float(dim) ** -0.5
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a positive number; got {scale!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return value


def check_window(window):
    """Normalise ``window`` to ``(left, right)`` ints (-1 = unbounded) or ``None``."""
    if window is None:
        return None
    try:
        left, right = window
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1; got {window!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window must be a pair (left, right) of ints >= -1 (-1 = unbounded); got {window!r}")
    return left, right


def check_segment_ids(segment_ids, batch, seq):
    """segment_ids: int [batch, seq] or None."""
    if segment_ids is None:
        return None
    shape = tuple(segment_ids.shape)
    if shape != (batch, seq):
        raise ValueError(f"segment_ids must have shape [batch, seq] = {(batch, seq)}; got {shape}")
    if not np.issubdtype(np.dtype(segment_ids.dtype), np.integer):
        raise ValueError(f"segment_ids must be an integer array; got dtype {segment_ids.dtype}")
    return segment_ids


def check_bias(bias, batch, heads, seq):
    """bias: broadcastable to [batch, heads, seq, seq] (each dim equal or 1), float, or None."""
    if bias is None:
        return None
    shape = tuple(bias.shape)
    need = (batch, heads, seq, seq)
    if len(shape) != 4 or any(g not in (1, n) for g, n in zip(shape, need)):
        raise ValueError(f"bias must be broadcastable to [batch, heads, seq, seq] = {need} "
                         f"(each dim equal or 1, 4-D); got shape {shape}")
    if not is_float_dtype(bias.dtype):
        raise ValueError(f"bias must be a floating-point array; got dtype {bias.dtype}")
    return bias


def check_n_hosts(n_hosts, seq, layout, *, name="n_hosts"):
    """The sequence must split evenly: by ``n_hosts``, or by ``2 * n_hosts`` for zigzag."""
    if not isinstance(n_hosts, (int, np.integer)) or isinstance(n_hosts, bool) or n_hosts < 1:
        raise ValueError(f"{name} must be a positive int; got {n_hosts!r}")
    parts = 2 * n_hosts if isinstance(layout, str) and layout == "zigzag" else n_hosts
    if seq % parts:
        what = f"2*{name} = {parts} (zigzag layout)" if parts != n_hosts else f"{name} = {n_hosts}"
        raise ValueError(f"seq ({seq}) must be divisible by {what}")
    return int(n_hosts)


def check_layout(layout, seq):
    """``layout`` must be a known name or an integer permutation of ``range(seq)``."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or a permutation array; got {layout!r}")
        return layout
    perm = np.asarray(layout)
    if perm.ndim != 1 or perm.shape[0] != seq or not np.issubdtype(perm.dtype, np.integer):
        raise ValueError(f"layout permutation must be a 1-D int array of length seq = {seq}; "
                         f"got shape {perm.shape}, dtype {perm.dtype}")
    if not np.array_equal(np.sort(perm), np.arange(seq)):
        raise ValueError(f"layout array must be a permutation of range({seq}); got {perm!r}")
    return perm


def check_block(block, shard, name):
    """A tile size must divide the per-host shard; ``None`` means the whole shard."""
    if block is None:
        return shard
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{name} must be a positive int; got {block!r}")
    if shard % block:
        raise ValueError(f"{name} ({block}) must divide the per-host shard length ({shard})")
    return int(block)


def check_cotangent(do, q_shape, name="do"):
    """The output cotangent must be a float array shaped like q: [batch, seq, heads, dim]."""
    if tuple(do.shape) != tuple(q_shape):
        raise ValueError(f"{name} must have the shape of q {tuple(q_shape)}; got {tuple(do.shape)}")
    if not is_float_dtype(do.dtype):
        raise ValueError(f"{name} must be a floating-point array; got dtype {do.dtype}")
    return do
