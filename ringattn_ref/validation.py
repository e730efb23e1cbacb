"""Argument checks shared by ``ringattn_ref`` and ``ringattn_fast``.

Every public function validates at its boundary with these helpers, so both packages raise the same
``ValueError`` messages: the argument's name, what was received, and what is needed. They look at
``.shape`` / ``.dtype``, so they work for numpy and JAX arrays (also under ``jax.jit`` tracing), and at
the values of integer ids and positions only when those are known (not traced).
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("contiguous", "striped", "zigzag")
INT32_MAX = 2**31 - 1  # positions and segment ids travel (and are compared) as int32
SEGMENT_MIN = -INT32_MAX + 1  # the two smallest int32 ids are reserved (ringattn_fast.padding)


def is_float_dtype(dtype):
    """True for numpy floats and for the ml_dtypes floats JAX uses (bfloat16, float8_*), which numpy
    does not count as ``np.floating``."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or dtype.name.startswith(("bfloat", "float"))


def _check_4d_float(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, dim]; got shape {tuple(x.shape)}")
        if not is_float_dtype(x.dtype):
            raise ValueError(f"{name} must be a floating-point array; got dtype {x.dtype}")


def check_qkv(q, k, v, *, value_width=False):
    """Check q/k/v shapes and dtypes; return ``(batch, seq, heads, kv_heads, dim)``.

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] with heads % kv_heads == 0.
    ``value_width=True``: v may have a width of its own, [batch, seq, kv_heads, dim_v] (MLA).
    """
    _check_4d_float(q, k, v)
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token; got shape {tuple(q.shape)} (seq = 0)")
    if tuple(k.shape[:3]) != tuple(v.shape[:3]) or (not value_width and k.shape[3] != v.shape[3]):
        need = "the same [batch, seq, kv_heads]" if value_width else "the same shape"
        raise ValueError(f"k and v must have {need}; got k {tuple(k.shape)} and v {tuple(v.shape)}")
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


