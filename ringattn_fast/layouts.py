"""Load-balanced sequence layouts on (sharded) global JAX arrays.

Same permutations as ``ringattn_ref.layouts`` (``layout_permutation`` is the single definition):
``to_layout`` reorders axis 1 so that host ``r`` owns the ``r``-th contiguous shard of the result,
``from_layout`` inverts it. Named layouts are written as reshapes/transposes where possible (XLA turns
those into an all-to-all on a sharded array instead of a gather).

``positions`` (int ``[batch, seq]``) gives each batch row its own permutation:
``to_layout(x, positions=pos)[b, p] = x[b, pos[b, p]]``, i.e. ``pos[b, p]`` is the true position of
the token placed at layout position ``p`` -- exactly what ``ring_attention_shard(positions=...)``
expects, sharded like the tokens.

Balanced layouts for packed documents and any mask (``ringattn_ref.balance``) are built in numpy, once per
configuration, and re-exported here: ``per_document_zigzag`` and ``balanced_layout`` return a ``Layout``
whose ``perm`` is ``ring_attention``'s ``layout=`` (``to_layout`` / ``from_layout`` take the ``Layout``
itself too).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ringattn_ref.balance import balanced_layout
from ringattn_ref.layouts import Layout, layout_permutation, per_document_zigzag
from ringattn_ref.validation import check_layout, check_n_hosts


def _check_positions(x, positions):
    shape = tuple(positions.shape)
    if shape != tuple(x.shape[:2]):
        raise ValueError(f"positions must have shape [batch, seq] = {tuple(x.shape[:2])}; got {shape}")
    if not np.issubdtype(np.dtype(positions.dtype), np.integer):
        raise ValueError(f"positions must be an integer array; got dtype {positions.dtype}")


def _take_rows(x, positions):
    """``out[b, p] = x[b, positions[b, p]]`` for any trailing dims."""
    idx = positions.reshape(positions.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def permute_axis(x, layout, n_hosts, axis=1, inverse=False):
    """Apply ``layout``'s permutation (or its inverse) to one axis of ``x`` (validated layout)."""
    seq = x.shape[axis]
    if isinstance(layout, str) and layout == "contiguous":
        return x
    x = jnp.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    if isinstance(layout, str) and layout == "striped":  # (S/N, N) <-> (N, S/N)
        grid = (n_hosts, seq // n_hosts) if inverse else (seq // n_hosts, n_hosts)
        x = jnp.swapaxes(x.reshape(grid + rest), 0, 1).reshape((seq,) + rest)
    elif isinstance(layout, str) and layout == "zigzag":  # 2N chunks: r, 2N-1-r, ...
        order = np.stack([np.arange(n_hosts), 2 * n_hosts - 1 - np.arange(n_hosts)], 1).reshape(-1)
        order = np.argsort(order) if inverse else order
        x = x.reshape((2 * n_hosts, seq // (2 * n_hosts)) + rest)[order].reshape((seq,) + rest)
    else:
        perm = layout_permutation(layout, seq, n_hosts)
        x = x[np.argsort(perm) if inverse else perm]
    return jnp.moveaxis(x, 0, axis)


def to_layout(x, layout="contiguous", n_hosts=None, *, positions=None):
    """Reorder axis 1 (the sequence) of ``x`` from true order into layout order.

    x: [batch, seq, ...]; layout: ``"contiguous" | "striped" | "zigzag"``, an int permutation of
    ``range(seq)`` or a ``Layout``; n_hosts: ring size. With ``positions`` (int [batch, seq]) each row is permuted by
    its own ``positions[b]`` instead, and ``layout``/``n_hosts`` are not used.
    """
    if positions is not None:
        _check_positions(x, positions)
        return _take_rows(x, positions)
    layout = layout.perm if isinstance(layout, Layout) else layout
    layout = check_layout(layout, x.shape[1])
    n_hosts = check_n_hosts(n_hosts, x.shape[1], layout)
    return permute_axis(x, layout, n_hosts, axis=1)


def from_layout(x, layout="contiguous", n_hosts=None, *, positions=None):
    """Inverse of :func:`to_layout`: bring axis 1 back to the tokens' true order."""
    if positions is not None:
        _check_positions(x, positions)
        return _take_rows(x, jnp.argsort(positions, axis=1))
    layout = layout.perm if isinstance(layout, Layout) else layout
    layout = check_layout(layout, x.shape[1])
    n_hosts = check_n_hosts(n_hosts, x.shape[1], layout)
    return permute_axis(x, layout, n_hosts, axis=1, inverse=True)


__all__ = ["Layout", "balanced_layout", "from_layout", "per_document_zigzag", "permute_axis", "to_layout"]
