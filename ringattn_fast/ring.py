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
from .layouts import permute_axis
from .mesh import check_mesh_axes, mesh_platform, resolve_mesh, varying_axes, vary_like
from .schedule import (Dropout, HopConfig, KVShard, QShard, RingConfig, hop_kv, kv_index, local_positions, ring_loop,
                       send_to_next)
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


def default_block(shard, target=128):
    """The largest divisor of ``shard`` that is at most ``target`` (the tile side when not given).

    128 x 128 tiles keep a tile of float32 logits per kv head at 64 KiB, cache-sized on CPU: measured
    at 8 devices, S=8192, 4 heads, dim 64, fwd+bwd was faster and used less temp memory than with
    256 or 512 tiles (``python -m benchmarks.bench --ours-block-q ... --ours-block-kv ...``).
    """
    return max(c for c in range(1, min(shard, target) + 1) if shard % c == 0)


def _bias_mode(bias, batch, heads, sq, n):
    """Classify a bias (see :class:`~ringattn_fast.schedule.RingConfig`); raise if it fits no mode.

    One rule for the global array (``sq = seq, n = 1``: how ``ring_attention`` shards it) and for a
    host's shard (``sq = s_local, n = axis_size``: how the ring uses it): ``[.., sq|1, 1]`` "static",
    key-only ``[.., 1, sq]`` "travel", ``[.., sq|1, n * sq]`` "columns".
    """
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


def _axis_size(axis_name):
    """The size of mesh axis ``axis_name`` of the enclosing ``shard_map``, or a ValueError saying so."""
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name {axis_name!r} must name a mesh axis of an enclosing jax.shard_map: "
                         f"call ring_attention_shard on per-device shards inside shard_map(..., mesh=...) "
                         f"whose mesh has that axis, or call ring_attention on global arrays") from None


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


def _int32_segment_ids(segment_ids):
    """Traced ids wider than int32 (x64) become int32 ranks: equal ids stay equal, whatever their size."""
    if segment_ids is None or not isinstance(segment_ids, jax.core.Tracer) or segment_ids.dtype.itemsize <= 4:
        return segment_ids
    return jnp.searchsorted(jnp.sort(segment_ids.ravel()), segment_ids).astype(jnp.int32)


def _first_index(mesh_axes, local_size):
    """Global index of this host's first row along a dim split over ``mesh_axes`` (None: not split)."""
    if mesh_axes is None or mesh_axes == ():
        return 0
    return lax.axis_index(mesh_axes) * local_size


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
    b, s, h, hk, d = val.check_qkv(q, k, v)
    comm_dtype = comm.check_comm_dtype(comm_dtype)
    grad_comm_dtype = comm.check_comm_dtype(grad_comm_dtype, "grad_comm_dtype", comm.GRAD_COMM_DTYPES)
    val.check_scale(scale, d)
    causal, return_lse = val.check_bool(causal, "causal"), val.check_bool(return_lse, "return_lse")
    window = val.check_window(window, s)
    segment_ids = val.check_segment_ids(_int32_segment_ids(segment_ids), b, s)
    padding_segment = padding.check_padding_segment(padding_segment, segment_ids)
    val.check_bias(bias, b, h, s)
    layout = val.check_layout(layout, s)
    mesh = resolve_mesh(mesh)
    axes = check_mesh_axes(mesh, axis_name, batch=b, heads=h, kv_heads=hk, batch_axes=batch_axes,
                           head_axis=head_axis)
    dropout_rate = drop_ref.check_dropout_rate(dropout_rate, dropout_key)
    check_impl(impl, mesh_platform(mesh), q, k, v, has_bias=bias is not None,  # errors before tracing
               has_dropout=dropout_rate > 0, fused_ok=comm_dtype is None and grad_comm_dtype is None)
    padded = padding.pad_for_ring(q, k, v, n_hosts=axes.n, layout=layout, segment_ids=segment_ids, bias=bias,
                                  padding_segment=padding_segment)
    layout, s_ring = padded.layout, padded.q.shape[1]
    perm = partial(permute_axis, layout=layout, n_hosts=axes.n)
    args = {"q": perm(padded.q), "k": perm(padded.k), "v": perm(padded.v)}
    specs = {name: axes.spec("batch", "seq", "heads", None) for name in args}
    if padded.segment_ids is not None:
        args["segment_ids"] = perm(jnp.asarray(padded.segment_ids).astype(jnp.int32))
        specs["segment_ids"] = axes.spec("batch", "seq")
    if padded.bias is not None:  # where the bias lives follows its mode (the same rule the host applies)
        bias = padded.bias
        mode = _bias_mode(bias, b, h, s_ring, 1)
        rows = "seq" if bias.shape[2] > 1 else None  # query rows: this host's
        cols = "seq" if mode == "travel" else None  # key-only: sharded like the keys
        args["bias"] = perm(bias, axis=2) if rows else bias
        args["bias"] = perm(args["bias"], axis=3) if bias.shape[3] > 1 else args["bias"]
        specs["bias"] = axes.spec("batch" if bias.shape[0] > 1 else None, "heads" if bias.shape[1] > 1 else None,
                                  rows, cols)
    if dropout_rate > 0:  # replicated; each host adds the global index of its first batch row and head
        args["dropout_key"], specs["dropout_key"] = _dropout_seed(dropout_key), jax.P()
    names = tuple(args)

    def per_host(*xs):
        kw = dict(zip(names, xs))
        if dropout_rate > 0:
            b_local, h_local = kw["q"].shape[0], kw["q"].shape[2]
            kw["dropout_offsets"] = (_first_index(axes.batch, b_local), _first_index(axes.heads, h_local))
        return ring_attention_shard(**kw, axis_name=axis_name, causal=causal, window=window, scale=scale,
                                    layout=layout, block_q=block_q, block_kv=block_kv, impl=impl,
                                    padding_segment=padded.padding_segment, return_lse=True,
                                    dropout_rate=dropout_rate, comm_dtype=comm_dtype,
                                    grad_comm_dtype=grad_comm_dtype)

    o, lse = jax.shard_map(per_host, mesh=mesh, in_specs=tuple(specs[k_] for k_ in names),
                           out_specs=(specs["q"], axes.spec("batch", "heads", "seq")))(*(args[k_] for k_ in names))
    o = padded.unpad(permute_axis(o, layout, axes.n, inverse=True))
    if not return_lse:
        return o
    return o, padded.unpad(permute_axis(lse, layout, axes.n, axis=2, inverse=True), axis=2)
