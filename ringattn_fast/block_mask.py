"""The block mask of a ``mask_fn`` on the ring: computed once per static configuration, read per hop and tile.

With a user mask (``mask_fn``, ``ringattn_ref.variants``) the built-in tests of ``masks.py`` cannot tell
which hops and tiles are empty. But the positions are static for every layout: host ``r`` holds the
queries of layout positions ``r*T/N ..`` and, at step ``step``, K/V shard ``kv_idx = (r - step) % N``.
So ``ringattn_ref.block_mask`` evaluates the function once, densely in numpy, per query host and K/V
shard, and classifies every ``block_q x block_kv`` tile as empty, full or partial (and every hop as live
or empty). The ring looks its hop up (``hop_live``: an empty hop is skipped with ``lax.cond``), the XLA
hop its tiles (``hop_tiles``: empty tiles skipped, full ones run without any mask, partial ones evaluate
``mask_fn``), combined with the built-in kinds of the tile (``combine``): the block mask is only ever
a proof of emptiness or fullness of the user's part.

When it applies: a ``mask_fn``, positions from the layout (not the caller's: traced), and no segment
ids of the caller (the function may read them, and traced ids are unknown here); padding added by
``ring_attention`` is fine (its keys are masked by the built-in segments, which still run per tile).
Otherwise every tile evaluates ``mask_fn`` (correct, not skipped). The Pallas per-hop kernels use the
hop half (the ring skips empty hops around them) and evaluate ``mask_fn`` in every tile they run; the
fused TPU ring schedules its own hops and takes no block mask.

Cost: numpy evaluates ``T x S x heads`` pairs once per configuration (``ringattn_ref.block_mask``'s
docstring has the timings), cached here (:func:`tables`, LRU of 32); the table is an int8 constant of
``(T / block_q) x (S / block_kv)`` entries in the program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ringattn_ref import block_mask as ref_block_mask
from ringattn_ref.layouts import layout_permutation

from . import masks

__all__ = ["BlockMaskSpec", "combine", "hop_extras", "hop_is_empty", "hop_live", "hop_tiles", "spec_for", "tables"]


@dataclasses.dataclass(frozen=True)
class BlockMaskSpec:
    """Everything the block mask depends on (hashable: part of the ring's static config).

    t, s: the (padded) query and key lengths the ring splits over ``n`` hosts; q_offset: added to the
    queries' layout positions (``S - T`` of cross-attention); whole_kv: one hop against all keys (the
    all-gather) instead of the ring's ``N`` hops; layout: a name or a permutation as a tuple.
    """
    mask_fn: Callable
    layout: object
    n: int
    t: int
    s: int
    q_offset: int
    block_q: int
    block_kv: int
    heads: int
    causal: bool
    window: tuple | None
    whole_kv: bool = False


def spec_for(*, mask_fn, layout, n, t, s, q_offset, block_q, block_kv, heads, causal, window, whole_kv):
    """A :class:`BlockMaskSpec`, or None without a ``mask_fn``."""
    if mask_fn is None:
        return None
    layout = layout if isinstance(layout, str) else tuple(int(i) for i in np.asarray(layout))
    return BlockMaskSpec(mask_fn, layout, int(n), int(t), int(s), int(q_offset), int(block_q), int(block_kv),
                         int(heads), bool(causal), window, bool(whole_kv))


@functools.lru_cache(maxsize=32)
def tables(spec):
    """``ringattn_ref.block_mask.BlockMask`` of ``spec``: tiles int8 [N, N, nq, nk] (query host, K/V shard)
    and hops bool [N, N] (host, step); for ``whole_kv`` tiles [N, 1, nq, S / block_kv] and hops [N, 1]."""
    with jax.ensure_compile_time_eval():  # a mask_fn written in jnp (or closing over jnp arrays) evaluates
        return _tables(spec)                # here, on numpy positions, even when called under jit/shard_map


def _tables(spec):
    layout = spec.layout if isinstance(spec.layout, str) else np.asarray(spec.layout)
    q_pos = layout_permutation(layout, spec.t, spec.n) + spec.q_offset
    k_pos = layout_permutation(layout, spec.s, spec.n)
    kw = dict(block_q=spec.block_q, block_kv=spec.block_kv, heads=spec.heads, causal=spec.causal,
              window=spec.window)
    if not spec.whole_kv:
        return ref_block_mask.block_mask(spec.mask_fn, q_pos, k_pos, n_hosts=spec.n, **kw)
    c = spec.t // spec.n
    tiles = np.stack([ref_block_mask.tile_kinds(spec.mask_fn, q_pos[r * c:(r + 1) * c], k_pos, **kw)[None]
                      for r in range(spec.n)])  # (N, 1, nq, nk)
    return ref_block_mask.BlockMask(tiles, (tiles != 0).any(axis=(2, 3)), 0.0)


def hop_live(spec, my_idx, step):
    """Traced bool: whether the hop of host ``my_idx`` at ring ``step`` has a visible pair (None: no spec)."""
    if spec is None:
        return None
    return jnp.asarray(tables(spec).hops)[my_idx, step]


def hop_tiles(spec, my_idx, kv_idx=0):
    """Traced int8 [nq, nk]: the user mask's kinds of this hop's tiles (0 empty, 1 full, 2 partial), or None."""
    if spec is None:
        return None
    return jnp.asarray(tables(spec).tiles)[my_idx, kv_idx]


def hop_extras(cfg, my_idx, kv_idx=0, head_offset=None):
    """The XLA hop's optional keywords for this hop: ``tiles`` (:func:`hop_tiles`) and ``head_offset``
    (the global index of the first query head here), each only when there is one (the Pallas kernels
    take neither: the front door sends them no ``mask_fn`` whose heads are split)."""
    fns = cfg.hop.mask_fn is not None or cfg.hop.score_fn is not None
    extras = {"head_offset": head_offset} if fns and head_offset is not None else {}
    tiles = hop_tiles(cfg.block_mask, my_idx, kv_idx) if cfg.impl == "xla" else None
    return extras if tiles is None else extras | {"tiles": tiles}


def hop_is_empty(cfg, qs, kv, my_idx, step):
    """Traced bool: the ring's hop (``RingConfig`` cfg, host ``my_idx``, ``step``) has no visible pair, by the
    built-in masks (``masks.tile_is_empty`` on the shards' positions) or by the static block mask."""
    empty = jnp.asarray(False)
    if masks.can_be_empty(cfg.hop.causal, cfg.hop.window, qs.seg is not None):
        empty = masks.tile_is_empty(qs.pos, kv.pos, qs.seg, kv.seg, causal=cfg.hop.causal, window=cfg.hop.window)
    live = hop_live(cfg.block_mask, my_idx, step)
    return empty if live is None else empty | ~live


def combine(builtin, user):
    """One tile's kind from the built-in masks' and the block mask's: empty if either is, full iff both are."""
    return jnp.where((builtin == 0) | (user == 0), 0, jnp.maximum(builtin, user)).astype(jnp.int32)
