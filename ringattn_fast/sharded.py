"""Global arrays in, global arrays out: the ``shard_map`` wrapper and the per-host checks that the
ring, the all-gather and Ulysses share.

:func:`on_mesh` is what ``ring_attention`` (``ring.py``) and the two other strategies do with global
arrays: validate, pad to a length the axis splits (``padding.py``), put the sequence in layout order,
shard q/k/v (and segment ids, bias) over the mesh, run a per-host function with the keywords of
``ring_attention_shard``, and bring ``o`` (and ``lse``) back to true order. The per-host function is
a parameter, so :func:`~ringattn_fast.allgather.allgather_attention` and
:func:`~ringattn_fast.ulysses.ulysses_attention` take exactly the inputs, shardings and mask
semantics of the ring, and differ only in what each host does. Per host, :func:`host_inputs`
applies ``ring_attention_shard``'s checks and builds the same ``QShard`` / ``KVShard`` /
``RingConfig`` (``schedule.py``), so all three strategies run the same hop code. The small helpers
all of them use live here too (``default_block``, the bias modes, the axis size).
"""
from __future__ import annotations

import threading
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import validation as val

from . import comm, padding
from .dispatch import check_impl
from .layouts import permute_axis
from .mesh import check_mesh_axes, mesh_platform, resolve_mesh, varying_axes, vary_like
from .schedule import HopConfig, KVShard, QShard, RingConfig, local_positions


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

def _int32_segment_ids(segment_ids):
    """Traced ids wider than int32 (x64) become int32 ranks: equal ids stay equal, whatever their size."""
    if segment_ids is None or not isinstance(segment_ids, jax.core.Tracer) or segment_ids.dtype.itemsize <= 4:
        return segment_ids
    return jnp.searchsorted(jnp.sort(segment_ids.ravel()), segment_ids).astype(jnp.int32)


_MAPPED = {}  # key of the static arguments -> the jitted shard_map (at most _MAPPED_MAX, oldest dropped)
_MAPPED_MAX = 256
_MAPPED_LOCK = threading.Lock()


def _hashable(static):
    """The static keywords as a cache key, each by type and value (``True``, ``1`` and ``1.0`` are equal
    in Python but not to the checks); arrays (a layout permutation) by value; None if unhashable."""
    def item(x):
        if isinstance(x, np.ndarray):
            return ("array", x.dtype.str, x.shape, tuple(x.ravel().tolist()))
        return type(x), x

    try:
        items = tuple((k, item(x)) for k, x in sorted(static.items()))
        hash(items)
    except TypeError:
        return None
    return items


def _cached(key, build):
    """``build()`` once per ``key``: one jitted shard_map per static configuration.

    Called outside ``jit`` a ``shard_map`` runs its body op by op, every op compiled again on every
    call (a 64-token ring took seconds per call); jitted, a repeated eager call costs microseconds,
    and under an outer ``jit`` it is one nested call of the outer program. A key holding something
    unhashable builds afresh (compiled once per call, still not op by op).
    """
    try:
        hash(key)
    except TypeError:
        return build()
    if key[-1] is None:
        return build()
    with _MAPPED_LOCK:
        fn = _MAPPED.pop(key, None)
        _MAPPED[key] = fn = build() if fn is None else fn  # most recently used last
        while len(_MAPPED) > _MAPPED_MAX:
            _MAPPED.pop(next(iter(_MAPPED)))
    return fn


