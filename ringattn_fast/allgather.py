"""All-gather attention: every host gathers the whole K/V once, then attends its queries to it.

The simplest way to split attention over the sequence (Llama 3's context parallelism, arXiv:2407.21783
§3.3.2): host ``my_idx`` keeps its query shard (a ``schedule.QShard``), all-gathers the K/V shards of
all ``N`` hosts (a ``schedule.KVShard``: K, V, their true positions, segment ids and a key-only bias,
so every mask of the ring means the same here), and runs **one hop** against the whole sequence: the
ring's hop code (``kernels/xla.py`` or a Pallas kernel, ``dispatch``), whose tile classification skips what
a causal or document mask hides. Compared with the ring: the same bytes on the wire in the forward
(``(N - 1)`` K/V shards), but in one collective instead of ``N - 1`` steps, so nothing to overlap
with the compute and no per-step latency; and ``O(S)`` K/V per host while attending, not ``O(S/N)``.

Backward (``custom_vjp``): the forward saved only its local inputs, ``o`` and ``lse`` (``O(S/N)``, as
the ring); the backward gathers K/V again (with forward and backward in one jitted program XLA
reuses the forward's gather instead and keeps the gathered K/V alive: ``docs/benchmarks.md``), runs
the hop's backward (FA-2, arXiv:2307.08691, Algorithm 2) for the local queries against all keys,
keeps ``dQ`` and reduce-scatters ``dK, dV`` (and a key-only bias's gradient) home: each host
receives the sum over all hosts of its keys' gradients.
``comm_dtype`` gathers K/V in that dtype (``comm.py``: rounded once at home), ``grad_comm_dtype``
sends dK/dV in it (summed at home in float32: :func:`_scatter`).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ringattn_ref import validation as val

from . import block_mask, comm, masks
from .comm import gather
from .dispatch import kernels_for
from .front import Strategy, check_shard_call, finish, host_inputs, on_mesh
from .schedule import KVShard, QShard
from .softmax import acc_dtype


def _gather_kv(kv, axis_name):
    """A KVShard (or its ``comm.Wire``) of all ``N`` hosts, in host (= layout) order along the keys."""
    if kv is None:
        return None
    if isinstance(kv, comm.Wire):
        return comm.Wire(_gather_kv(kv.kv, axis_name), kv.dtype,
                         *(gather(s, axis_name, 1) for s in (kv.k_scale, kv.v_scale)))
    return KVShard(*(gather(x, axis_name, 1) for x in kv[:4]), gather(kv.bias, axis_name, 3))


def _scatter(x, cfg, axis):
    """Reduce-scatter ``x`` over the hosts along ``axis``: each host keeps the sum of its shard.

    With ``grad_comm_dtype`` the shards travel as the bits of that dtype in one all-to-all and are
    summed at home in ``x``'s dtype (float32): the same bytes as a reduce-scatter (``(N-1)/N`` of
    ``x``), one rounding per contribution, and XLA CPU cannot widen it back (it turns a bfloat16
    ``psum_scatter`` into a float32 reduce-scatter, measured).
    """
    if x is None:
        return None
    if cfg.grad_comm_dtype is None:
        return lax.psum_scatter(x, cfg.axis_name, scatter_dimension=axis, tiled=True)
    n = lax.axis_size(cfg.axis_name)
    bits = comm.as_bits(x.astype(cfg.grad_comm_dtype))
    shards = lax.all_to_all(bits, cfg.axis_name, split_axis=axis, concat_axis=axis, tiled=True)  # host i's shard i..
    shards = lax.bitcast_convert_type(shards, cfg.grad_comm_dtype).astype(x.dtype)
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return shards.reshape(shape).sum(axis=axis)


def whole_kv(cfg, gather, kv, bias):
    """The K/V the hop reads: all hosts' (``gather``) or ``kv`` itself (already whole: Ulysses), marked
    (``masks.mark_bad_keys``), with the bias for these keys: the gathered key-only bias, or the
    host's bias rows (``cfg.bias_mode`` "columns": every key column; "static": one for all)."""
    dtype, kv = kv.k.dtype, masks.mark_bad_keys_of(kv)
    if gather:
        kv = comm.decode(_gather_kv(comm.encode(kv, cfg.comm_dtype), cfg.axis_name), dtype)
    return kv if cfg.bias_mode in (None, "travel") else kv._replace(bias=bias)


def _extras(cfg, head_offset):
    """The hop's optional keywords (``block_mask.hop_extras``): this host's tile kinds in a ``mask_fn``'s
    static block mask and the index of its first query head, where there are any."""
    return block_mask.hop_extras(cfg, lax.axis_index(cfg.axis_name), 0, head_offset)


