"""An ``attention_fn`` for Flax's attention modules that runs the ring.

``nnx.MultiHeadAttention(..., attention_fn=flax_attention_fn(causal=True))`` (or linen's
``MultiHeadDotProductAttention``) computes what the stock ``flax.nnx.dot_product_attention`` does
— that is, ``jax.nn.dot_product_attention`` (whose ring twin is :mod:`.jax_nn`) plus attention
dropout — with the sequence sharded over the mesh. This module never imports flax: it only speaks
its calling convention, so ``import ringattn_fast`` works without it (``pip install ringattn[flax]``
for the modules themselves). ``docs/flax.md`` trains an ``nnx`` model with it.

What Flax may pass and what becomes of it:

- ``mask`` (broadcastable to ``[batch..., heads, T, S]``) is honoured, as an additive ``-inf`` bias:
  O(T * S) memory, like the mask the caller already built. The choice: refusing it would break every
  model that passes a padding mask, for no memory saved. For a causal or banded mask, pass
  ``causal=`` / ``window=`` here (O(S)) and no mask.
- ``is_causal`` (nnx) is or-ed with ``causal``; ``bias`` is added to the logits; ``dtype`` casts q, k,
  v (default: their promoted dtype); ``force_fp32_for_softmax`` holds always (the ring's softmax is
  float32); extra batch dimensions are flattened into one.
- Dropout (``dropout_rate > 0`` and not ``deterministic``) is the ring's attention dropout,
  ``ring_attention(..., dropout_rate=dropout_rate, dropout_key=dropout_rng)``: Flax's ``dropout_rng``
  (a threefry key) is the key, and without one it is a ValueError. The keep probability
  ``1 - dropout_rate`` and the scaling ``1 / (1 - dropout_rate)`` of the kept weights are Flax's; the
  mask is not. The ring draws it per (flattened) batch row, head and pair of true positions
  (``ringattn_ref.dropout``: a hash any host can compute, the same for every ring size and layout),
  so batch rows and heads get independent masks, while Flax's default ``broadcast_dropout=True``
  shares one mask across batch and heads (``broadcast_dropout`` is ignored: same keep probability,
  not the same correlation). A row that sees no key is the mean of V, undropped.
- Flax passes no soft-cap, sinks, mask or score function; :func:`flax_attention_fn` takes them
  (``logit_softcap``, ``sinks``, ``mask_fn``, ``score_fn``, as :func:`~ringattn_fast.ring_attention`)
  and binds them into every call. ``sinks`` bound so are constants: a learnable sink is a parameter,
  and Flax's modules neither hold one nor pass one to ``attention_fn`` (train it in a module of your
  own that calls ``ring_attention(..., sinks=self.sinks)``; ``docs/flax.md``). With ``mask_fn`` or
  ``score_fn`` the call goes to ``ring_attention`` itself (Flax's mask still an additive bias), and a
  row that sees no key is still the mean of V (o = 0 with sinks), as below.
- Refused with a ValueError, because the ring never forms the attention weights: weight sowing
  (``module``), custom einsums (``qk_attn_weights_einsum``, ``attn_weights_value_einsum``), a
  ``precision`` (the ring's matmuls use the default precision, accumulating in float32), and any
  other keyword (``input_positions``: RoPE). A query length other than the key length (Flax's
  ``decode=True``, cross-attention) is refused too: the ring shards both along one axis; decoding
  goes through ``ringattn_fast.init_cache`` / ``prefill`` / ``decode_step``.
"""
from __future__ import annotations

import math
from functools import reduce

import jax.numpy as jnp
from jax import lax

from ringattn_ref import validation as val

from .jax_nn import masked_ring_attention
from .ring import ring_attention


def _flatten_batch(x, batch):
    """A bias or mask [batch..., heads, T, S] (each dim equal or 1) as [prod(batch) | 1, heads, T, S]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)
    if all(n == 1 for n in x.shape[:len(batch)]):
        return x.reshape((1,) + x.shape[len(batch):])
    return jnp.broadcast_to(x, tuple(batch) + x.shape[len(batch):]).reshape((math.prod(batch),) + x.shape[len(batch):])


def _dropout(dropout_rate, deterministic, dropout_rng):
    """``(rate, key)`` for the ring: Flax's rate and rng when dropout is on, ``(0.0, None)`` otherwise."""
    if deterministic or dropout_rate == 0:
        return 0.0, None
    if dropout_rng is None:
        raise ValueError(f"dropout_rng is required when dropout_rate > 0 and deterministic=False (got "
                         f"dropout_rate={dropout_rate} and dropout_rng=None): it is the key of the ring's "
                         f"attention dropout; pass rngs (nnx) or a 'dropout' rng (linen), or deterministic=True")
    return dropout_rate, dropout_rng


