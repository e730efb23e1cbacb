"""Ring Attention: the public functions, their ``custom_vjp``, and the forward ring.

Ring Attention (arXiv:2310.01889, Algorithm 1) on ``N = axis_size`` hosts inside ``jax.shard_map``:
host ``my_idx`` keeps its :class:`~ringattn_fast.schedule.QShard` and, at ring step ``step``, holds
K/V shard ``kv_idx = (my_idx - step) % N`` (with 4 hosts, at step 1 host 0 holds K/V shard 3). It
attends to that shard (one hop: ``kernels/xla.py`` or a Pallas kernel, chosen by ``dispatch``), merges
the hop's ``(o, lse)`` into its running result (``softmax.merge_into``: ``(o, m, l)``, float32 or
float64, lse = ``m + log(l)`` rounded once at the end, not at every hop) and passes
the :class:`~ringattn_fast.schedule.KVShard` on to host ``my_idx + 1``. K/V travel ``N - 1`` times:
the send is issued at the top of a step (so it can overlap the hop's compute) and there is none after
the last step. A hop the mask leaves provably empty is skipped with ``lax.cond`` (for the kernels
that allow it: the TPU kernels skip inside their tile schedule instead). The backward ring is
``backward.py``; the ``custom_vjp`` that joins the two is here, next to the forward.

Mirrors ``ringattn_ref.ring``. Public: :func:`ring_attention` (global arrays, does the ``shard_map``)
and :func:`ring_attention_shard` (per host, inside your own ``shard_map``); both are validated once at
the front door (``front.py``) and then run :func:`attend` on the host's :class:`~ringattn_fast.front.HostInputs`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax import lax

from ringattn_ref import validation as val

from . import block_mask, comm, masks
from .backward import ring_backward
from .dispatch import kernels_for
from .front import Strategy, check_shard_call, finish, host_inputs, on_mesh
from .mesh import varying_axes, vary_like
from .schedule import Dropout, KVShard, QShard, hop_kv, kv_index, ring_loop, send_to_next, single_hop
from .softmax import acc_dtype, merge_into, running_lse


def ring_forward(cfg, qs, kv, bias, drop=None, head_offset=None):
    """The forward ring on this host: ``(o, lse)``, o ``[b, sq, h, d_v]``, lse ``[b, h, sq]`` in float32/64 (with
    one host, o as the hop returns it: q's dtype where the kernel honours ``HopConfig.out_dtype``).

    qs: this host's queries; kv: this host's own K/V shard (it starts the ring); bias: the host's
    non-travelling bias (``cfg.bias_mode`` "columns" or "static") or None; drop: a
    ``schedule.Dropout`` or None; head_offset: the global index of the first query head here when the
    heads are split over a mesh axis (``mask_fn`` / ``score_fn`` see global heads), or None. A key holding a nan/inf is marked first (``masks.mark_bad_keys``),
    so no hop meets ``0 * nan`` (the per-hop TPU kernels mark their tiles in VMEM instead: ``masks.marked_for_ring``).
    """
    hop_fwd = kernels_for(cfg.impl).hop_fwd
    hop_fwd = hop_fwd if drop is None else partial(hop_fwd, drop=drop)
    n, my_idx = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    b, sq, h, _ = qs.q.shape
    kv = masks.marked_for_ring(kv, cfg.impl, cfg.comm_dtype)
    acc, kv_dtype = acc_dtype(qs.q.dtype), kv.k.dtype
    builtin = masks.can_be_empty(cfg.hop.causal, cfg.hop.window, qs.seg is not None)
    skip = cfg.skip_empty_hops and (builtin or cfg.block_mask is not None)

    def hop(step, kv, o, m, l):
        kv = comm.decode(kv, kv_dtype)  # what travels is the wire format (comm_dtype)
        kv_idx = kv_index(my_idx, step, n)

        def attend_hop(o, m, l):
            o_hop, lse_hop = hop_fwd(qs, hop_kv(cfg, kv, bias, kv_idx), cfg.hop,
                                     **block_mask.hop_extras(cfg, my_idx, kv_idx, head_offset))
            return merge_into(o, m, l, o_hop.astype(acc), lse_hop.astype(acc))

        if skip:
            return lax.cond(block_mask.hop_is_empty(cfg, qs, kv, my_idx, step), lambda *running: running, attend_hop,
                            o, m, l)
        return attend_hop(o, m, l)

    def step_fn(carry, step):
        kv, o, m, l = carry
        kv_next = send_to_next(kv, cfg.axis_name)  # issued first: overlaps the hop
        o, m, l = hop(step, kv, o, m, l)
        return kv_next, o, m, l

    if n == 1:  # one hop: nothing to merge, so no float32 accumulator and no loop (memory at N = 1)
        kv = comm.decode(comm.encode(kv, cfg.comm_dtype), kv_dtype)  # rounded as a ring of N would round it
        return hop_fwd(qs, hop_kv(cfg, kv, bias, 0), single_hop(cfg.hop, qs.q.dtype),
                       **block_mask.hop_extras(cfg, my_idx, 0, head_offset))
    o = jnp.zeros((b, sq, h, kv.v.shape[-1]), acc)  # as wide as v (MLA: d_v != d)
    m, l = jnp.full((b, h, sq), -jnp.inf, acc), jnp.zeros((b, h, sq), acc)  # lse = m + log(l): merge_into
    axes = varying_axes(*qs, *kv, bias)
    kv, o, m, l = ring_loop(step_fn, (comm.encode(kv, cfg.comm_dtype, pack=True),) + vary_like((o, m, l), axes), n)
    o, m, l = hop(n - 1, kv, o, m, l)  # the last step: nothing left to send
    return o, running_lse(m, l)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, qs, kv, bias, drop=None, head_offset=None):
    """Ring attention on this host: ``(o, lse)``, o ``[b, sq, h, d]`` in q's dtype, lse ``[b, h, sq]``
    float32 (float64 for float64); differentiable in q, k, v, bias (and through lse)."""
    o, lse = ring_forward(cfg, qs, kv, bias, drop, head_offset)
    return o.astype(qs.q.dtype), lse


def _ring_fwd(cfg, qs, kv, bias, drop=None, head_offset=None):
    """The forward saves only its inputs, ``o`` and ``lse``: ``O(S/N)`` per host."""
    o, lse = ring_forward(cfg, qs, kv, bias, drop, head_offset)
    o = o.astype(qs.q.dtype)
    return (o, lse), (qs, kv, bias, o, lse, drop, head_offset)


def _ring_bwd(cfg, res, cotangents):
    qs, kv, bias, o, lse, drop, head_offset = res
    do, dlse = cotangents
    dq, dkv, dbias = ring_backward(cfg, qs, kv, bias, o=o, lse=lse, do=do, dlse=dlse, drop=drop,
                                   head_offset=head_offset)
    cast = lambda g, x: None if x is None else g.astype(x.dtype)  # noqa: E731
    return (QShard(cast(dq, qs.q), None, None),
            KVShard(cast(dkv.dk, kv.k), cast(dkv.dv, kv.v), None, None, cast(dkv.dbias, kv.bias)),
            cast(dbias, bias), None if drop is None else Dropout(None, None, None), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def attend(inp):
    """One host's ring on validated :class:`~ringattn_fast.front.HostInputs`: ``(o, lse)``, o in q's dtype.

    ``impl="pallas_tpu_fused"`` runs the whole ring in one kernel (its own ``custom_vjp``); every other
    impl runs :func:`ring_forward` hop by hop under :func:`_ring`'s ``custom_vjp``.
    """
    cfg = inp.cfg
    if cfg.impl == "pallas_tpu_fused":
        return kernels_for(cfg.impl).ring(inp.qs, masks.mark_bad_keys_of(inp.kv), cfg.hop, axis_name=cfg.axis_name,
                                          return_lse=True)
    return _ring(cfg, inp.qs, inp.kv, inp.bias, inp.drop, inp.head_offset)


RING = Strategy("ring_attention", attend, fused_ok=True, dropout=True, comm=True)


def ring_attention_shard(q, k, v, *, axis_name="sp", causal=False, segment_ids=None, bias=None, window=None,
                         scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                         positions=None, padding_segment=None, return_lse=False, dropout_rate=0.0,
                         dropout_key=None, dropout_offsets=(0, 0), comm_dtype=None, grad_comm_dtype=None,
                         sinks=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None,
                         kv_positions=None):
    """Ring attention for code already inside ``jax.shard_map``: this host's output shard.

    q: [batch, s_local, heads, dim] and k, v: [batch, s_local, kv_heads, dim], this host's shard of the
    layout-ordered sequence (``to_layout``; ``padding.pad_for_ring`` first if the length does not
    split); segment_ids: int32 [batch, s_local] (``-2**31`` and ``-2**31 + 1`` reserved: ``padding.py``);
    bias: see :func:`~ringattn_fast.front.bias_mode`; positions: int [batch, s_local] true positions in
    ``[0, 2**31)`` (a traced one beyond them makes the output NaN), overriding ``layout`` (for a
    custom per-example permutation, ``to_layout(..., positions=...)``); padding_segment: keys of that
    segment are masked for every query and its queries return 0. dropout_rate / dropout_key: attention
    dropout with the mask of ``ringattn_ref.dropout`` (a function of the key, batch row, head and true
    positions: the same for every ring size, layout and block size; XLA hop only); the batch row and
    head count from ``dropout_offsets = (first batch row, first head)`` of this host (``ring_attention``
    sets them when it splits the batch or the heads over mesh axes). Differentiable in q, k, v, bias.
    Returns [batch, s_local, heads, dim] in q's dtype, and with ``return_lse`` also lse
    [batch, heads, s_local] (float32, float64 for float64; -inf on rows that see nothing). comm_dtype:
    K/V travel in this dtype (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``/``"float8_e5m2"``
    with a per-block scale; rounded once at home, accumulated in float32); grad_comm_dtype: dK/dV
    travel in it (``comm.py``). sinks: float [heads] of this host, a learnable logit per query head
    that joins every row's softmax denominator and brings no value (gpt-oss; ``softmax.add_sinks``).
    Cross-attention: k, v [batch, sk_local, kv_heads, dim] of their own length (the keys' shard of
    ``N * sk_local``, laid out with ``layout`` on their own; queries at the last positions), with
    kv_segment_ids / kv_positions [batch, sk_local] for the keys. Inside your own shard_map a
    ``mask_fn`` / ``score_fn`` sees this host's head indices (add your head offset in the function).
    """
    return_lse = val.check_bool(return_lse, "return_lse")
    settings, drop = check_shard_call(
        RING, q, k, v, axis_name=axis_name, segment_ids=segment_ids, bias=bias, positions=positions,
        kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, sinks=sinks,
        padding_segment=padding_segment, layout=layout, dropout_key=dropout_key, dropout_offsets=dropout_offsets,
        causal=causal, window=window, scale=scale, block_q=block_q, block_kv=block_kv, impl=impl,
        comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype, dropout_rate=dropout_rate, logit_softcap=logit_softcap,
        mask_fn=mask_fn, score_fn=score_fn)
    o, lse = attend(host_inputs(settings, q, k, v, segment_ids=segment_ids, bias=bias, positions=positions,
                                kv_segment_ids=kv_segment_ids, kv_positions=kv_positions,
                                drop=drop))
    return finish(o, lse, sinks=sinks, return_lse=return_lse)


def ring_attention(q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
                   window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                   padding_segment=None, return_lse=False, batch_axes=None, head_axis=None, dropout_rate=0.0,
                   dropout_key=None, comm_dtype=None, grad_comm_dtype=None, sinks=None, logit_softcap=None,
                   mask_fn=None, score_fn=None, kv_segment_ids=None):
    """Ring attention on global arrays: shards them over ``mesh``, runs the ring, returns the output.

    - q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] (heads % kv_heads == 0);
      dtypes: see ``impl``; any ``seq`` (padded inside to a length the ring splits: ``padding.py``);
      v may be [batch, seq, kv_heads, dim_v] (MLA; o is then ``dim_v`` wide); k, v may hold another
      length ``S`` than q's ``T`` (cross-attention: each side laid out and sharded on its own, queries
      at the last T of the S positions, so causal means key ``j`` <= query ``i + S - T``; with segment
      ids pass the keys' as ``kv_segment_ids`` [batch, S]; a bias is [b|1, h|1, T|1, S|1]);
    - segment_ids: int [batch, seq] (values beyond int32 and the reserved ``-2**31``, ``-2**31 + 1``
      are rejected; traced ids are ranked, so none can wrap or collide: ``padding.py``);
    - padding_segment: a segment id whose keys no query sees and whose queries return 0 (MaxText's
      0);
    - bias: broadcastable to [batch, heads, seq, seq] (a full bias is sharded by query rows, a
      key-only ``[b|1, h|1, 1, seq]`` one travels with K/V);
    - window: ``(left, right)`` ints, -1 or at least ``seq - 1`` = unbounded;
    - layout: ``"contiguous" | "striped" | "zigzag"`` or a permutation;
    - impl: ``"auto" | "xla" | "pallas_gpu" | "pallas_tpu" | "pallas_tpu_fused"`` (``dispatch``);
    - dropout_rate / dropout_key: attention dropout (``jax.random.key``, raw ``PRNGKey`` or int seed;
      no default key): the mask of ``ringattn_ref.dropout``, identical for every mesh, layout and
      block size; runs in the XLA hop (``impl="auto"`` picks it, a Pallas impl is an error);
    - sinks: float [heads], a learnable logit per query head that joins every row's softmax
      denominator and brings no value (gpt-oss); lse includes it; every impl (``softmax.add_sinks``);
    - logit_softcap: ``c``: the scaled logits become ``c * tanh(s / c)`` *before* the bias and the mask
      are added (Gemma 2 caps ``q k / sqrt(d)`` itself); every impl (the XLA hop and the Pallas kernels,
      forward and backward). Why this order: the bias stays exact -- a ``-inf`` (or large negative)
      masking bias still masks, where capping after it would turn ``-inf`` into ``-c``, a logit like
      any other (a masked key would get weight ``e^-c`` against a logit of 0), and an ALiBi or position
      bias keeps its full range. Some libraries
      (Tokamax) cap after the bias; for that order with a bias of positions and heads, write both in
      one ``score_fn``, ``c * tanh((s + b(q_pos, k_pos, head)) / c)``, and leave ``logit_softcap`` None;
    - mask_fn(q_pos, k_pos, q_seg, k_seg, head) -> bool / score_fn(s, q_pos, k_pos, head) -> s: user
      functions of true positions (``ringattn_ref.variants``) and global head indices, evaluated per
      tile (a pair attends iff the built-in mask and ``mask_fn`` allow it; ``score_fn`` after the
      softcap, before the bias; its gradient by autodiff per tile), so they must be elementwise in the
      (query, key) pairs: a reduction (``q_pos.max()``, ``s.max(-1)``), cumulative op, sort, matmul, or
      slice or gather across pairs is a ValueError naming the op, before any compute; a constant table
      indexed by positions and every ``jax.numpy`` elementwise function are fine. Functions of equal code
      and closure values share one compiled program (``fn_keys``; the same function object keeps its
      first program, as with ``jax.jit``). With layout positions and no
      segment ids, ``mask_fn``'s block mask is computed once per configuration
      (``ringattn_fast.block_mask``): the ring skips the hops it leaves empty, the XLA hop the empty
      tiles, and full tiles run without a mask.

    The sequence is sharded on ``axis_name``, the batch on ``batch_axes`` (default ``"data"`` if the
    mesh has it; one name or a tuple), the heads on ``head_axis`` (default: not split); q, k, v are
    never gathered. ``mesh=None``: the mesh of ``jax.set_mesh`` or all devices; Auto or Explicit axes
    (on an Explicit mesh o comes back sharded like q). Returns [batch, seq, heads, dim] in q's dtype,
    in true order, and with ``return_lse`` also lse [batch, heads, seq] (float32; float64 for float64;
    -inf on rows that see nothing). A masked key contributes nothing, whatever its values. comm_dtype /
    grad_comm_dtype: what K/V and dK/dV travel in (see :func:`ring_attention_shard`).
    """
    return on_mesh(RING, q, k, v, mesh=mesh, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
                   bias=bias, window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv,
                   impl=impl, padding_segment=padding_segment, return_lse=return_lse, batch_axes=batch_axes,
                   head_axis=head_axis, dropout_rate=dropout_rate, dropout_key=dropout_key, comm_dtype=comm_dtype,
                   grad_comm_dtype=grad_comm_dtype, sinks=sinks, logit_softcap=logit_softcap, mask_fn=mask_fn,
                   score_fn=score_fn, kv_segment_ids=kv_segment_ids)