def check_attention_shapes(q, k, v):
    """Shapes of the general attention the oracle computes; return ``(batch, t, s, heads, kv_heads, dim, dim_v)``.

    q: [batch, t, heads, dim]; k: [batch, s, kv_heads, dim]; v: [batch, s, kv_heads, dim_v]: queries and
    keys may differ in length (cross-attention, ``t != s``) and values in width (MLA: ``dim_v != dim``).
    """
    _check_4d_float(q, k, v)
    (b, t, h, d), (kb, s, kh, kd), (vb, vs, vh, dv) = q.shape, k.shape, v.shape
    if t < 1 or s < 1:
        raise ValueError(f"q and k must hold at least one token; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if (kb, kd) != (b, d) or (vb, vs, vh) != (b, s, kh):
        raise ValueError(f"need q [batch={b}, t, heads, dim={d}], k [batch={b}, s, kv_heads, dim={d}] and v "
                         f"[batch={b}, s, kv_heads, dim_v] (v like k but its width); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kh < 1 or h % kh:
        raise ValueError(f"q heads ({h}) must be divisible by k/v heads ({kh}) for GQA/MQA; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return b, t, s, h, kh, d, dv


def broadcasts_to(shape, need):
    """Whether an array of ``shape`` broadcasts to exactly ``need`` (a user function's mask)."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(need)) == tuple(need)
    except ValueError:
        return False


def check_softcap(logit_softcap):
    """``logit_softcap``: None, or a positive finite real number (not a bool): ``s = c * tanh(s / c)``."""
    if logit_softcap is None:
        return None
    if isinstance(logit_softcap, (bool, np.bool_)) or not isinstance(logit_softcap, (int, float, np.number)):
        raise ValueError(f"logit_softcap must be a positive finite real number (not a bool or a string); got "
                         f"{logit_softcap!r} of type {type(logit_softcap).__name__}")
    if not (np.isfinite(logit_softcap) and logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive finite number; got {logit_softcap!r}")
    return float(logit_softcap)


def check_sinks(sinks, heads):
    """``sinks``: None, or one float logit per query head, shape ``[heads]``; returned as an array (a list
    or tuple of floats becomes a float32 numpy array; an array is returned as it is)."""
    if sinks is None:
        return None
    if not hasattr(sinks, "dtype"):
        try:
            sinks = np.asarray(sinks)
        except (TypeError, ValueError):
            raise ValueError(f"sinks must be a floating-point array of shape [heads] = ({heads},); got "
                             f"{type(sinks).__name__} {sinks!r:.80}") from None
        sinks = sinks.astype(np.float32) if sinks.dtype == np.float64 else sinks
    shape, dtype = tuple(np.shape(sinks)), sinks.dtype
    if shape != (heads,) or not is_float_dtype(dtype):
        raise ValueError(f"sinks must be a floating-point array of shape [heads] = ({heads},), one logit per "
                         f"query head; got {dtype} {shape}")
    return sinks


def check_scale(scale, dim):
    """Return the logit scale: ``dim ** -0.5`` unless given; a positive finite real number, not a bool
    (``scale=True`` would otherwise run with scale 1) or a string."""
    if scale is None:
        return float(dim) ** -0.5
    if isinstance(scale, (bool, np.bool_, str, bytes)) or getattr(getattr(scale, "dtype", None), "kind", "") == "b":
        raise ValueError(f"scale must be a positive finite real number (bools and strings are not scales); "
                         f"got {scale!r} of type {type(scale).__name__}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a positive number; got {scale!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return value


def check_bool(value, name):
    """A flag must be a real bool (``causal="False"`` would otherwise be truthy); returns a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool (True or False); got {value!r} of type {type(value).__name__}")
    return bool(value)


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_window(window, seq=None):
    """Normalise ``window`` to ``(left, right)`` ints (-1 = unbounded) or ``None``.

    Each bound must be an int (not a bool, float or str) >= -1. A bound that no pair can exceed is
    unbounded, so it is clamped to -1 before any int32 arithmetic: one of at least ``seq - 1`` (the
    largest distance between two of ``seq`` tokens) when ``seq`` is given, and one beyond int32 always.
    Example: ``check_window((10**12, 0)) == (-1, 0)``; ``check_window((8, 8), seq=8) == (-1, -1)``.
    """
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1; got {window!r}") from None
    if not (_is_int(left) and _is_int(right)) or left < -1 or right < -1:
        raise ValueError(f"window must be a pair (left, right) of ints >= -1 (-1 = unbounded), not bools, "
                         f"floats or strings; got {window!r}")
    limit = INT32_MAX if seq is None else min(INT32_MAX, max(int(seq) - 1, 0))
    return tuple(-1 if int(w) >= limit else int(w) for w in (left, right))


def concrete_values(x):
    """``x`` as a numpy array when its values are known now (numpy, a concrete jax array), else None."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)  # a jax tracer raises here
    except Exception:  # noqa: BLE001 - any tracer error means "values unknown at trace time"
        return None


def is_wide_int(dtype):
    """True for an integer dtype holding values beyond int32 (int64, uint32, uint64): cast to int32, they
    would wrap (``uint32(2**31)`` becomes ``-2**31``, a reserved segment id)."""
    info = np.iinfo(np.dtype(dtype))
    return info.max > INT32_MAX or info.min < -INT32_MAX - 1


def check_int32_values(x, name, *, low=-INT32_MAX - 1, traced_wide_ok=False):
    """Integer ids/positions are compared as int32: values outside ``[low, 2**31)`` would wrap and, e.g.,
    merge two documents silently. Checked when the values are known (not under ``jax.jit``); a traced
    array of a dtype wider than int32 (int64, uint32, uint64: :func:`is_wide_int`) is rejected, as its
    values cannot be checked, unless ``traced_wide_ok`` (positions: a 64-bit ``arange`` under x64 is
    common; the ring then marks an out-of-range position at run time, ``front.int32_positions``)."""
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {x.dtype}")
    values = concrete_values(x)
    if values is None:
        if is_wide_int(x.dtype) and not traced_wide_ok:
            raise ValueError(f"{name} has dtype {x.dtype} and values that cannot be read here (traced under "
                             f"jax.jit, or spread over several processes), so they cannot be checked against "
                             f"the int32 range they are compared in; pass int32 {name}")
        return x
    if values.size and (values.min() < low or values.max() > INT32_MAX):
        raise ValueError(f"{name} must lie in [{low}, {INT32_MAX}] (compared as int32); got values in "
                         f"[{values.min()}, {values.max()}]")
    return x


def check_segment_ids(segment_ids, batch, seq, name="segment_ids"):
    """segment_ids: int [batch, seq] or None, values in ``[-2**31 + 2, 2**31)``.

    The two smallest int32 values are reserved: ``-2**31`` (``ringattn_fast.padding.NO_KEY``, the id
    a padding query gets) and ``-2**31 + 1`` (``padding.PADDING``, the padding segment when none is
    named). Known ids are checked here; traced ones cannot be, and are ranked by ``ring_attention``
    (``padding.rank_segment_ids``) or must be int32 for a per-host call.
    """
    if segment_ids is None:
        return None
    shape = tuple(segment_ids.shape)
    if shape != (batch, seq):
        raise ValueError(f"{name} must have shape [batch, seq] = {(batch, seq)}; got {shape}")
    values = concrete_values(segment_ids) if np.issubdtype(np.dtype(segment_ids.dtype), np.integer) else None
    if values is not None and values.size and SEGMENT_MIN - 2 <= values.min() < SEGMENT_MIN:
        raise ValueError(f"{name} must not hold the reserved ids -2**31 and -2**31 + 1 (padding.NO_KEY, "
                         f"padding.PADDING: the padding's own ids); got a minimum of {values.min()}; any other "
                         f"int32 id is yours")
    return check_int32_values(segment_ids, name, low=SEGMENT_MIN)


def check_positions(positions, batch, seq, name="positions"):
    """True positions: int [batch, seq] in ``[0, 2**31)``, or None."""
    if positions is None:
        return None
    shape = tuple(positions.shape)
    if shape != (batch, seq):
        raise ValueError(f"{name} must have shape [batch, seq] = {(batch, seq)}; got {shape}")
    return check_int32_values(positions, name, low=0, traced_wide_ok=True)


def check_bias(bias, batch, heads, seq, kv_seq=None):
    """bias: broadcastable to [batch, heads, seq, kv_seq] (each dim equal or 1; ``kv_seq`` defaults to
    ``seq``), float, or None."""
    if bias is None:
        return None
    shape = tuple(bias.shape)
    need = (batch, heads, seq, seq if kv_seq is None else kv_seq)
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


def check_cotangent(do, o_shape, name="do"):
    """The output cotangent must be a float array shaped like the output o: [batch, seq, heads, dim_v]."""
    if tuple(do.shape) != tuple(o_shape):
        raise ValueError(f"{name} must have the shape of the output {tuple(o_shape)}; got {tuple(do.shape)}")
    if not is_float_dtype(do.dtype):
        raise ValueError(f"{name} must be a floating-point array; got dtype {do.dtype}")
    return do
