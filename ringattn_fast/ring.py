"""Ring Attention: the public functions, their ``custom_vjp``, and the forward ring.

Ring Attention (arXiv:2310.01889, Algorithm 1) on ``N = axis_size`` hosts inside ``jax.shard_map``:
host ``my_idx`` keeps its :class:`~ringattn_fast.schedule.QShard` and, at ring step ``step``, holds
K/V shard ``kv_idx = (my_idx - step) % N`` (with 4 hosts, at step 1 host 0 holds K/V shard 3). It
attends to that shard (one hop: ``hop.hop_fwd`` or a Pallas kernel, chosen by ``dispatch``), merges
the hop's ``(o, lse)`` into its running result (``softmax.merge``, in float32 or float64) and passes
the :class:`~ringattn_fast.schedule.KVShard` on to host ``my_idx + 1``. K/V travel ``N - 1`` times:
the send is issued at the top of a step (so it can overlap the hop's compute) and there is none after
the last step. A hop the mask leaves provably empty is skipped with ``lax.cond`` (for the kernels
that allow it: the TPU kernels skip inside their tile schedule instead). The backward ring is
``backward.py``; the ``custom_vjp`` that joins the two is here, next to the forward.

Mirrors ``ringattn_ref.ring``. Public: :func:`ring_attention` (global arrays, does the ``shard_map``)
and :func:`ring_attention_shard` (per host, inside your own ``shard_map``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import dropout as drop_ref
from ringattn_ref import validation as val

from . import comm, masks, padding
from .backward import ring_backward
from .dispatch import check_impl, kernels_for
from .hop import acc_dtype
from .mesh import mesh_platform, varying_axes, vary_like
from .schedule import (Dropout, HopConfig, KVShard, QShard, RingConfig, hop_kv, kv_index, local_positions, ring_loop,
                       send_to_next)
from .sharded import _axis_size, _bias_mode, default_block, on_mesh
from .softmax import merge


def ring_forward(cfg, qs, kv, bias, drop=None):
    """The forward ring on this host: ``(o, lse)``, o ``[b, sq, h, d]``, lse ``[b, h, sq]`` in float32/64.

    qs: this host's queries; kv: this host's own K/V shard (it starts the ring); bias: the host's
    non-travelling bias (``cfg.bias_mode`` "columns" or "static") or None; drop: a
    ``schedule.Dropout`` or None. A key holding a nan/inf is marked first (``masks.mark_bad_keys``),
    so no hop meets ``0 * nan``.
    """
    hop_fwd = kernels_for(cfg.impl).hop_fwd
    hop_fwd = hop_fwd if drop is None else partial(hop_fwd, drop=drop)
    n, my_idx = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    b, sq, h, d = qs.q.shape
    kv = masks.mark_bad_keys_of(kv)
    acc, kv_dtype = acc_dtype(qs.q.dtype), kv.k.dtype
    skip = cfg.skip_empty_hops and masks.can_be_empty(cfg.hop.causal, cfg.hop.window, qs.seg is not None)

    def hop(step, kv, o, lse):
        kv = comm.decode(kv, kv_dtype)  # what travels is the wire format (comm_dtype)

        def attend(o, lse):
            o_hop, lse_hop = hop_fwd(qs, hop_kv(cfg, kv, bias, kv_index(my_idx, step, n)), cfg.hop)
            return merge(o, lse, o_hop.astype(acc), lse_hop.astype(acc))

        if skip:
            empty = masks.tile_is_empty(qs.pos, kv.pos, qs.seg, kv.seg, causal=cfg.hop.causal, window=cfg.hop.window)
            return lax.cond(empty, lambda o, lse: (o, lse), attend, o, lse)
        return attend(o, lse)

    def step_fn(carry, step):
        kv, o, lse = carry
        kv_next = send_to_next(kv, cfg.axis_name)  # issued first: overlaps the hop
        o, lse = hop(step, kv, o, lse)
        return kv_next, o, lse

    o = jnp.zeros((b, sq, h, d), acc)
    lse = jnp.full((b, h, sq), -jnp.inf, acc)
    axes = varying_axes(*qs, *kv, bias)
    kv, o, lse = ring_loop(step_fn, (comm.encode(kv, cfg.comm_dtype),) + vary_like((o, lse), axes), n)
    return hop(n - 1, kv, o, lse)  # the last step: nothing left to send


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, qs, kv, bias, drop=None):
    """Ring attention on this host: ``(o, lse)``, o ``[b, sq, h, d]`` in q's dtype, lse ``[b, h, sq]``
    float32 (float64 for float64); differentiable in q, k, v, bias (and through lse)."""
    o, lse = ring_forward(cfg, qs, kv, bias, drop)
    return o.astype(qs.q.dtype), lse


def _ring_fwd(cfg, qs, kv, bias, drop=None):
    """The forward saves only its inputs, ``o`` and ``lse``: ``O(S/N)`` per host."""
    o, lse = ring_forward(cfg, qs, kv, bias, drop)
    o = o.astype(qs.q.dtype)
    return (o, lse), (qs, kv, bias, o, lse, drop)


def _ring_bwd(cfg, res, cotangents):
    qs, kv, bias, o, lse, drop = res
    do, dlse = cotangents
    dq, dkv, dbias = ring_backward(cfg, qs, kv, bias, o, lse, do, dlse, drop)
    cast = lambda g, x: None if x is None else g.astype(x.dtype)  # noqa: E731
    return (QShard(cast(dq, qs.q), None, None),
            KVShard(cast(dkv.dk, kv.k), cast(dkv.dv, kv.v), None, None, cast(dkv.dbias, kv.bias)),
            cast(dbias, bias), None if drop is None else Dropout(None, None, None))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _dropout_seed(key):
    """The two uint32 words of a dropout key: a typed ``jax.random.key``, a raw ``PRNGKey`` (uint32 [2])
    or an int seed in ``[0, 2**64)`` (``ringattn_ref.dropout``: the same words give the same mask)."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jnp.asarray(drop_ref.int_seed_words(key))
    if hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if getattr(key, "shape", None) != (2,) or getattr(key, "dtype", None) != jnp.uint32:
        raise ValueError(f"dropout_key must be a jax.random.key (threefry), a raw PRNGKey (uint32 [2]) or an int "
                         f"seed; got {type(key).__name__} with shape {getattr(key, 'shape', None)}, dtype "
                         f"{getattr(key, 'dtype', None)}")
    return jnp.asarray(key)