def _refuse(module, precision, einsums, unsupported):
    """A ValueError for anything Flax passed that the ring cannot honour."""
    if module is not None:
        raise ValueError("sowing the attention weights (sow_weights=True / module=...) needs the weights, which "
                         "the ring never forms: call without sow_weights")
    if precision not in (None, lax.Precision.DEFAULT):
        raise ValueError(f"precision={precision!r} cannot be honoured: the ring's matmuls use the default "
                         f"precision, accumulating in float32; use precision=None")
    if any(e is not None for e in einsums):
        raise ValueError("custom einsums (qk_attn_weights_einsum, attn_weights_value_einsum) cannot be honoured: "
                         "the ring computes the logits inside its own hop")
    if unsupported:
        raise ValueError(f"flax_attention_fn cannot honour {sorted(unsupported)} (input_positions: apply RoPE to "
                         f"the projections yourself)")


def _programmed(q, k, v, *, bias, mask, sinks, **ring):
    """``masked_ring_attention``'s contract (dense mask as a bias; a row that sees no key is the mean of
    V, or 0 with sinks) for a call with ``mask_fn`` / ``score_fn``, which go to ``ring_attention``."""
    parts = [x for x in (bias, None if mask is None else jnp.where(mask, 0.0, -jnp.inf)) if x is not None]
    total = reduce(jnp.add, parts) if parts else None
    o, lse = ring_attention(q, k, v, bias=total, sinks=sinks, return_lse=True, **ring)
    if sinks is not None:  # a dead row: o = 0, lse = the sink (masked_ring_attention's rule with sinks)
        return o
    dead = jnp.swapaxes(jnp.isneginf(lse), 1, 2)[..., None]  # (b, T, h, 1)
    mean_v = jnp.repeat(jnp.mean(v.astype(lse.dtype), axis=1), q.shape[2] // k.shape[2], axis=1)  # (b, h, d_v)
    return jnp.where(dead, mean_v[:, None].astype(o.dtype), o)


def flax_attention_fn(*, mesh=None, axis_name="sp", causal=False, window=None, layout="contiguous", impl="auto",
                      logit_softcap=None, sinks=None, mask_fn=None, score_fn=None):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` / ``flax.linen.MultiHeadDotProductAttention``.

    causal, window ``(left, right)`` (-1 = unbounded), layout, impl, mesh, axis_name, and the
    programmable attention Flax does not pass, logit_softcap, sinks (float [heads], a constant),
    mask_fn and score_fn (``ringattn_ref.variants``): as :func:`~ringattn_fast.ring_attention`, fixed for
    every call. The returned function takes Flax's
    ``query, key, value`` ``[batch..., T, heads, dim]`` (T == S; K/V may have fewer heads) and its
    keywords (see the module docstring: a mask, a bias, dropout with Flax's ``dropout_rng`` as the
    key) and returns ``[batch..., T, heads, dim]``. For decoding (Flax's ``decode=True``, T != S) use
    ``ringattn_fast.init_cache`` / ``prefill`` / ``decode_step``.
    """
    causal = val.check_bool(causal, "causal")
    window = val.check_window(window)
    logit_softcap = val.check_softcap(logit_softcap)
    for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function; got {fn!r}")

    def attention_fn(query, key, value, bias=None, mask=None, *, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                     is_causal=False, force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None, **unsupported):
        """Flax's ``dot_product_attention`` signature (linen keeps only the keywords named here)."""
        _refuse(module, precision, (qk_attn_weights_einsum, attn_weights_value_einsum), unsupported)
        dropout_rate, dropout_key = _dropout(dropout_rate, deterministic, dropout_rng)
        dtype = jnp.result_type(query, key, value) if dtype is None else dtype
        q, k, v = (jnp.asarray(x, dtype) for x in (query, key, value))
        if not q.ndim == k.ndim == v.ndim >= 3:
            raise ValueError(f"query, key, value must be [batch..., length, heads, dim] alike; got shapes "
                             f"{q.shape}, {k.shape}, {v.shape}")
        if q.shape[-3] != k.shape[-3]:
            raise ValueError(f"query length {q.shape[-3]} must equal key length {k.shape[-3]}: the ring shards "
                             f"queries and keys along one sequence axis (self-attention). For decoding (Flax's "
                             f"decode=True: one query against the cached keys) use the ring's KV cache, "
                             f"ringattn_fast.init_cache / prefill / decode_step")
        batch, out_shape = q.shape[:-3], q.shape
        q, k, v = (x.reshape((math.prod(batch),) + x.shape[-3:]) for x in (q, k, v))
        mask = None if mask is None else jnp.asarray(mask).astype(jnp.bool_)
        bias, mask = (_flatten_batch(x, batch) for x in (bias, mask))
        is_causal = val.check_bool(is_causal, "is_causal")  # nnx passes it per call
        val.check_sinks(sinks, q.shape[2])
        ring = dict(causal=causal or is_causal, window=window, impl=impl, layout=layout, mesh=mesh,
                    axis_name=axis_name, dropout_rate=dropout_rate, dropout_key=dropout_key,
                    logit_softcap=logit_softcap)
        if mask_fn is None and score_fn is None:
            o, _ = masked_ring_attention(q, k, v, bias=bias, mask=mask, sinks=sinks, **ring)
        else:
            o = _programmed(q, k, v, bias=bias, mask=mask, sinks=sinks, mask_fn=mask_fn, score_fn=score_fn, **ring)
        return o.reshape(out_shape[:-1] + o.shape[-1:])

    return attention_fn