def _forward(cfg, gather, qs, kv, bias, head_offset):
    o, lse = kernels_for(cfg.impl).hop_fwd(qs, whole_kv(cfg, gather, kv, bias), cfg.hop,
                                           **_extras(cfg, head_offset))
    return o.astype(qs.q.dtype), lse.astype(acc_dtype(qs.q.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attend_whole(cfg, gather, qs, kv, bias, head_offset=None):
    """``(o, lse)`` of this host's queries against the whole sequence's keys: ``kv`` gathered over
    ``cfg.axis_name`` first when ``gather`` (dK/dV reduce-scattered back), else already whole.
    o [b, sq, h, d] in q's dtype, lse [b, h, sq] float32 (float64 for float64). head_offset: the global
    index of the first query head here when the heads are split (``mask_fn`` / ``score_fn``), or None."""
    return _forward(cfg, gather, qs, kv, bias, head_offset)


def _attend_fwd(cfg, gather, qs, kv, bias, head_offset=None):
    o, lse = _forward(cfg, gather, qs, kv, bias, head_offset)
    return (o, lse), (qs, kv, bias, o, lse, head_offset)  # local inputs only: K/V are gathered again below


def _attend_bwd(cfg, gather, res, cotangents):
    qs, kv, bias, o, lse, head_offset = res
    do, dlse = cotangents
    acc = acc_dtype(qs.q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(acc), o.astype(acc))  # FA-2's D, as backward.py
    delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(acc), 0.0)  # d lse / d S = P
    g = kernels_for(cfg.impl).hop_bwd(qs, whole_kv(cfg, gather, kv, bias), cfg.hop, do=do, lse=lse, delta=delta,
                                      **_extras(cfg, head_offset))
    dk, dv = (_scatter(x, cfg, 1) if gather else x for x in (g.dk, g.dv))
    dbias_kv = g.dbias if cfg.bias_mode == "travel" else None
    dbias_kv = _scatter(dbias_kv, cfg, 3) if gather else dbias_kv
    cast = lambda x, like: None if like is None else x.astype(like.dtype)  # noqa: E731
    return (QShard(cast(g.dq, qs.q), None, None),
            KVShard(cast(dk, kv.k), cast(dv, kv.v), None, None, cast(dbias_kv, kv.bias)),
            None if bias is None else cast(g.dbias, bias), None)


attend_whole.defvjp(_attend_fwd, _attend_bwd)


def attend(inp):
    """One host's all-gather attention on validated :class:`~ringattn_fast.front.HostInputs`: ``(o, lse)``."""
    return attend_whole(inp.cfg, True, inp.qs, inp.kv, inp.bias, inp.head_offset)


ALLGATHER = Strategy("allgather_attention", attend, kv_whole=True, comm=True)


def allgather_attention_shard(q, k, v, *, axis_name="sp", causal=False, segment_ids=None, bias=None, window=None,
                              scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                              positions=None, padding_segment=None, return_lse=False, comm_dtype=None,
                              grad_comm_dtype=None, sinks=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None,
                              kv_positions=None):
    """All-gather attention inside ``jax.shard_map``: this host's output shard.

    Arguments, shapes and results exactly as ``ring_attention_shard`` (q [b, s_local, h, d], k, v
    [b, s_local, kv_heads, d] in layout order; bias per host as there), except: ``block_kv`` divides
    the whole sequence ``N * s_local`` (the hop holds all keys), and ``impl="pallas_tpu_fused"`` (a
    whole ring in one kernel) does not apply ("auto" picks "pallas_tpu" on TPU).
    """
    return_lse = val.check_bool(return_lse, "return_lse")
    settings, _ = check_shard_call(
        ALLGATHER, q, k, v, axis_name=axis_name, segment_ids=segment_ids, bias=bias, positions=positions,
        kv_segment_ids=kv_segment_ids, kv_positions=kv_positions,
        sinks=sinks, padding_segment=padding_segment, layout=layout, causal=causal, window=window, scale=scale,
        block_q=block_q, block_kv=block_kv, impl=impl, comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype,
        logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn)
    o, lse = attend(host_inputs(settings, q, k, v, segment_ids=segment_ids, bias=bias, positions=positions,
                                kv_segment_ids=kv_segment_ids, kv_positions=kv_positions))
    return finish(o, lse, sinks=sinks, return_lse=return_lse)


def allgather_attention(q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
                        window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                        padding_segment=None, return_lse=False, batch_axes=None, head_axis=None, comm_dtype=None,
                        grad_comm_dtype=None, sinks=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None):
    """All-gather attention on global arrays: the inputs, keywords and result of ``ring_attention``.

    q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim]; every mask (causal, window,
    segment_ids, padding_segment, bias), layout, GQA ratio and mesh placement (``batch_axes``,
    ``head_axis``) of the ring, with the same meaning. Each host all-gathers K/V (``O(S)`` per host
    while it attends), attends its queries, and in the backward reduce-scatters dK/dV. comm_dtype /
    grad_comm_dtype: what K/V and dK/dV travel in (``comm.py``). Returns [batch, seq, heads, dim] in
    q's dtype (and lse [batch, heads, seq] with ``return_lse``).
    """
    return on_mesh(ALLGATHER, q, k, v, mesh=mesh, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
                   bias=bias, window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv,
                   impl=impl, padding_segment=padding_segment, return_lse=return_lse, batch_axes=batch_axes,
                   head_axis=head_axis, comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype, sinks=sinks,
                   logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn, kv_segment_ids=kv_segment_ids)
