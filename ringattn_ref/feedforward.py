"""Blockwise feedforward (Blockwise Parallel Transformer, Liu & Abbeel, arXiv:2305.19370, §3).

A transformer's feedforward network is position-wise: token ``t``'s output depends only on token
``t``'s input. So it can run on one chunk of ``block`` tokens at a time, and the large intermediate
activation (``[batch, seq, 4 * hidden]`` for the usual 4x expansion, ``8bsh`` bytes in bf16: Table 1
of arXiv:2310.01889) only ever exists for one chunk (``2bch`` for Ring Attention's ``c``-token
blocks). The result is exactly the same as applying the network to the whole sequence, because no
number is computed differently -- only fewer of them are alive at once.

With ``seq = 8`` and ``block = 4``: ``out[:, 0:4] = ffn(x[:, 0:4])``, ``out[:, 4:8] = ffn(x[:, 4:8])``.
"""
from __future__ import annotations

import numpy as np


def blockwise_feedforward(ffn, x, block):
    """Apply the position-wise callable ``ffn`` to ``x`` one block of ``block`` tokens at a time.

    - ffn: any callable mapping ``[batch, block, ...] -> [batch, block, ...]`` independently per
      position (numpy, JAX, ... -- nothing here depends on a framework);
    - x: ``[batch, seq, hidden]`` (any trailing dims are passed through);
    - block: positive int dividing ``seq``: the chunk length (BPT §3; ``c`` in Ring Attention).

    Returns ``[batch, seq, ...]``, equal to ``ffn(x)`` for a position-wise ``ffn``.
    """
    if not callable(ffn):
        raise ValueError(f"ffn must be a callable applied position-wise; got {type(ffn).__name__} {ffn!r}")
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) < 2:
        raise ValueError(f"x must be an array [batch, seq, hidden] (at least 2-D); got shape {shape}")
    seq = shape[1]
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int; got {block!r}")
    if seq % block:
        raise ValueError(f"block ({block}) must divide the sequence length (x.shape[1] = {seq})")
    outs = [ffn(x[:, start:start + block]) for start in range(0, seq, block)]  # each (b, block, ...)
    for start, out in zip(range(0, seq, block), outs):
        got = tuple(getattr(out, "shape", ()))
        if got[:2] != (shape[0], block):
            raise ValueError(f"ffn must keep [batch, block] = {(shape[0], block)} in front; on "
                             f"x[:, {start}:{start + block}] it returned shape {got}")
    # Concatenate in the output's own framework (array API), so a JAX ffn gives a JAX array.
    namespace = getattr(outs[0], "__array_namespace__", None)
    xp = namespace() if namespace is not None else np
    return xp.concat(outs, axis=1)  # (b, seq, ...)


def relu_ffn(w1, b1, w2, b2):
    """The transformer FFN of BPT §3, ``FFN(x) = max(0, x W1 + b1) W2 + b2``, as a numpy callable.

    w1: ``[hidden, ffn_hidden]``, b1: ``[ffn_hidden]``, w2: ``[ffn_hidden, hidden]``, b2: ``[hidden]``.
    The returned function maps ``[..., hidden] -> [..., hidden]`` position by position, so it can be
    passed to :func:`blockwise_feedforward`.
    """
    w1, b1, w2, b2 = (np.asarray(a) for a in (w1, b1, w2, b2))
    if w1.ndim != 2 or w2.ndim != 2:
        raise ValueError(f"w1 and w2 must be 2-D matrices; got w1 {w1.shape}, w2 {w2.shape}")
    hidden, ffn_hidden = w1.shape
    for name, arr, need in (("b1", b1, (ffn_hidden,)), ("w2", w2, (ffn_hidden, hidden)), ("b2", b2, (hidden,))):
        if arr.shape != need:
            raise ValueError(f"{name} must have shape {need} to match w1 {w1.shape}; got {arr.shape}")

    # einsum (no BLAS) computes every row by the same sequence of operations whatever the number of
    # rows, so blockwise_feedforward(ffn, x, block) == ffn(x) bit for bit. A BLAS matmul may pick a
    # different kernel for a different row count and differ in the last bit (~1e-16 relative).
    def ffn(x):
        h = np.maximum(0.0, np.einsum("...h,hf->...f", x, w1) + b1)  # (..., ffn_hidden): kept per block
        return np.einsum("...f,fh->...h", h, w2) + b2  # (..., hidden)

    return ffn
