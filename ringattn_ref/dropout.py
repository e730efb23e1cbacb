"""Attention dropout with a mask that is a pure function of (key, batch, head, query, key position).

Dropout on the attention probabilities (Vaswani et al. 2017 §5.4; the authors' package's
``attn_pdrop``): ``O = (P * M / (1 - rate)) V`` with ``P = softmax(S)`` and ``M`` a 0/1 keep mask,
``P(M = 1) = 1 - rate``. The normaliser (``l``, ``lse``) is that of the undropped ``P``: the online
softmax runs unchanged and only the ``P V`` product sees ``M``.

On a ring, a tile of ``P`` is computed on whichever host holds that K/V shard at that step, in
whichever block order. A random-number stream (``jax.random.bernoulli`` on the tile) would give a
different mask for every ring size, layout and block size. Here ``M[b, h, i, j]`` is a counter-based
hash (the murmur3 finaliser, ``fmix32``) of the key's two 32-bit words, the batch row ``b``, the head
``h`` and the *true* positions of query ``i`` and key ``j``: any host can compute any entry, and the
result is identical for every ring size, layout and block size (the backward recomputes the same
mask). The functions use array operators only, so the same code serves numpy (this package) and
``jnp`` (``ringattn_fast.kernels.xla``), as ``masks.allowed`` does.
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint32(0x9E3779B1)  # odd: multiplying by it is a bijection of uint32


def fmix32(x):
    """murmur3's 32-bit finaliser: a bijection of uint32 whose every output bit depends on every input bit."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def row_hash(seed, batch, head, q_pos):
    """Hash of (seed words, batch row, head, true query position): uint32, broadcast of the inputs.

    seed: uint32 [2] (numpy or jnp); batch, head, q_pos: non-negative integer arrays that broadcast
    together (e.g. [b, 1, 1], [1, h, 1], [b|1, 1, q]).
    """
    x = fmix32(seed[0:1] ^ fmix32(seed[1:2] + GOLDEN))  # (1,): array arithmetic wraps silently
    for word in (batch, head, q_pos):
        x = fmix32(x ^ (word.astype(np.uint32) * GOLDEN))
    return x


def keep_bits(rows, k_pos):
    """The 32 random bits of each (row, key): ``fmix32(row ^ k_pos * GOLDEN)``; rows [..., q, 1], k_pos [..., 1, k]."""
    return fmix32(rows ^ (k_pos.astype(np.uint32) * GOLDEN))


def threshold(rate):
    """The uint32 ``t`` with ``P(bits >= t) = 1 - rate`` for uniform bits (to 2**-32)."""
    return np.uint32(min(int(round(rate * 2.0 ** 32)), 2 ** 32 - 1))


def keep_scale(rows, k_pos, rate, dtype):
    """``M / (1 - rate)``: ``1 / (1 - rate)`` where kept, 0 where dropped, in ``dtype``."""
    return (keep_bits(rows, k_pos) >= threshold(rate)).astype(dtype) * (1.0 / (1.0 - rate))


def check_dropout_rate(rate, key):
    """``dropout_rate`` as a float in [0, 1), or a ValueError; also one if the rate is not 0 and
    ``dropout_key`` is None (there is no hidden default key)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)) or not 0 <= rate < 1:
        raise ValueError(f"dropout_rate must be a float in [0, 1); got {rate!r}")
    if rate > 0 and key is None:
        raise ValueError(f"dropout_key is required when dropout_rate > 0 (got dropout_rate={rate} and no "
                         f"dropout_key); pass e.g. jax.random.key(0) or an int seed (there is no default key)")
    return float(rate)


def int_seed_words(key):
    """An int seed in ``[0, 2**64)`` as two uint32 words (low, high), or a ValueError naming dropout_key."""
    if not 0 <= int(key) < 2 ** 64:
        raise ValueError(f"dropout_key as an int must be in [0, 2**64); got {key}")
    return np.array([int(key) & 0xFFFFFFFF, int(key) >> 32], np.uint32)


def check_dropout(rate, key):
    """Validate ``dropout_rate`` (a float in [0, 1)) and ``dropout_key``; returns ``(rate, seed)``.

    seed: numpy uint32 [2] from an int in ``[0, 2**64)`` (low word, high word) or from two uint32
    words (``jax.random.key_data(key)``, a raw ``jax.random.PRNGKey``); None when the rate is 0.
    """
    rate = check_dropout_rate(rate, key)
    if rate == 0:
        return rate, None
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return rate, int_seed_words(key)
    words = np.asarray(key)
    if words.shape != (2,) or words.dtype != np.uint32:
        raise ValueError(f"dropout_key must be an int seed or two uint32 words (jax.random.key_data(key)); got "
                         f"shape {words.shape}, dtype {words.dtype}")
    return rate, words


def dropout_mask(seed, rate, batch, heads, q_pos, k_pos):
    """The dense keep multiplier ``M / (1 - rate)`` float64 [batch, heads, q, k] for true positions
    q_pos [b|1, q] and k_pos [b|1, k] (the oracle's view of the mask every tile recomputes)."""
    rows = row_hash(seed, np.arange(batch)[:, None, None], np.arange(heads)[None, :, None], q_pos[:, None, :])
    return keep_scale(rows[..., None], k_pos[:, None, None, :], rate, np.float64)
