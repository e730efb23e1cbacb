"""Ulysses attention: swap the sequence split for a head split, attend, swap back.

DeepSpeed-Ulysses (Jacobs et al., arXiv:2309.14509, §3): each of the ``N`` hosts holds ``S/N`` tokens
of every head. One all-to-all per tensor re-splits q, k, v by heads: afterwards a host holds **the
whole sequence** of ``heads/N`` heads, attends it with the ring's hop code (one hop, ``kernels/xla.py`` or a
Pallas kernel, tiles skipped by the masks), and one all-to-all brings the output back to the sequence
split. Every host sends ``(N-1)/N`` of its q, k, v and o (and, in the backward, of dO, dQ, dK, dV):
a volume that does not grow with ``N``, unlike the ring's and the all-gather's ``(N-1)`` K/V shards;
but ``N`` can be at most the number of heads, and while it attends a host holds ``O(S)`` tokens of
its heads.

GQA/MQA: with ``kv_heads`` a multiple of ``N`` each host receives ``kv_heads/N`` kv heads together
with exactly the query heads that use them (head ``i`` uses kv head ``i // group``): K/V are never
repeated. Otherwise each kv head is repeated ``r = N / gcd(kv_heads, N)`` times before the all-to-all
(``kv_heads * r`` is a multiple of ``N`` and divides ``heads``), so every host again gets whole
groups: with ``kv_heads < N`` (MQA: 1) each host receives one copy of the one kv head its query heads
share, and K/V cost ``r`` times their bytes on the wire. ``heads`` not divisible by ``N`` is a
ValueError. Positions, segment ids and a bias are gathered (a bias with a heads axis is re-split by
heads like q), so every mask and layout of the ring means the same here. Gradients: the hop's
backward inside a ``custom_vjp`` (``allgather.attend_whole``); JAX transposes the all-to-alls.
"""
from __future__ import annotations

import dataclasses
from math import gcd

import jax.numpy as jnp
from jax import lax

from ringattn_ref import validation as val

from .allgather import attend_whole
from .comm import gather
from .front import Strategy, check_shard_call, finish, host_inputs, on_mesh
from .schedule import KVShard, QShard


def check_heads(heads, kv_heads, n, axis_name="sp", *, who="ulysses_attention",
                fix="use ring_attention or allgather_attention, or a head count that is a multiple of {n}"):
    """Ulysses splits whole heads over the axis: ``heads`` must be a multiple of its size ``n``. Returns how
    often each kv head is repeated (GQA with fewer kv heads than ``n``). ``who`` / ``fix``: the caller's
    name and advice in the error (the hybrid's Ulysses axis)."""
    if heads % n:
        raise ValueError(f"{who} splits the heads over mesh axis {axis_name!r}: heads ({heads}) must be "
                         f"divisible by its size ({n}); " + fix.format(n=n, heads=heads))
    return n // gcd(kv_heads, n)


