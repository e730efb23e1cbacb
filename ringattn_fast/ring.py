"""Ring Attention, forward: ``jax.shard_map`` over the sequence axis, K/V moved with ``lax.ppermute``.

Ring Attention (arXiv:2310.01889, Algorithm 1) on ``N = axis_size`` hosts: host ``my_idx`` keeps its
query shard and, at ring step ``step``, holds K/V shard ``kv_idx = (my_idx - step) % N`` (the
authors' index arithmetic). It attends to that shard (one ``hop``), merges the hop's ``(o, lse)`` into
its running result (``softmax.merge``, float32 or float64), and passes the K/V on to host
``my_idx + 1``. With 4 hosts, at step 1 host 0 holds K/V shard 3. K/V travel ``N - 1`` times: the send
is issued at the top of a step (so it can overlap the hop's compute) and there is none after the last
step. Segment ids, true positions and a key-only bias travel with their K/V shard; a full bias is
sharded by query rows and the hop takes its ``kv_idx``-th block of key columns. A hop the mask leaves
empty (from min/max positions, ``masks.tile_is_empty``) is skipped by ``lax.cond``.

Mirrors ``ringattn_ref.ring``. Public entry points: :func:`ring_attention` (global arrays, does the
``shard_map``) and :func:`ring_attention_shard` (per host, inside your own ``shard_map``). The
backward is ``ring_vjp.py``.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import validation as val

from . import masks
from .dispatch import fused_ring, hop_functions, resolve_impl
from .hop import acc_dtype
from .layouts import permute_axis
from .mesh import check_mesh_axis, mesh_platform, resolve_mesh, varying_axes, vary_like
from .softmax import merge


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static settings of one ring call (hashable: a ``custom_vjp`` non-differentiable argument).

    bias_mode: ``None``; ``"columns"`` (local ``[b|1, h|1, sq|1, N*sk]``: all key columns, sliced per
    hop); ``"travel"`` (key-only ``[b|1, h|1, 1, sk]``, moves with K/V); ``"static"`` (key dim 1).
    """
    axis_name: str
    scale: float
    causal: bool
    window: tuple | None
    block_q: int
    block_kv: int
    impl: str = "xla"
    bias_mode: str | None = None

    def hop_kwargs(self):
        return dict(scale=self.scale, causal=self.causal, window=self.window, block_q=self.block_q,
                    block_kv=self.block_kv)


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


def hop_bias(cfg, bias, bias_travel, kv_idx, sk):
    """The bias block for the K/V shard ``kv_idx`` (``[b|1, h|1, sq|1, sk|1]``) or None."""
    if cfg.bias_mode == "travel":
        return bias_travel
    if cfg.bias_mode == "columns":
        return lax.dynamic_slice_in_dim(bias, kv_idx * sk, sk, axis=3)
    return bias  # "static" (key dim 1) or None


def ring_perm(n):
    """``lax.ppermute`` pairs: host ``i`` sends to host ``i + 1`` (mod ``n``)."""
    return [(i, (i + 1) % n) for i in range(n)]


def ring_loop(step_fn, carry, n):
    """``carry = step_fn(carry, step)`` for ``step = 0 .. n - 2`` as one XLA while loop.

    The trip count is hidden behind an optimization barrier so XLA keeps the loop even when it runs
    once (``n = 2``): every ring size then runs the same program with the same buffers (K/V being
    used + K/V being received), and per-device memory does not depend on ``n``.
    """
    trips = lax.optimization_barrier(jnp.int32(n - 1))
    return lax.fori_loop(0, trips, lambda step, c: step_fn(c, step), carry)


