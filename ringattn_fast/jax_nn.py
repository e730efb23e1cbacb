"""``jax.nn.dot_product_attention``'s twin: the same arguments and results, computed by the ring.

A model written against ``jax.nn.dot_product_attention(query, key, value, bias, mask, *, scale,
is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size, implementation,
return_residual)`` switches to the ring by changing the import (and, optionally, passing ``mesh``).
What maps onto what (``jax.nn`` -> ``ring_attention``):

- ``[T, N, H]`` and ``[B, T, N, H]`` -> ``[batch, seq, heads, dim]`` (3-D is batch 1); K/V may have
  fewer heads (GQA, ``N % K == 0``); ``T != S`` is cross-attention (queries and keys each sharded
  over the ring); ``jax.nn`` aligns the causal and window masks top-left then (query ``i`` sees key
  ``j <= i``) where the ring aligns them bottom-right (``j <= i + S - T``, the last T of S positions),
  so the twin passes them as a ``mask_fn`` shifted by ``S - T`` (the XLA hop);
- ``is_causal`` -> ``causal``; ``local_window_size=w`` -> ``window=(w, w)``, ``(left, right)`` as is
  (both ``>= 0``); ``scale`` -> ``scale``; ``implementation``: None -> ``impl="auto"``, ``"xla"``;
- ``key_value_seq_lengths`` -> a key-only bias, ``-inf`` at positions ``>= lengths[b]``:
  ``[B, 1, 1, S]``, O(S), it travels with K/V;
- ``query_seq_lengths`` -> the rows at positions ``>= lengths[b]`` are zeroed, their q before the
  ring and their output after it: O(S);
- ``mask`` (bool) -> an additive bias, ``-inf`` where False: O(T * S) memory, like the mask;
- ``bias`` -> ``bias`` (added to the scaled logits), summed with the two biases above;
- ``return_residual`` -> ``return_lse``, transposed to JAX's ``[B, T, N]`` in key's dtype.

JAX fills masked logits with a large negative number (``-0.7 * finfo(float32).max``), not ``-inf``,
so a row whose mask leaves it no key gets uniform weights: its output is the mean of *all* values,
and its residual is that number ``+ log(S)``. The ring gives such a row ``o = 0, lse = -inf``;
:func:`masked_ring_attention` converts it, so both functions return the same on every row.
"""
from __future__ import annotations

import functools
import math
from functools import reduce

import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import validation as val

from .ring import ring_attention
from .softmax import add_sinks

_JAX_IMPLS = {None: "auto", "xla": "xla"}


def _jax_fill(dtype):
    """JAX's value for a masked logit, ``-0.7 * finfo(dtype).max`` capped at float32's range."""
    return -0.7 * min(float(jnp.finfo(dtype).max), float(jnp.finfo(np.float32).max))


def _as_4d(x, name):
    """Leading unit axes up to 4-D, as ``jax.nn`` does (a ``[T, N, H]`` query is batch 1)."""
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims (jax.nn.dot_product_attention's shapes); "
                         f"got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcastable(x, name, shape):
    """``x`` (bias or mask, 4-D by now) must broadcast to ``shape`` = [B, N, T, S], dim by dim."""
    if x is not None and (x.ndim != 4 or any(m not in (1, n) for m, n in zip(x.shape, shape))):
        raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {shape} (each dim equal or 1); "
                         f"got shape {x.shape}")