def _seq_to_heads(x, axis_name):
    """[b, s_local, heads, d] -> [b, seq, heads/N, d]: one all-to-all."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def _bias_to_heads(bias, travels, axis_name):
    """A host's bias block ``[b|1, h|1, s_local|1, seq|s_local|1]`` -> this host's heads, all rows and keys.

    Per-head rows go by one all-to-all (like q); head-broadcast rows are gathered; a key-only
    (``travels``) bias gathers its keys. Per-head without rows: one all-to-all too, whose ``N``
    received blocks are the ``N`` hosts' keys (or, for a bias of one key column, which every host
    holds whole, ``N`` copies: the first is kept). Not a ``dynamic_slice`` at ``axis_index``: XLA CPU
    miscompiles one followed by an all-gather (every host got host 0's heads; measured, jax 0.12).
    """
    if bias is None:
        return None
    per_head, rows = bias.shape[1] > 1, bias.shape[2] > 1
    if per_head:  # (b|1, h, s_local|1, k) -> (b|1, h/N, N * (s_local|1), k)
        bias = lax.all_to_all(bias, axis_name, split_axis=1, concat_axis=2, tiled=True)
        if not rows:  # (b|1, h/N, N, k): host i's keys (a key-only bias) or N copies (one column)
            bb, hh, n, k = bias.shape
            return jnp.reshape(bias, (bb, hh, 1, n * k)) if travels else bias[:, :, :1]
        return bias
    bias = gather(bias, axis_name, 2) if rows else bias
    return gather(bias, axis_name, 3) if travels else bias


def attend(inp):
    """One host's Ulysses attention on validated :class:`~ringattn_fast.front.HostInputs`: ``(o, lse)``.

    All-to-all sequence -> heads (K/V repeated first where ``kv_heads`` does not split, see the module),
    one hop against the whole sequence (``allgather.attend_whole`` without a gather), all-to-all back.
    """
    (q, pos, q_seg), (k, v, k_pos, k_seg, kv_bias), axis_name = inp.qs, inp.kv, inp.cfg.axis_name
    n = lax.axis_size(axis_name)
    r = n // gcd(k.shape[2], n)  # how often each kv head is repeated
    k, v = (jnp.repeat(x, r, axis=2) if r > 1 else x for x in (k, v))  # kv head i -> i*r .. i*r + r - 1
    travels = inp.cfg.bias_mode == "travel"
    bias = _bias_to_heads(kv_bias if travels else inp.bias, travels, axis_name)
    pos = gather(pos, axis_name, 1)  # (b, seq): true positions of the whole sequence, in layout order
    k_pos = gather(k_pos, axis_name, 1)  # the keys' own (their own length in cross-attention)
    qs = QShard(_seq_to_heads(q, axis_name), pos, gather(q_seg, axis_name, 1))
    kv = KVShard(_seq_to_heads(k, axis_name), _seq_to_heads(v, axis_name), k_pos, gather(k_seg, axis_name, 1), bias)
    cfg = dataclasses.replace(inp.cfg, bias_mode=None if bias is None else "travel")  # the bias is in kv
    first = lax.axis_index(axis_name) * qs.q.shape[2]  # this host's first query head after the all-to-all
    first = first if inp.head_offset is None else inp.head_offset + first
    o, lse = attend_whole(cfg, False, qs, kv, None, first.astype(jnp.int32))  # (b, seq, h/N, d), (b, h/N, seq)
    o = lax.all_to_all(o, axis_name, split_axis=1, concat_axis=2, tiled=True)  # (b, s_local, h, d)
    lse = lax.all_to_all(lse, axis_name, split_axis=2, concat_axis=1, tiled=True)  # (b, h, s_local)
    return o, lse


ULYSSES = Strategy("ulysses_attention", attend, q_whole=True, kv_whole=True, check_heads=check_heads)


def ulysses_attention_shard(q, k, v, *, axis_name="sp", causal=False, segment_ids=None, bias=None, window=None,
                            scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                            positions=None, padding_segment=None, return_lse=False, sinks=None, logit_softcap=None,
                            mask_fn=None, score_fn=None, kv_segment_ids=None,
                            kv_positions=None):
    """Ulysses attention inside ``jax.shard_map``: this host's output shard.

    Arguments, shapes and results as ``ring_attention_shard`` (q [b, s_local, h, d], k, v
    [b, s_local, kv_heads, d] in layout order), with ``h`` divisible by the axis size ``N``;
    ``block_q`` and ``block_kv`` divide the whole sequence ``N * s_local`` (a host attends all of it).
    """
    return_lse = val.check_bool(return_lse, "return_lse")
    settings, _ = check_shard_call(
        ULYSSES, q, k, v, axis_name=axis_name, segment_ids=segment_ids, bias=bias, positions=positions,
        kv_segment_ids=kv_segment_ids, kv_positions=kv_positions,
        sinks=sinks, padding_segment=padding_segment, layout=layout, causal=causal, window=window, scale=scale,
        block_q=block_q, block_kv=block_kv, impl=impl, logit_softcap=logit_softcap, mask_fn=mask_fn,
        score_fn=score_fn)
    o, lse = attend(host_inputs(settings, q, k, v, segment_ids=segment_ids, bias=bias, positions=positions,
                                kv_segment_ids=kv_segment_ids, kv_positions=kv_positions))
    return finish(o, lse, sinks=sinks, return_lse=return_lse)


def ulysses_attention(q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
                      window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                      padding_segment=None, return_lse=False, batch_axes=None, head_axis=None, sinks=None,
                      logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None):
    """Ulysses attention on global arrays: the inputs, keywords and result of ``ring_attention``.

    q: [batch, seq, heads, dim] with ``heads`` (per ``head_axis`` shard) divisible by the size ``N``
    of ``axis_name`` (else a ValueError); k, v: [batch, seq, kv_heads, dim] (GQA: repeated only when
    ``kv_heads`` is not a multiple of ``N``, see the module). Every mask, layout and mesh placement of
    the ring, with the same meaning; the layout only orders the tokens on the wire (each host attends
    the whole sequence, so causal load balance does not arise). Returns [batch, seq, heads, dim] in
    q's dtype (and lse [batch, heads, seq] with ``return_lse``).
    """
    return on_mesh(ULYSSES, q, k, v, mesh=mesh, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
                   bias=bias, window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv,
                   impl=impl, padding_segment=padding_segment, return_lse=return_lse, batch_axes=batch_axes,
                   head_axis=head_axis, sinks=sinks, logit_softcap=logit_softcap, mask_fn=mask_fn,
                   score_fn=score_fn, kv_segment_ids=kv_segment_ids)