def ring_forward(cfg, q, k, v, pos, seg, bias):
    """The forward ring on this host: ``(o, lse)``, o ``[b, sq, h, d]``, lse ``[b, h, sq]`` in float32/64.

    q: [b, sq, h, d]; k, v: [b, sk, hk, d]; pos: int [b, sq] true positions (K/V start with the same
    tokens); seg: int [b, sq] or None; bias: as ``cfg.bias_mode`` says.
    """
    hop_fwd = hop_functions(cfg.impl)[0]
    n, my_idx = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    b, sq, h, d = q.shape
    acc = acc_dtype(q.dtype)
    skip = masks.can_be_empty(cfg.causal, cfg.window, seg is not None)
    axes = varying_axes(q, k, v, pos, seg, bias)
    kv = (k, v, pos, seg, bias if cfg.bias_mode == "travel" else None)

    def hop(step, kv, o, lse):
        k_, v_, k_pos, k_seg, bias_t = kv
        kv_idx = (my_idx - step) % n

        def attend(o, lse):
            o_hop, lse_hop = hop_fwd(q, k_, v_, pos, k_pos, seg, k_seg, hop_bias(cfg, bias, bias_t, kv_idx, sq),
                                     **cfg.hop_kwargs())
            return merge(o, lse, o_hop.astype(acc), lse_hop.astype(acc))

        if skip:
            empty = masks.tile_is_empty(pos, k_pos, seg, k_seg, causal=cfg.causal, window=cfg.window)
            return lax.cond(empty, lambda o, lse: (o, lse), attend, o, lse)
        return attend(o, lse)

    def step_fn(carry, step):
        kv, o, lse = carry
        kv_next = lax.ppermute(kv, cfg.axis_name, ring_perm(n))  # issued first: overlaps the hop
        o, lse = hop(step, kv, o, lse)
        return kv_next, o, lse

    o = jnp.zeros((b, sq, h, d), acc)
    lse = jnp.full((b, h, sq), -jnp.inf, acc)
    kv, o, lse = ring_loop(step_fn, (kv,) + vary_like((o, lse), axes), n)
    return hop(n - 1, kv, o, lse)  # the last step: nothing left to send


def default_block(shard, target=128):
    """The largest divisor of ``shard`` that is at most ``target`` (the tile side when not given).

    128 x 128 tiles keep a tile of float32 logits per kv head at 64 KiB, cache-sized on CPU: measured
    at 8 devices, S=8192, 4 heads, dim 64, fwd+bwd was faster and used less temp memory than with
    256 or 512 tiles (``python -m ringattn_fast.bench --ours-block-q ... --ours-block-kv ...``).
    """
    return max(c for c in range(1, min(shard, target) + 1) if shard % c == 0)


def _bias_mode(bias, batch, heads, sq, n):
    """Classify a host-local bias (see :class:`RingConfig`); raise if it fits no mode."""
    if bias is None:
        return None
    shape = tuple(bias.shape)
    ok = len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] in (1, sq)
    if ok and shape[3] == 1:
        return "static"
    if ok and shape[2] == 1 and shape[3] == sq:
        return "travel"
    if ok and shape[3] == n * sq:
        return "columns"
    raise ValueError(f"bias (per host) must be [batch|1, heads|1, {sq}|1, {n * sq}] (local query rows, all "
                     f"key columns in layout order) or key-only [batch|1, heads|1, 1, {sq}] (this host's "
                     f"keys; it travels with K/V); got shape {shape}")


