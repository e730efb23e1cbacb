"""The 2-D hybrid: Ulysses inside a group of hosts, the ring across groups (USP, LoongTrain's 2-D attention).

Ulysses (``ulysses.py``) stops at ``heads`` hosts; the ring's per-hop compute shrinks with ``N`` until it
no longer hides the K/V transfer. On a mesh with a Ulysses axis of size ``U`` (the fast links: inside a
node) and a ring axis of size ``R`` (across nodes) the sequence is split over both, ring-major: host
``(r, u)`` holds layout chunk ``p = r * U + u`` of ``P = R * U``. Per host:

1. one all-to-all over the Ulysses axis per tensor: ``[S/P, heads]`` -> ``[S/R, heads/U]`` (sequence ->
   heads; GQA: kv heads repeated first where ``kv_heads`` does not split ``U`` ways, as in Ulysses),
   so the ``U`` hosts of group ``r`` together hold group ``r``'s ``S/R`` tokens, each ``heads/U`` heads;
2. ring attention over the ring axis on those heads (``ring.py``: ``R`` hops of ``S/R x S/R``, its
   ``custom_vjp`` backward, ``comm_dtype``, skipping, Pallas hop kernels);
3. one all-to-all back (heads -> sequence) for ``o`` and ``lse``.

The layout is applied over the ``P`` chunks (``layout="zigzag"`` over ``P`` hosts gives every ring group
the chunks ``rU .. rU+U-1`` and their mirror images: exactly zigzag over ``R`` groups, so causal work is
balanced across the ring); true positions travel with the tokens, so every mask and layout is exact.
``mask_fn`` / ``score_fn`` see global heads (the group's first head is added). A bias goes to the group as
in Ulysses (its rows gathered, per-head blocks re-split by heads, a key-only bias's keys gathered) and
then keeps the ring's mode (all key columns in layout order, or key-only: it travels). Bytes per host:
Ulysses's all-to-all share over ``U`` (``(U-1)/U`` of q, k, v, o) plus the ring's ``R - 1`` K/V shards of
``S/R`` tokens and ``heads/U`` heads (``ringattn_ref.strategy_cost`` models both, on two bandwidths).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ringattn_ref import validation as val

from .comm import gather
from .front import Strategy, check_shard_call, finish, host_inputs, on_mesh
from .mesh import resolve_mesh
from .ring import _ring
from .schedule import KVShard, QShard
from .ulysses import _bias_to_heads, _seq_to_heads, check_heads


def check_axes(ulysses_axis, ring_axis):
    """Two different axis names: ``(ring_axis, ulysses_axis)``, the sequence's mesh axes, ring-major."""
    for name, a in (("ulysses_axis", ulysses_axis), ("ring_axis", ring_axis)):
        if not isinstance(a, str):
            raise ValueError(f"{name} must be the name of a mesh axis (a str); got {a!r}")
    if ulysses_axis == ring_axis:
        raise ValueError(f"ulysses_axis and ring_axis must be different mesh axes; both are {ring_axis!r}")
    return ring_axis, ulysses_axis


def check_split(heads, kv_heads, ulysses_size, ulysses_axis):
    """The Ulysses degree divides the heads (so it is at most ``heads``); returns the kv-head repeat."""
    return check_heads(heads, kv_heads, ulysses_size, ulysses_axis, who="hybrid_attention (its ulysses_axis)",
                       fix="a Ulysses degree that divides {heads}: move devices to the ring axis")


def attend(inp):
    """One host's hybrid attention on validated :class:`~ringattn_fast.front.HostInputs`: ``(o, lse)``."""
    ring_axis, ulysses_axis = inp.cfg.axis_name
    (q, pos, q_seg), (k, v, k_pos, k_seg, kv_bias) = inp.qs, inp.kv
    u = lax.axis_size(ulysses_axis)
    rep = check_split(q.shape[2], k.shape[2], u, ulysses_axis)
    k, v = (jnp.repeat(x, rep, axis=2) if rep > 1 else x for x in (k, v))  # kv head i -> i*rep .. i*rep + rep-1
    qs = QShard(_seq_to_heads(q, ulysses_axis), gather(pos, ulysses_axis, 1), gather(q_seg, ulysses_axis, 1))
    travels = inp.cfg.bias_mode == "travel"  # the ring's bias modes: rows and keys of the group, as Ulysses
    bias = _bias_to_heads(kv_bias if travels else inp.bias, travels, ulysses_axis)
    kv = KVShard(_seq_to_heads(k, ulysses_axis), _seq_to_heads(v, ulysses_axis), gather(k_pos, ulysses_axis, 1),
                 gather(k_seg, ulysses_axis, 1), bias if travels else None)
    within = (lax.axis_index(ulysses_axis) * qs.q.shape[2]).astype(jnp.int32)  # first head here, of the host's
    first = within if inp.head_offset is None else inp.head_offset + within  # ... and of all (head_axis)
    drop = inp.drop if inp.drop is None else inp.drop._replace(  # its offset already counts head_axis
        head_offset=inp.drop.head_offset + within.astype(jnp.uint32))
    cfg = dataclasses.replace(inp.cfg, axis_name=ring_axis)
    o, lse = _ring(cfg, qs, kv, None if travels else bias, drop, first)  # (b, S/R, h/U, d_v), (b, h/U, S/R)
    o = lax.all_to_all(o, ulysses_axis, split_axis=1, concat_axis=2, tiled=True)  # (b, S/P, h, d_v)
    lse = lax.all_to_all(lse, ulysses_axis, split_axis=2, concat_axis=1, tiled=True)  # (b, h, S/P)
    return o, lse


