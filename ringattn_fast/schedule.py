"""What the forward and the backward ring share: what stays, what travels, and in which order.

Ring Attention (arXiv:2310.01889, Algorithm 1) on ``N = axis_size`` hosts: host ``my_idx`` keeps its
query shard (a :class:`QShard`) and, at ring step ``step``, holds K/V shard
``kv_idx = (my_idx - step) % N`` (the authors' index arithmetic): with 4 hosts, at step 1 host 0 holds
K/V shard 3. A :class:`KVShard` (K, V, their true positions, segment ids and a key-only bias) moves
to host ``my_idx + 1`` with one ``lax.ppermute`` of the whole named tuple, as ``ringattn_ref.ring``
moves its ``KVShard``. The per-hop functions (``kernels/``) all take ``(QShard, KVShard, HopConfig)``;
those three (and ``HopGrads``, ``KVGrads``) are defined once, in ``ringattn_ref.shards``, so the float64
oracles take the very objects the kernels do.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ringattn_ref.shards import HopConfig, HopGrads, KVGrads, KVShard, QShard

__all__ = ["Dropout", "HopConfig", "HopGrads", "KVGrads", "KVShard", "QShard", "RingConfig", "hop_kv", "kv_index",
           "local_positions", "ring_balance", "ring_loop", "ring_perm", "send_to_next", "single_hop"]


class Dropout(NamedTuple):
    """The traced half of attention dropout: seed uint32 [2] (the key's words) and the global index of
    this host's first batch row and first head (uint32 scalars), so that the mask
    (``ringattn_ref.dropout``) is a function of global batch row, head and true positions."""
    seed: jax.Array
    batch_offset: jax.Array
    head_offset: jax.Array


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static settings of one ring call (hashable: a ``custom_vjp`` non-differentiable argument).

    - bias_mode: ``None``; ``"columns"`` (local ``[b|1, h|1, sq|1, N*sk]``: all key columns, sliced
      per hop); ``"travel"`` (key-only ``[b|1, h|1, 1, sk]``, moves with K/V); ``"static"`` (key
      dim 1);
    - skip_empty_hops: skip a hop whose mask is provably empty with ``lax.cond`` around it; off for
      a kernel that must run on every host at every step (the TPU interpreter's barrier;
      ``kernels.IMPLS``);
    - comm_dtype / grad_comm_dtype: what K/V and dK/dV travel in (``comm.py``; None: as they are);
    - block_mask: the ``block_mask.BlockMaskSpec`` of a ``mask_fn`` whose empty hops and tiles are known
      statically, or None.
    """
    axis_name: str
    hop: HopConfig
    impl: str = "xla"
    bias_mode: str | None = None
    skip_empty_hops: bool = True
    comm_dtype: str | None = None
    grad_comm_dtype: str | None = None
    block_mask: object = None


def ring_perm(n):
    """``lax.ppermute`` pairs: host ``i`` sends to host ``i + 1`` (mod ``n``)."""
    return [(i, (i + 1) % n) for i in range(n)]


def send_to_next(x, axis_name):
    """Send a pytree (a :class:`KVShard`, or gradients) one host along the ring: one ppermute."""
    return lax.ppermute(x, axis_name, ring_perm(lax.axis_size(axis_name)))


def ring_loop(step_fn, carry, n, first=0):
    """``carry = step_fn(carry, step)`` for ``step = first .. n - 2`` as one XLA while loop.

    The trip count is hidden behind an optimization barrier so XLA keeps the loop even when it runs
    once (``n = 2``) or not at all: every ring size then runs the same program with the same buffers (K/V
    being used + K/V being received), and per-device memory does not depend on ``n``.
    """
    trips = lax.optimization_barrier(jnp.int32(n - 1 - first))
    return lax.fori_loop(0, trips, lambda i, c: step_fn(c, i + first), carry)


def single_hop(hop, dtype):
    """``hop`` for a ring of one host: the kernel may return o and the gradients in the inputs' ``dtype``
    (``HopConfig.out_dtype``), since nothing is merged across hops; float64 keeps its accumulators."""
    return hop if jnp.dtype(dtype) == jnp.float64 else dataclasses.replace(hop, out_dtype=jnp.dtype(dtype).name)


def kv_index(my_idx, step, n):
    """The K/V shard host ``my_idx`` holds at ring step ``step``: ``(my_idx - step) % n``."""
    return (my_idx - step) % n


def local_positions(layout, seq_local, axis_name, batch):
    """True positions (int32 ``[batch, seq_local]``) of this host's tokens under ``layout``.

    Host ``r`` of ``N`` owns layout positions ``r*seq_local + i``; ``perm`` of ``ringattn_ref.layouts``
    maps them to true positions: contiguous ``r*seq_local + i``; striped ``i*N + r``; zigzag chunk
    ``r`` then chunk ``2N-1-r`` (chunks of ``seq_local/2``); an explicit ``perm`` is looked up.
    """
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    i = jnp.arange(seq_local, dtype=jnp.int32)
    if isinstance(layout, str) and layout == "contiguous":
        pos = r * seq_local + i
    elif isinstance(layout, str) and layout == "striped":
        pos = i * n + r
    elif isinstance(layout, str) and layout == "zigzag":
        c = seq_local // 2
        pos = jnp.where(i < c, r * c + i, (2 * n - 1 - r) * c + i - c)
    else:
        perm = jnp.asarray(layout, dtype=jnp.int32)
        pos = lax.dynamic_slice_in_dim(perm, r * seq_local, seq_local)
    return jnp.broadcast_to(pos.astype(jnp.int32)[None], (batch, seq_local))


def hop_kv(cfg, kv, bias, kv_idx):
    """The shard a hop attends to: ``kv`` with the bias block of its keys (``[b|1, h|1, sq|1, sk|1]``).

    ``bias`` is this host's non-travelling bias (``cfg.bias_mode`` "columns": every key column, of
    which the hop takes block ``kv_idx``; "static": one column for all keys); a key-only bias is
    already in ``kv.bias``.
    """
    if cfg.bias_mode == "columns":
        sk = kv.k.shape[1]
        return kv._replace(bias=lax.dynamic_slice_in_dim(bias, kv_idx * sk, sk, axis=3))
    if cfg.bias_mode == "static":
        return kv._replace(bias=bias)
    return kv  # "travel" (already there) or no bias


def ring_balance(seq_len, n_hosts, *, layout="contiguous", causal=False, window=None, mask_fn=None, segment_ids=None,
                 block_q=None, block_kv=None, heads=1):
    """How evenly this ring's schedule spreads the work: a ``ringattn_ref.balance.Balance``.

    For the static settings of a ``ring_attention`` call (self-attention over ``seq_len`` tokens on
    ``n_hosts``, ``layout`` a name, a permutation or a ``Layout``, the masks, segment ids in true order,
    the XLA hop's tiles): the visible tiles of host ``my_idx`` at each ``step`` (the tiles this ring
    computes: empty tiles and hops are skipped), ``critical_path`` (each step waits for its slowest
    host), ``imbalance`` (slowest host / mean) and ``step_imbalance`` (critical path / mean), from the
    block mask (``ringattn_ref.balance.layout_block_mask``). Host ``i``'s row is its ``kv_idx = (i - step)
    % N`` order. Cost: one dense evaluation of the mask in numpy (``ringattn_ref.block_mask``).
    """
    from ringattn_ref import balance  # numpy only, but not needed by the ring itself

    bm = balance.layout_block_mask(layout, seq_len, n_hosts, mask_fn=mask_fn, segment_ids=segment_ids, causal=causal,
                                   window=window, block_q=block_q, block_kv=block_kv, heads=heads)
    return balance.balance(bm)