def ring_attention_shard(q, k, v, *, axis_name="sp", causal=False, segment_ids=None, bias=None, window=None,
                         scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                         positions=None, padding_segment=None, return_lse=False, dropout_rate=0.0,
                         dropout_key=None, dropout_offsets=(0, 0), comm_dtype=None, grad_comm_dtype=None):
    """Ring attention for code already inside ``jax.shard_map``: this host's output shard.

    q: [batch, s_local, heads, dim] and k, v: [batch, s_local, kv_heads, dim], this host's shard of the
    layout-ordered sequence (``to_layout``; ``padding.pad_for_ring`` first if the length does not
    split); segment_ids: int32 [batch, s_local]; bias: see :func:`_bias_mode`; positions: int
    [batch, s_local] true positions in ``[0, 2**31)``, overriding ``layout`` (for a custom per-example
    permutation, ``to_layout(..., positions=...)``); padding_segment: keys of that segment are masked
    for every query and its queries return 0. dropout_rate / dropout_key: attention dropout with the
    mask of ``ringattn_ref.dropout`` (a function of the key, batch row, head and true positions: the
    same for every ring size, layout and block size; XLA hop only); the batch row and head count from
    ``dropout_offsets = (first batch row, first head)`` of this host (``ring_attention`` sets them when
    it splits the batch or the heads over mesh axes). Differentiable in q, k, v, bias. Returns
    [batch, s_local, heads, dim] in q's dtype, and with ``return_lse`` also lse [batch, heads, s_local]
    (float32, float64 for float64; -inf on rows that see nothing). comm_dtype: K/V travel in this
    dtype (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``/``"float8_e5m2"`` with a per-block scale;
    rounded once at home, accumulated in float32); grad_comm_dtype: dK/dV travel in it (``comm.py``).
    """
    b, sq, h, _, d = val.check_qkv(q, k, v)
    comm_dtype = comm.check_comm_dtype(comm_dtype)
    grad_comm_dtype = comm.check_comm_dtype(grad_comm_dtype, "grad_comm_dtype", comm.GRAD_COMM_DTYPES)
    n = _axis_size(axis_name)
    scale, causal = val.check_scale(scale, d), val.check_bool(causal, "causal")
    window = val.check_window(window, sq * n if positions is None else None)
    seg = val.check_segment_ids(segment_ids, b, sq)
    padding_segment = padding.check_padding_segment(padding_segment, seg)
    return_lse = val.check_bool(return_lse, "return_lse")
    layout = val.check_layout(layout, sq * n)
    val.check_n_hosts(n, sq * n, layout, name=f"the size of mesh axis {axis_name!r}")
    bias_mode = _bias_mode(bias, b, h, sq, n)
    if bias is not None and not val.is_float_dtype(bias.dtype):
        raise ValueError(f"bias must be a floating-point array; got dtype {bias.dtype}")
    block_q = val.check_block(default_block(sq) if block_q is None else block_q, sq, "block_q")
    block_kv = val.check_block(default_block(sq) if block_kv is None else block_kv, sq, "block_kv")
    dropout_rate = drop_ref.check_dropout_rate(dropout_rate, dropout_key)
    impl = check_impl(impl, mesh_platform(jax.sharding.get_abstract_mesh()), q, k, v, has_bias=bias is not None,
                      has_dropout=dropout_rate > 0, fused_ok=comm_dtype is None and grad_comm_dtype is None)
    val.check_positions(positions, b, sq)
    pos = local_positions(layout, sq, axis_name, b) if positions is None else positions.astype(jnp.int32)
    seg = None if seg is None else seg.astype(jnp.int32)
    axes = tuple(sorted(set(varying_axes(q, k, v, seg, bias, pos) + (axis_name,))))
    q, k, v, pos, seg, bias = vary_like((q, k, v, pos, seg, bias), axes)
    hop = HopConfig(scale=scale, causal=causal, window=window, block_q=block_q, block_kv=block_kv,
                    dropout_rate=dropout_rate)
    drop = None
    if dropout_rate > 0:
        drop = Dropout(_dropout_seed(dropout_key), *(jnp.asarray(x).astype(jnp.uint32) for x in dropout_offsets))
    qs = QShard(q, pos, None if seg is None else padding.padding_queries(seg, padding_segment))
    kv = KVShard(k, v, pos, seg, bias if bias_mode == "travel" else None)
    if impl == "pallas_tpu_fused":  # the whole ring in one kernel (its own custom_vjp)
        kv = masks.mark_bad_keys_of(kv)
        o, lse = kernels_for(impl).ring(qs, kv, hop, axis_name=axis_name, return_lse=True)
    else:
        cfg = RingConfig(axis_name, hop, impl, bias_mode, skip_empty_hops=kernels_for(impl).ring_may_skip,
                         comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype)
        o, lse = _ring(cfg, qs, kv, None if bias_mode == "travel" else bias, drop)
    return (o, lse) if return_lse else o