def strategy(ulysses_size):
    """The :class:`~ringattn_fast.front.Strategy` of a hybrid whose Ulysses axis has ``ulysses_size`` hosts
    (a hop holds ``ulysses_size`` hosts' tokens)."""
    return Strategy("hybrid_attention", attend, dropout=True, comm=True, hop_factor=int(ulysses_size),
                    splits_heads=True)


def hybrid_attention_shard(q, k, v, *, ulysses_axis="ulysses", ring_axis="ring", causal=False, segment_ids=None,
                           bias=None, window=None, scale=None, layout="contiguous", block_q=None, block_kv=None,
                           impl="auto", positions=None, padding_segment=None, return_lse=False, dropout_rate=0.0,
                           dropout_key=None, dropout_offsets=(0, 0), comm_dtype=None, grad_comm_dtype=None,
                           sinks=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None,
                           kv_positions=None):
    """The hybrid inside ``jax.shard_map`` over a mesh with both axes: this host's output shard.

    q [b, s_local, h, d], k, v [b, s_local, kv_heads, d(_v)]: host ``(r, u)``'s chunk ``r * U + u`` of the
    layout-ordered sequence (shard the sequence dim over ``(ring_axis, ulysses_axis)``); other arguments
    and results as ``ring_attention_shard``; ``h`` divisible by the Ulysses axis size ``U``; block_q /
    block_kv tile a group's ``U * s_local`` tokens.
    """
    axes = check_axes(ulysses_axis, ring_axis)
    return_lse = val.check_bool(return_lse, "return_lse")
    _, _, _, h, hk, _, _ = val.check_attention_shapes(q, k, v)
    try:
        u = lax.axis_size(ulysses_axis)
    except NameError:
        raise ValueError(f"ulysses_axis {ulysses_axis!r} must name a mesh axis of the enclosing jax.shard_map: "
                         f"call hybrid_attention_shard inside shard_map over a mesh with both axes") from None
    check_split(h, hk, u, ulysses_axis)
    settings, drop = check_shard_call(
        strategy(u), q, k, v, axis_name=axes, segment_ids=segment_ids, bias=bias, positions=positions,
        kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, sinks=sinks, padding_segment=padding_segment,
        layout=layout, dropout_key=dropout_key, dropout_offsets=dropout_offsets, causal=causal, window=window,
        scale=scale, block_q=block_q, block_kv=block_kv, impl=impl, comm_dtype=comm_dtype,
        grad_comm_dtype=grad_comm_dtype, dropout_rate=dropout_rate, logit_softcap=logit_softcap, mask_fn=mask_fn,
        score_fn=score_fn)
    o, lse = attend(host_inputs(settings, q, k, v, segment_ids=segment_ids, bias=bias, positions=positions,
                                drop=drop, kv_segment_ids=kv_segment_ids, kv_positions=kv_positions))
    return finish(o, lse, sinks=sinks, return_lse=return_lse)


def hybrid_attention(q, k, v, *, mesh=None, ulysses_axis="ulysses", ring_axis="ring", causal=False,
                     segment_ids=None, bias=None, window=None, scale=None, layout="contiguous", block_q=None,
                     block_kv=None, impl="auto", padding_segment=None, return_lse=False, batch_axes=None,
                     head_axis=None, dropout_rate=0.0, dropout_key=None, comm_dtype=None, grad_comm_dtype=None,
                     sinks=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None):
    """2-D sequence parallelism on global arrays: Ulysses over ``ulysses_axis``, the ring over ``ring_axis``.

    The inputs, keywords and result of ``ring_attention`` (masks, bias, layouts, GQA, cross-attention,
    ``comm_dtype`` for the ring's K/V, dropout, sinks, soft-cap, user functions); the sequence is split
    over both axes (``R * U`` chunks, ring-major), the heads must be
    divisible by the Ulysses axis size ``U`` (``U <= heads``). Returns [batch, seq, heads, dim_v] in q's
    dtype, in true order (and lse [batch, heads, seq] with ``return_lse``).
    """
    axes = check_axes(ulysses_axis, ring_axis)
    _, _, _, h, hk, _, _ = val.check_attention_shapes(q, k, v)
    m = resolve_mesh(mesh)  # needed before on_mesh: the Ulysses size
    for name, a in (("ulysses_axis", ulysses_axis), ("ring_axis", ring_axis)):
        if a not in m.axis_names:
            raise ValueError(f"{name} {a!r} is not an axis of the mesh; the mesh has axes {tuple(m.axis_names)}")
    u = int(m.shape[ulysses_axis])
    tp = int(m.shape[head_axis]) if head_axis in m.axis_names else 1  # (check_mesh_axes checks head_axis)
    if h % tp == 0 and hk % tp == 0:
        check_split(h // tp, hk // tp, u, ulysses_axis)
    return on_mesh(strategy(u), q, k, v, mesh=mesh, axis_name=axes, causal=causal, segment_ids=segment_ids,
                   bias=bias, window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv, impl=impl,
                   padding_segment=padding_segment, return_lse=return_lse, batch_axes=batch_axes,
                   head_axis=head_axis, dropout_rate=dropout_rate, dropout_key=dropout_key, comm_dtype=comm_dtype,
                   grad_comm_dtype=grad_comm_dtype, sinks=sinks, logit_softcap=logit_softcap, mask_fn=mask_fn,
                   score_fn=score_fn, kv_segment_ids=kv_segment_ids)
