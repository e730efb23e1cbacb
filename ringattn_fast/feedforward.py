"""Blockwise feedforward in JAX (Blockwise Parallel Transformer, arXiv:2305.19370, §3).

Mirrors ``ringattn_ref.feedforward``. The FFN is position-wise, so it can run on ``block`` tokens at a
time: ``lax.map`` over the chunks keeps only one chunk's ``[batch, block, 4 * hidden]`` intermediate
alive in the forward. With ``remat=True`` each chunk is wrapped in ``jax.checkpoint``, so the backward
recomputes that intermediate chunk by chunk instead of storing it for the whole sequence (Ring
Attention, arXiv:2310.01889, Table 1: FFN ``2bch`` instead of ``8bsh``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def blockwise_feedforward(ffn, x, *, block, remat=True):
    """Apply the position-wise JAX callable ``ffn`` to ``x`` one chunk of ``block`` tokens at a time.

    - ffn: maps ``[batch, block, ...] -> [batch, block, ...]`` independently per position (e.g. a
      closure over its weights; gradients flow to the weights it closes over);
    - x: ``[batch, seq, ...]``; block: positive int dividing ``seq``.

    Returns ``[batch, seq, ...]``, equal to ``ffn(x)``; jit-able and differentiable.
    """
    if not callable(ffn):
        raise ValueError(f"ffn must be a callable applied position-wise; got {type(ffn).__name__} {ffn!r}")
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) < 2:
        raise ValueError(f"x must be an array [batch, seq, hidden] (at least 2-D); got shape {shape}")
    batch, seq = shape[:2]
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int; got {block!r}")
    if seq % block:
        raise ValueError(f"block ({block}) must divide the sequence length (x.shape[1] = {seq})")
    fn = jax.checkpoint(ffn) if remat else ffn
    chunks = jnp.moveaxis(x.reshape((batch, seq // block, block) + shape[2:]), 1, 0)  # (n, b, block, ...)
    out_shape = jax.eval_shape(fn, chunks[0])
    if tuple(out_shape.shape[:2]) != (batch, block):
        raise ValueError(f"ffn must keep [batch, block] = {(batch, block)} in front; on a chunk of shape "
                         f"{tuple(chunks.shape[1:])} it returned shape {tuple(out_shape.shape)}")
    out = lax.map(fn, chunks)  # (n, b, block, ...)
    return jnp.moveaxis(out, 0, 1).reshape((batch, seq) + tuple(out_shape.shape[2:]))