def ring_attention_shard(q, k, v, *, axis_name="sp", causal=False, segment_ids=None, bias=None, window=None,
                         scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                         positions=None):
    """Ring attention for code already inside ``jax.shard_map``: this host's output shard.

    q: [batch, s_local, heads, dim] and k, v: [batch, s_local, kv_heads, dim], this host's shard of the
    layout-ordered sequence (``to_layout``); segment_ids: int [batch, s_local]; bias: see
    :func:`_bias_mode`; positions: int [batch, s_local] true positions, overriding ``layout`` (for a
    custom per-example permutation, ``to_layout(..., positions=...)``). Differentiable in q, k, v, bias.
    Returns [batch, s_local, heads, dim] in q's dtype.
    """
    b, sq, h, _, d = val.check_qkv(q, k, v)
    n = lax.axis_size(axis_name)
    scale, window = val.check_scale(scale, d), val.check_window(window)
    seg = val.check_segment_ids(segment_ids, b, sq)
    layout = val.check_layout(layout, sq * n)
    val.check_n_hosts(n, sq * n, layout, name=f"the size of mesh axis {axis_name!r}")
    bias_mode = _bias_mode(bias, b, h, sq, n)
    if bias is not None and not val.is_float_dtype(bias.dtype):
        raise ValueError(f"bias must be a floating-point array; got dtype {bias.dtype}")
    block_q = val.check_block(default_block(sq) if block_q is None else block_q, sq, "block_q")
    block_kv = val.check_block(default_block(sq) if block_kv is None else block_kv, sq, "block_kv")
    impl = resolve_impl(impl, mesh_platform(jax.sharding.get_abstract_mesh()), has_bias=bias is not None)
    if positions is None:
        pos = local_positions(layout, sq, axis_name, b)
    else:
        if tuple(positions.shape) != (b, sq) or not np.issubdtype(np.dtype(positions.dtype), np.integer):
            raise ValueError(f"positions must be an int array [batch, s_local] = {(b, sq)}; got shape "
                             f"{tuple(positions.shape)}, dtype {positions.dtype}")
        pos = positions.astype(jnp.int32)
    seg = None if seg is None else seg.astype(jnp.int32)
    axes = varying_axes(q, k, v, seg, bias, pos) + (axis_name,)
    q, k, v, pos, seg, bias = vary_like((q, k, v, pos, seg, bias), tuple(sorted(set(axes))))
    if impl == "pallas_tpu_fused":
        return fused_ring()(q, k, v, pos, pos, seg, seg, axis_name=axis_name, scale=scale, causal=bool(causal),
                            window=window, block_q=block_q, block_kv=block_kv)
    from .ring_vjp import ring_core  # ring_vjp imports this module
    cfg = RingConfig(axis_name, scale, bool(causal), window, block_q, block_kv, impl, bias_mode)
    return ring_core(cfg, q, k, v, pos, seg, bias)


def ring_attention(q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
                   window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto"):
    """Ring attention on global arrays: shards them over ``mesh``, runs the ring, returns the output.

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] (any float dtype; heads % kv_heads
    == 0); segment_ids: int [batch, seq]; bias: broadcastable to [batch, heads, seq, seq] (a full bias
    is sharded by query rows, a key-only ``[b|1, h|1, 1, seq]`` one travels with K/V); window:
    ``(left, right)``; layout: ``"contiguous" | "striped" | "zigzag"`` or a permutation. The sequence
    is sharded on ``axis_name``, the batch on ``"data"`` if the mesh has it. ``mesh=None``: the mesh of
    ``jax.set_mesh`` or all devices. Returns [batch, seq, heads, dim] in q's dtype, in true order.
    """
    b, s, h, _, d = val.check_qkv(q, k, v)
    val.check_scale(scale, d)
    val.check_window(window)
    val.check_segment_ids(segment_ids, b, s)
    val.check_bias(bias, b, h, s)
    layout = val.check_layout(layout, s)
    mesh = resolve_mesh(mesh)
    n, dax = check_mesh_axis(mesh, axis_name, b, s, 2 if isinstance(layout, str) and layout == "zigzag" else 1)
    resolve_impl(impl, mesh_platform(mesh), has_bias=bias is not None)  # errors before tracing
    perm = partial(permute_axis, layout=layout, n_hosts=n)
    args = {"q": perm(q), "k": perm(k), "v": perm(v)}
    specs = {name: jax.P(dax, axis_name) for name in args}
    if segment_ids is not None:
        args["segment_ids"], specs["segment_ids"] = perm(segment_ids), jax.P(dax, axis_name)
    if bias is not None:
        bdax = dax if bias.shape[0] > 1 else None
        if bias.shape[2] > 1:  # full (or per-query) bias: this host's query rows, every key column
            args["bias"], specs["bias"] = perm(bias, axis=2), jax.P(bdax, None, axis_name, None)
        else:  # key-only: sharded like the keys, travels with them
            args["bias"], specs["bias"] = bias, jax.P(bdax, None, None, axis_name if bias.shape[3] > 1 else None)
        if bias.shape[3] > 1:
            args["bias"] = perm(args["bias"], axis=3)
    names = tuple(args)

    def per_host(*xs):
        return ring_attention_shard(**dict(zip(names, xs)), axis_name=axis_name, causal=causal, window=window,
                                    scale=scale, layout=layout, block_q=block_q, block_kv=block_kv, impl=impl)

    out = jax.shard_map(per_host, mesh=mesh, in_specs=tuple(specs[k_] for k_ in names),
                        out_specs=jax.P(dax, axis_name))(*(args[k_] for k_ in names))
    return permute_axis(out, layout, n, inverse=True)