def _first_index(mesh_axes, local_size):
    """Global index of this host's first row along a dim split over ``mesh_axes`` (None: not split)."""
    if mesh_axes is None or mesh_axes == ():
        return 0
    return lax.axis_index(mesh_axes) * local_size


def _dropout_offsets(kw, axes):
    """Per host: the global index of its first batch row and first head (the dropout hash's offsets)."""
    b_local, h_local = kw["q"].shape[0], kw["q"].shape[2]
    return {"dropout_offsets": (_first_index(axes.batch, b_local), _first_index(axes.heads, h_local))}


def ring_attention(q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
                   window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
                   padding_segment=None, return_lse=False, batch_axes=None, head_axis=None, dropout_rate=0.0,
                   dropout_key=None, comm_dtype=None, grad_comm_dtype=None):
    """Ring attention on global arrays: shards them over ``mesh``, runs the ring, returns the output.

    - q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] (heads % kv_heads == 0);
      dtypes: see ``impl``; any ``seq`` (padded inside to a length the ring splits: ``padding.py``);
    - segment_ids: int [batch, seq] (values beyond int32 are rejected, or ranked when traced);
    - padding_segment: a segment id whose keys no query sees and whose queries return 0 (MaxText's
      0);
    - bias: broadcastable to [batch, heads, seq, seq] (a full bias is sharded by query rows, a
      key-only ``[b|1, h|1, 1, seq]`` one travels with K/V);
    - window: ``(left, right)`` ints, -1 or at least ``seq - 1`` = unbounded;
    - layout: ``"contiguous" | "striped" | "zigzag"`` or a permutation;
    - impl: ``"auto" | "xla" | "pallas_gpu" | "pallas_tpu" | "pallas_tpu_fused"`` (``dispatch``);
    - dropout_rate / dropout_key: attention dropout (``jax.random.key``, raw ``PRNGKey`` or int seed;
      no default key): the mask of ``ringattn_ref.dropout``, identical for every mesh, layout and
      block size; runs in the XLA hop (``impl="auto"`` picks it, a Pallas impl is an error).

    The sequence is sharded on ``axis_name``, the batch on ``batch_axes`` (default ``"data"`` if the
    mesh has it; one name or a tuple), the heads on ``head_axis`` (default: not split); q, k, v are
    never gathered. ``mesh=None``: the mesh of ``jax.set_mesh`` or all devices. Returns
    [batch, seq, heads, dim] in q's dtype, in true order, and with ``return_lse`` also lse
    [batch, heads, seq] (float32; float64 for float64; -inf on rows that see nothing). A masked key
    contributes nothing, whatever its values. comm_dtype / grad_comm_dtype: what K/V and dK/dV travel
    in (see :func:`ring_attention_shard`).
    """
    comm_dtype = comm.check_comm_dtype(comm_dtype)
    grad_comm_dtype = comm.check_comm_dtype(grad_comm_dtype, "grad_comm_dtype", comm.GRAD_COMM_DTYPES)
    dropout_rate = drop_ref.check_dropout_rate(dropout_rate, dropout_key)
    extra_args, host_kwargs = {}, None
    if dropout_rate > 0:  # the key is replicated; each host adds the global index of its first batch row and head
        extra_args["dropout_key"] = (_dropout_seed(dropout_key), jax.P())
        host_kwargs = _dropout_offsets

    return on_mesh(ring_attention_shard, q, k, v, mesh=mesh, axis_name=axis_name, causal=causal,
                   segment_ids=segment_ids, bias=bias, window=window, scale=scale, layout=layout, impl=impl,
                   padding_segment=padding_segment, return_lse=return_lse, batch_axes=batch_axes,
                   head_axis=head_axis, fused_ok=comm_dtype is None and grad_comm_dtype is None,
                   has_dropout=dropout_rate > 0, extra_args=extra_args, host_kwargs=host_kwargs,
                   block_q=block_q, block_kv=block_kv, dropout_rate=dropout_rate, comm_dtype=comm_dtype,
                   grad_comm_dtype=grad_comm_dtype)