def on_mesh(shard_fn, q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
            window=None, scale=None, layout="contiguous", impl="auto", padding_segment=None, return_lse=False,
            batch_axes=None, head_axis=None, check_heads=None, fused_ok=False, has_dropout=False, extra_args=None,
            host_kwargs=None, **shard_kwargs):
    """``shard_fn`` (per host, the keywords of ``ring_attention_shard``) applied to global q, k, v.

    Arguments as ``ring_attention``'s; ``shard_kwargs`` go to ``shard_fn`` unchanged;
    ``check_heads(heads, kv_heads, n)``, if given, raises before anything is traced (Ulysses: heads
    must split over the axis). ``fused_ok`` / ``has_dropout`` go to ``dispatch.check_impl``;
    ``extra_args``: ``{name: (array, PartitionSpec)}`` passed to ``shard_fn`` as keyword ``name``;
    ``host_kwargs(kw, axes)``: more keywords computed per host from its shards ``kw`` and the
    :class:`~ringattn_fast.mesh.MeshAxes` (the ring's dropout offsets). Returns [batch, seq, heads, dim]
    in q's dtype, in true order (and lse [batch, heads, seq] with ``return_lse``).
    """
    b, s, h, hk, d = val.check_qkv(q, k, v)
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
    if check_heads is not None:
        tp = 1 if head_axis is None else mesh.shape[head_axis]
        check_heads(h // tp, hk // tp, axes.n)
    check_impl(impl, mesh_platform(mesh), q, k, v, has_bias=bias is not None, has_dropout=has_dropout,
               fused_ok=fused_ok)  # errors before tracing
    padded = padding.pad_for_ring(q, k, v, n_hosts=axes.n, layout=layout, segment_ids=segment_ids, bias=bias,
                                  padding_segment=padding_segment)
    layout, s_ring = padded.layout, padded.q.shape[1]
    perm = partial(permute_axis, layout=layout, n_hosts=axes.n)
    args = {"q": perm(padded.q), "k": perm(padded.k), "v": perm(padded.v)}
    specs = {name: axes.spec("batch", "seq", "heads", None) for name in args}
    if padded.segment_ids is not None:
        args["segment_ids"] = perm(jnp.asarray(padded.segment_ids).astype(jnp.int32))
        specs["segment_ids"] = axes.spec("batch", "seq")
    if padded.bias is not None:  # sharded as the ring shards it: rows by host, a key-only bias by keys
        bias = padded.bias
        rows = "seq" if bias.shape[2] > 1 else None
        cols = "seq" if _bias_mode(bias, b, h, s_ring, 1) == "travel" else None
        args["bias"] = perm(bias, axis=2) if rows else bias
        args["bias"] = perm(args["bias"], axis=3) if bias.shape[3] > 1 else args["bias"]
        specs["bias"] = axes.spec("batch" if bias.shape[0] > 1 else None, "heads" if bias.shape[1] > 1 else None,
                                  rows, cols)
    for name, (x, spec) in (extra_args or {}).items():
        args[name], specs[name] = x, spec
    names = tuple(args)

    static = dict(axis_name=axis_name, causal=causal, window=window, scale=scale, layout=layout, impl=impl,
                  padding_segment=padded.padding_segment, return_lse=True, **shard_kwargs)

    def build():
        def per_host(*xs):
            kw = dict(zip(names, xs))
            kw.update(host_kwargs(kw, axes) if host_kwargs else {})
            return shard_fn(**kw, **static)

        return jax.jit(jax.shard_map(per_host, mesh=mesh, in_specs=tuple(specs[k_] for k_ in names),
                                     out_specs=(specs["q"], axes.spec("batch", "heads", "seq"))))

    key = (shard_fn, host_kwargs, mesh, axes, names, tuple(specs.items()), _hashable(static))
    o, lse = _cached(key, build)(*(args[k_] for k_ in names))
    o = padded.unpad(permute_axis(o, layout, axes.n, inverse=True))
    if not return_lse:
        return o
    return o, padded.unpad(permute_axis(lse, layout, axes.n, axis=2, inverse=True), axis=2)


class HostInputs(NamedTuple):
    """One host's validated inputs: what stays (``qs``), its K/V shard (``kv``, with a key-only bias),
    the non-travelling bias (or None) and the static config (``cfg.bias_mode`` says which bias is which)."""
    qs: QShard
    kv: KVShard
    bias: jax.Array | None
    cfg: RingConfig


def host_inputs(q, k, v, *, axis_name, causal, segment_ids, bias, window, scale, layout, block_q, block_kv, impl,
                positions, padding_segment, q_len, comm_dtype=None, grad_comm_dtype=None):
    """The checks of ``ring_attention_shard`` for a per-host strategy, and its shards as a :class:`HostInputs`.

    Shapes as there (q [b, s_local, h, d], ...); ``q_len(s_local, n)``: how many queries one hop
    holds (the tile side ``block_q`` must divide it; ``block_kv`` divides the whole sequence).
    """
    b, sq, h, _, d = val.check_qkv(q, k, v)
    n = _axis_size(axis_name)
    scale, causal = val.check_scale(scale, d), val.check_bool(causal, "causal")
    window = val.check_window(window, sq * n if positions is None else None)
    seg = val.check_segment_ids(segment_ids, b, sq)
    padding_segment = padding.check_padding_segment(padding_segment, seg)
    layout = val.check_layout(layout, sq * n)
    val.check_n_hosts(n, sq * n, layout, name=f"the size of mesh axis {axis_name!r}")
    bias_mode = _bias_mode(bias, b, h, sq, n)
    if bias is not None and not val.is_float_dtype(bias.dtype):
        raise ValueError(f"bias must be a floating-point array; got dtype {bias.dtype}")
    nq = q_len(sq, n)
    block_q = val.check_block(default_block(nq) if block_q is None else block_q, nq, "block_q")
    block_kv = val.check_block(default_block(sq * n) if block_kv is None else block_kv, sq * n, "block_kv")
    impl = check_impl(impl, mesh_platform(jax.sharding.get_abstract_mesh()), q, k, v, has_bias=bias is not None,
                      fused_ok=False)
    val.check_positions(positions, b, sq)
    pos = local_positions(layout, sq, axis_name, b) if positions is None else positions.astype(jnp.int32)
    seg = None if seg is None else seg.astype(jnp.int32)
    axes = tuple(sorted(set(varying_axes(q, k, v, seg, bias, pos) + (axis_name,))))
    q, k, v, pos, seg, bias = vary_like((q, k, v, pos, seg, bias), axes)
    hop = HopConfig(scale=scale, causal=causal, window=window, block_q=block_q, block_kv=block_kv)
    qs = QShard(q, pos, None if seg is None else padding.padding_queries(seg, padding_segment))
    kv = KVShard(k, v, pos, seg, bias if bias_mode == "travel" else None)
    cfg = RingConfig(axis_name, hop, impl, bias_mode, comm_dtype=comm.check_comm_dtype(comm_dtype),
                     grad_comm_dtype=comm.check_comm_dtype(grad_comm_dtype, "grad_comm_dtype", comm.GRAD_COMM_DTYPES))
    return HostInputs(qs, kv, None if bias_mode == "travel" else bias, cfg)
