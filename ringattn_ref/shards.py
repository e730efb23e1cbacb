"""What stays, what travels, and one hop's settings: the per-hop contract of both packages.

Ring Attention (arXiv:2310.01889, Algorithm 1): host ``my_idx`` keeps its query shard (a
:class:`QShard`) and, at ring step ``step``, holds K/V shard ``kv_idx = (my_idx - step) % N`` (a
:class:`KVShard`, which travels: K, V, their true positions, segment ids and a bias for these keys).
One *hop* is the attention of a ``QShard`` against one ``KVShard`` under a :class:`HopConfig`; its
backward returns :class:`HopGrads`, and in the backward ring the K/V gradient accumulators
(:class:`KVGrads`) travel with their shard. "Shard" is what a host holds; "block" is only a tile side
(``block_q`` x ``block_kv``, FA-2's Br x Bc).

Defined once, here: the float64 oracles (``ringattn_ref.hop_attention`` / ``hop_attention_vjp``) and
``ringattn_fast``'s per-hop functions and kernels take the same objects, numpy arrays in one and JAX
arrays (a NamedTuple is a pytree, so a ``KVShard`` travels through one ``lax.ppermute``) in the other.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


DEFAULT_BLOCK = 128


def default_block(shard, target=DEFAULT_BLOCK):
    """The default tile side: the largest divisor of ``shard`` that is ``<= target`` (128).

    128 keeps one float64 score tile at ``128 * 128 * 8 B = 128 KiB`` per (batch, head) while leaving
    several tiles per shard at realistic lengths, so tile skipping has something to skip; in
    ``ringattn_fast`` a 128 x 128 float32 tile per kv head (64 KiB) was also the fastest on CPU (measured
    at 8 devices, S=8192, 4 heads, dim 64: faster and less temp memory than 256 or 512 tiles).
    """
    return max(c for c in range(1, min(shard, target) + 1) if shard % c == 0)


class QShard(NamedTuple):
    """What stays on a host: q [b, sq, h, d], its true positions int [b, sq] (the ref also takes
    [1, sq] or [sq]: one row for every example), segment ids [b, sq] or None."""
    q: Any
    pos: Any
    seg: Any = None


class KVShard(NamedTuple):
    """What travels: k, v [b, sk, kv_heads, d], true positions int [b, sk] (ref: also [1, sk] or [sk]),
    segment ids or None, and a bias for these keys ``[b|1, h|1, sq|1, sk|1]`` (added to the scaled
    logits of this hop's queries) or None."""
    k: Any
    v: Any
    pos: Any
    seg: Any = None
    bias: Any = None


class HopGrads(NamedTuple):
    """One hop's gradients: dq [b, sq, h, d]; dk, dv [b, sk, kv_heads, d] (summed over the GQA group);
    dbias shaped like the hop's bias, or None."""
    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None


class KVGrads(NamedTuple):
    """The gradient accumulators that travel with a K/V shard in the backward ring: dk, dv
    [b, sk, kv_heads, d] and the gradient of a bias that travels with the keys, or None."""
    dk: Any
    dv: Any
    dbias: Any = None


@dataclasses.dataclass(frozen=True)
class HopConfig:
    """Static settings of one hop (hashable, so kernels can take it as a static argument).

    - scale: logit scale (None: ``dim ** -0.5``);
    - causal / window: the mask (window ``(left, right)`` normalised by ``validation.check_window``:
      -1 = unbounded, int32-safe);
    - block_q / block_kv: the tile sides Br / Bc, dividing the shard (None: ``blockwise.default_block``
      of the shard);
    - dropout_rate: attention dropout (its key travels beside the shards; ``dropout.py``);
    - logit_softcap: ``c`` or None: the scaled logits become ``c * tanh(s / c)`` before the bias and
      the mask (Gemma 2's soft-capping; ``validation.check_softcap``);
    - mask_fn / score_fn: user functions of true positions (``variants.py``), called per tile; a
      config is hashable with them (functions hash by identity);
    - out_dtype: a dtype name the hop may return o and the gradients in (None: the float32 / float64
      accumulators). The fast ring asks for q's dtype when it has one hop (N = 1: nothing is merged
      or summed across hops), and the TPU kernel then writes that dtype directly (no float32 copy of
      o, dq, dk, dv in HBM); other hops may ignore it (their caller casts);
    - bwd_blocks: ``(block_q, block_kv)`` of the backward kernels when they differ from the forward's (a
      kernel's own defaults, tuned per kernel on the chip: ``ringattn_fast.kernels.pallas_tpu``), or None.
    """
    scale: float | None = None
    causal: bool = False
    window: tuple | None = None
    block_q: int | None = None
    block_kv: int | None = None
    dropout_rate: float = 0.0
    logit_softcap: float | None = None
    mask_fn: Any = None
    score_fn: Any = None
    out_dtype: str | None = None
    bwd_blocks: tuple | None = None

    def resolve(self, dim, sq, sk):
        """This config for a hop of ``sq`` queries against ``sk`` keys of width ``dim``: scale None ->
        ``dim ** -0.5``, a tile side None -> :func:`default_block` of its shard, one larger than the
        shard -> the shard."""
        tile = lambda block, s: default_block(s) if block is None else min(int(block), s)  # noqa: E731
        return dataclasses.replace(self, scale=dim ** -0.5 if self.scale is None else float(self.scale),
                                   causal=bool(self.causal), block_q=tile(self.block_q, sq),
                                   block_kv=tile(self.block_kv, sk),
                                   window=None if self.window is None else tuple(int(w) for w in self.window))