def _lengths(lengths, batch, seq, name):
    """Sequence lengths: an integer ``[B]`` array (traced is fine: only its shape is inspected), clipped to
    ``[0, seq]`` in its own dtype before the int32 cast. Only ``position < length`` is ever asked, so
    clipping changes no answer, and an int64 length of ``2**32 + 3`` means every position (as in
    ``jax.nn``), not 3: a plain cast would wrap it silently under ``jit``."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape (batch,) = ({batch},); "
                         f"got {lengths.dtype} {lengths.shape}")
    return jnp.clip(lengths, 0, seq).astype(jnp.int32)


def _window(local_window_size):
    """``local_window_size`` (an int or ``(left, right)``, JAX's meaning) as the ring's ``window``.

    JAX's bounds are distances from the diagonal: ``(3, 2)`` lets token ``i`` see ``i-3 .. i+2``, the
    ring's meaning too. A negative bound in JAX cuts the diagonal out; the ring's ``-1`` means
    unbounded instead, so negative bounds are refused.
    """
    if local_window_size is None:
        return None
    window = (local_window_size,) * 2 if isinstance(local_window_size, (int, np.integer)) else local_window_size
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"local_window_size must be an int or a pair (left, right) of ints; "
                         f"got {local_window_size!r}") from None
    ok = all(isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) and w >= 0 for w in window)
    if not ok:
        raise ValueError(f"local_window_size bounds must be ints >= 0 (a negative bound excludes the diagonal "
                         f"in jax.nn, which the ring cannot express: its -1 means unbounded); "
                         f"got {local_window_size!r}")
    return int(left), int(right)


@functools.lru_cache(maxsize=64)  # one function per configuration: the ring's compiled programs are cached by it
def _top_left(causal, window, shift):
    """``jax.nn``'s causal / window masks for ``T != S`` (query ``i`` against key ``j``, no offset) as a
    ``mask_fn`` of the ring's true positions, where query ``i`` sits at ``i + shift`` (``shift = S - T``)."""
    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        i = q_pos - shift
        ok = (k_pos - i) == (k_pos - i)  # all True, broadcast to the tile
        if causal:  # jnp, as a user writes a mask_fn (issue 31): eager, traced and on the block table alike
            ok = jnp.logical_and(ok, k_pos <= i)
        if window is not None:
            ok = jnp.logical_and(ok, jnp.logical_and(i - k_pos <= window[0], k_pos - i <= window[1]))
        return ok
    return mask_fn


def _impl(implementation):
    """``implementation`` as the ring's ``impl``; ``"cudnn"`` (a single-device kernel) is refused."""
    if implementation == "cudnn":
        raise ValueError("implementation='cudnn' is cuDNN's single-device flash kernel; the ring runs its own "
                         "per-hop kernels: use implementation=None ('auto': Pallas on GPU/TPU, XLA otherwise) "
                         "or 'xla'")
    if implementation not in _JAX_IMPLS:
        raise ValueError(f"implementation must be None ('auto') or 'xla' (jax.nn's 'cudnn' is refused: the "
                         f"ring runs its own kernels); got {implementation!r}")
    return _JAX_IMPLS[implementation]


def masked_ring_attention(q, k, v, *, bias=None, mask=None, q_lengths=None, kv_lengths=None, causal=False,
                          window=None, scale=None, impl="auto", layout="contiguous", mesh=None, axis_name="sp",
                          dropout_rate=0.0, dropout_key=None, logit_softcap=None, sinks=None):
    """Ring attention with ``jax.nn``'s dense masks and its rule for rows that see no key: ``(o, lse)``.

    q: [B, T, N, H]; k, v: [B, S, K, H]; bias: float, mask: bool, both broadcastable to [B, N, T, S];
    q_lengths, kv_lengths: int32 [B] (queries / keys at positions ``>= lengths[b]`` are padding);
    causal, window, scale, impl, layout, mesh, axis_name, dropout_rate, dropout_key: as
    :func:`~ringattn_fast.ring_attention` (``jax.nn`` has no dropout; the Flax adapter passes it on).
    Returns o [B, S, N, H] in q's dtype and lse [B, N, S] float32 (float64 for float64 inputs).
    A row that sees no key gets JAX's values (mean of V, ``fill + log S``); padded queries get o = 0.
    logit_softcap, sinks: as :func:`~ringattn_fast.ring_attention` (beyond ``jax.nn``; the cap applies to
    the scaled logits before ``bias`` and the masks are added, as Gemma 2 does); with sinks a row
    that sees no key gets what a sink column would give it under JAX's fill: o = 0, lse = the sink.
    """
    b, t, h = q.shape[:3]
    s = k.shape[1]
    for name, x in (("bias", bias), ("mask", mask)):
        _check_broadcastable(x, name, (b, h, t, s))
    val.check_sinks(sinks, h)  # float [N] only: before any compute (add_sinks would broadcast [N + 1] late)
    mask_fn = None
    if t != s and (causal or window is not None):  # jax.nn's top-left alignment
        mask_fn, causal, window = _top_left(causal, window, s - t), False, None
    pos = jnp.arange(s, dtype=jnp.int32)
    parts = [] if bias is None else [bias]  # the additive bias, in pieces of the smallest shapes
    if mask is not None:
        parts.append(jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32))
    if kv_lengths is not None:  # key-only [B, 1, 1, S]: it travels with K/V
        parts.append(jnp.where(pos < kv_lengths[:, None], 0.0, -jnp.inf).astype(jnp.float32)[:, None, None])
    q_valid = None if q_lengths is None else jnp.arange(t, dtype=jnp.int32) < q_lengths[:, None]  # [B, T]
    if q_valid is not None:  # a padded query's values (NaN, say) must not reach any gradient
        q = jnp.where(q_valid[:, :, None, None], q, jnp.zeros((), q.dtype))
    total = reduce(jnp.add, parts) if parts else None
    o, lse = ring_attention(q, k, v, mesh=mesh, axis_name=axis_name, causal=causal, bias=total, window=window,
                            scale=scale, layout=layout, impl=impl, return_lse=True, dropout_rate=dropout_rate,
                            dropout_key=dropout_key, logit_softcap=logit_softcap, mask_fn=mask_fn)
    if sinks is not None:  # JAX's fill logits are far below any sink: the sink takes a dead row's weight
        if q_valid is not None:
            lse = jnp.where(q_valid[:, None, :], lse, -jnp.inf)
        return add_sinks(o, lse, sinks)
    dead = jnp.isneginf(lse)  # [B, N, S]: rows the masks left without a key
    mean_v = jnp.repeat(jnp.mean(v.astype(lse.dtype), axis=1), h // k.shape[2], axis=1)  # [B, N, H]
    o = jnp.where(jnp.swapaxes(dead, 1, 2)[..., None], mean_v[:, None].astype(o.dtype), o)
    if q_valid is not None:
        o = jnp.where(q_valid[:, :, None, None], o, jnp.zeros((), o.dtype))
        dead = dead | ~q_valid[:, None, :]  # JAX masks padded queries' logits too
    fill = jnp.asarray(_jax_fill(lse.dtype), lse.dtype) + jnp.asarray(math.log(s), lse.dtype)  # logsumexp of S fills
    return o, jnp.where(dead, fill, lse)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, mesh=None, axis_name="sp",
                          layout="contiguous", logit_softcap=None, sinks=None):
    """``jax.nn.dot_product_attention`` computed by the ring over ``mesh``'s axis ``axis_name``.

    query: [B, T, N, H] or [T, N, H]; key, value: [B, S, K, H] or [S, K, H] (``N % K == 0``; ``T != S``:
    cross-attention, masks aligned top-left as in ``jax.nn``); bias (float) and mask (bool, True =
    attend) broadcastable to [B, N, T, S] (a mask costs O(T * S) memory: prefer ``is_causal``,
    ``local_window_size`` and the seq lengths, which cost O(S)); scale: a Python number (default
    ``H ** -0.5``). ``mesh``, ``axis_name``, ``layout``: as :func:`~ringattn_fast.ring_attention`; so
    are ``logit_softcap`` and ``sinks`` [N], keywords beyond ``jax.nn``'s. ``logit_softcap`` ``c`` caps
    the scaled logits *before* ``bias`` (and the masks, which become a ``-inf`` bias) are added, as
    Gemma 2 does: a masked logit stays ``-inf`` instead of being capped to ``-c``, and the bias stays
    exact. Tokamax's attention caps after adding the bias, so the two differ wherever a bias is given
    (they agree without one); see ``ring_attention`` for writing that order as a ``score_fn``. Returns the output like
    query, in its dtype; with ``return_residual`` also the log-sum-exp of each
    row's masked, scaled logits, [B, T, N] (or [T, N]) in key's dtype, without gradient — as ``jax.nn``.
    """
    out_shape = jnp.shape(query)
    if len(out_shape) not in (3, 4) or jnp.ndim(key) != len(out_shape) or jnp.ndim(value) != len(out_shape):
        raise ValueError(f"query, key and value must all be 3-D [T, N, H] or all 4-D [B, T, N, H]; got "
                         f"{out_shape}, {jnp.shape(key)}, {jnp.shape(value)}")
    q, k, v = _as_4d(query, "query"), _as_4d(key, "key"), _as_4d(value, "value")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"query, key and value must share one dtype (as in jax.nn); got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    bias = None if bias is None else _as_4d(bias, "bias")
    mask = None if mask is None else _as_4d(mask, "mask")
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be a bool array (True = attend; an additive mask goes in bias); "
                         f"got dtype {mask.dtype}")
    o, lse = masked_ring_attention(
        q, k, v, bias=bias, mask=mask, causal=is_causal, window=_window(local_window_size), scale=scale,
        q_lengths=_lengths(query_seq_lengths, q.shape[0], q.shape[1], "query_seq_lengths"),
        kv_lengths=_lengths(key_value_seq_lengths, q.shape[0], k.shape[1], "key_value_seq_lengths"),
        impl=_impl(implementation), layout=layout, mesh=mesh, axis_name=axis_name, logit_softcap=logit_softcap,
        sinks=sinks)
    o = o.reshape(out_shape)
    if not return_residual:
        return o
    residual = lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))  # [B, N, T] -> JAX's [B, T, N]
    return o, residual.reshape(out_shape[:-1])
