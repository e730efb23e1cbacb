"""The front door: every attention call is validated here, once, and becomes one typed bundle.

The ring (``ring.py``), the all-gather (``allgather.py``) and Ulysses (``ulysses.py``) take the same
arguments and differ only in what a host does with its shards. So the checks live here, not in each of
them: :func:`check_shard_call` validates a per-host call (``*_attention_shard``, inside your
``shard_map``) and :func:`on_mesh` a global one (``*_attention`` on global arrays), both through
:func:`check_settings`, and both raise before anything is traced. What they return is a
:class:`Settings` (everything static: the mask, the tiles, the impl, the bias mode, the wire dtypes);
per host, :func:`host_inputs` turns it and the arrays into a :class:`HostInputs` — what stays
(``QShard``), what travels (``KVShard``), the bias that does not travel and the ``RingConfig`` — that
the strategy's ``attend`` consumes without checking anything again. The kernels below it assume
validated input and guard only their own preconditions (tile shapes, dtypes).

:func:`on_mesh` also does what global arrays need: pad to a length the axis splits (``padding.py``),
put the sequence in layout order, shard q/k/v (and segment ids, bias) over the mesh, run the
strategy per host in one jitted ``shard_map`` (cached per static configuration), and bring ``o`` (and
``lse``) back to true order.
"""
from __future__ import annotations

import dataclasses
import threading
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import dropout as drop_ref
from ringattn_ref import validation as val
from ringattn_ref.blockwise import default_block

from . import block_mask, comm, padding
from .dispatch import check_impl, kernels_for
from .elementwise import first_cross_pair_op
from .fn_keys import canonical
from .layouts import permute_axis
from .mesh import (auto_mesh, call_auto, check_mesh_axes, current_device, mesh_device, resolve_mesh, spec_of,
                   varying_axes, vary_like)
from .schedule import Dropout, HopConfig, KVShard, QShard, RingConfig, local_positions
from .softmax import add_sinks


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What the front door needs to know of a strategy.

    - name: the public function, for messages;
    - attend: ``attend(inp: HostInputs) -> (o, lse)`` on one host (validated input);
    - q_whole / kv_whole: ``block_q`` / ``block_kv`` tile the whole sequence (the hop holds all of it)
      rather than the host's shard;
    - fused_ok: the whole-ring kernel ``pallas_tpu_fused`` may serve it;
    - dropout, comm: it takes ``dropout_rate`` / ``comm_dtype``;
    - check_heads: ``check_heads(heads, kv_heads, n, axis_name)`` raises if the heads cannot be split;
    - hop_factor: a hop holds ``hop_factor`` hosts' tokens (the hybrid's Ulysses group), not one host's;
    - splits_heads: the heads are split over hosts inside the strategy (user functions need the offset).
    """
    name: str
    attend: Callable
    q_whole: bool = False
    kv_whole: bool = False
    fused_ok: bool = False
    dropout: bool = False
    comm: bool = False
    check_heads: Callable | None = None
    hop_factor: int = 1
    splits_heads: bool = False


@dataclasses.dataclass(frozen=True)
class Settings:
    """A validated call, minus its arrays: the ring's static config and what builds the host's shards.

    cfg: the ``RingConfig`` (axis, HopConfig, impl, bias mode, wire dtypes); layout: a name or a
    permutation of the whole (padded) sequence; padding_segment: the id whose queries see nothing;
    has_positions: the caller gives true positions (else the layout's); q_offset: what the layout's query
    positions are shifted by, ``S - T`` for cross-attention (queries at the last T of S positions, so
    causal means ``k_pos <= q_pos``), else 0.
    """
    cfg: RingConfig
    layout: object
    padding_segment: int | None = None
    has_positions: bool = False
    q_offset: int = 0


class HostInputs(NamedTuple):
    """One host's validated inputs: what stays (``qs``), its K/V shard (``kv``, with a key-only bias),
    the non-travelling bias or None (``cfg.bias_mode`` says which is which), the static config, and the
    traced half of attention dropout (``schedule.Dropout``) or None, and the global index of the host's
    first query head where a mesh axis splits the heads (``mask_fn`` / ``score_fn`` see global heads)."""
    qs: QShard
    kv: KVShard
    bias: jax.Array | None
    cfg: RingConfig
    drop: Dropout | None = None
    head_offset: jax.Array | None = None


def bias_mode(bias, batch, heads, sq, n, sk=None):
    """Classify a bias (see :class:`~ringattn_fast.schedule.RingConfig`); raise if it fits no mode.

    One rule for the global array (``sq = seq, n = 1``: how ``ring_attention`` shards it) and for a
    host's shard (``sq = s_local, n = axis_size``: how the ring uses it): ``[.., sq|1, 1]`` "static",
    key-only ``[.., 1, sk]`` "travel", ``[.., sq|1, n * sk]`` "columns" (``sk``: the keys' length,
    default ``sq``; cross-attention has its own).
    """
    if bias is None:
        return None
    sk = sq if sk is None else sk
    shape = tuple(bias.shape)
    ok = len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] in (1, sq)
    if ok and shape[3] == 1:
        return "static"
    if ok and shape[2] == 1 and shape[3] == sk:
        return "travel"
    if ok and shape[3] == n * sk:
        return "columns"
    raise ValueError(f"bias (per host) must be [batch|1, heads|1, {sq}|1, {n * sk}] (local query rows, all "
                     f"key columns in layout order) or key-only [batch|1, heads|1, 1, {sk}] (this host's "
                     f"keys; it travels with K/V); got shape {shape}")


def axis_size(axis_name, strategy):
    """The size of mesh axis ``axis_name`` of the enclosing ``shard_map``, or a ValueError saying so."""
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name {axis_name!r} must name a mesh axis of an enclosing jax.shard_map: "
                         f"call {strategy.name}_shard on per-device shards inside shard_map(..., mesh=...) "
                         f"whose mesh has that axis, or call {strategy.name} on global arrays") from None


def dropout_seed(key):
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


def check_settings(strategy, q, k, v, *, n, s_local, axis_name, causal, window, window_seq, scale, layout,
                   block_q, block_kv, impl, device, bias_mode, padding_segment, has_positions=False,
                   comm_dtype=None, grad_comm_dtype=None, dropout_rate=0.0, dropout_key=None, logit_softcap=None,
                   mask_fn=None, score_fn=None, sinks=None, kv_local=None, q_offset=0, has_segments=False,
                   heads_split=False):
    """The checks both doors share, on a host's view (``s_local`` tokens of ``N * s_local``): a :class:`Settings`.

    ``kv_local``: the keys' tokens per host when they differ from the queries' (cross-attention);
    ``q_offset``: :attr:`Settings.q_offset`; ``has_segments``: the caller gives segment ids (a ``mask_fn``
    may read them, so no static block mask: ``block_mask.py``); ``heads_split``: a mesh axis splits the
    heads (``head_axis``), so user functions need the host's head offset (the XLA hop adds it).

    ``window_seq``: the length that bounds a window (a bound of at least ``window_seq - 1`` is
    unbounded); None when the caller gives positions. ``bias_mode`` is already classified. ``device``:
    the mesh's ``jax.sharding.AbstractDevice`` (``mesh.mesh_device``): its platform picks the impl and
    whether a kernel is compiled or interpreted, its ``device_kind`` the kernels' default tiles.
    """
    scale, causal = val.check_scale(scale, q.shape[-1]), val.check_bool(causal, "causal")
    window = val.check_window(window, window_seq)
    logit_softcap = val.check_softcap(logit_softcap)
    val.check_sinks(sinks, q.shape[2])  # not a setting: sinks join after the strategy (``finish``)
    mask_fn, score_fn = canonical(mask_fn), canonical(score_fn)  # equal functions share one compiled program
    check_user_fns(mask_fn, score_fn, q.shape[2])
    split = heads_split or strategy.check_heads is not None or strategy.splits_heads
    if split and (mask_fn is not None or score_fn is not None) and impl != "xla":
        if impl != "auto":  # a kernel numbers the heads it holds: it cannot give the functions global ones
            raise ValueError(f"impl={impl!r}: {strategy.name} splits the heads over hosts here, and the Pallas "
                             f"kernels give mask_fn / score_fn local head indices; use impl='xla' or 'auto'")
        impl = "xla"
    if not strategy.comm and (comm_dtype is not None or grad_comm_dtype is not None):
        raise ValueError(f"{strategy.name} takes no comm_dtype / grad_comm_dtype (its collectives move whole "
                         f"q, k, v in their own dtype); got {comm_dtype!r}, {grad_comm_dtype!r}")
    comm_dtype = comm.check_comm_dtype(comm_dtype)
    grad_comm_dtype = comm.check_comm_dtype(grad_comm_dtype, "grad_comm_dtype", comm.GRAD_COMM_DTYPES)
    dropout_rate = drop_ref.check_dropout_rate(dropout_rate, dropout_key)
    if dropout_rate > 0 and not strategy.dropout:
        raise ValueError(f"{strategy.name} takes no dropout_rate (attention dropout runs in the ring); got "
                         f"{dropout_rate!r}")
    kv_local = s_local if kv_local is None else kv_local
    q_len, kv_len = (size * n if whole else size * strategy.hop_factor
                     for whole, size in ((strategy.q_whole, s_local), (strategy.kv_whole, kv_local)))
    fused_ok = strategy.fused_ok and comm_dtype is None and grad_comm_dtype is None
    impl = check_impl(impl, device.platform, q, k, v, has_bias=bias_mode is not None,
                      has_dropout=dropout_rate > 0, fused_ok=fused_ok,
                      logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn,
                      device_kind=getattr(device, "device_kind", None))
    if impl == "pallas_tpu_fused" and n == 1:  # a ring of one moves nothing: the per-hop kernels are the ring
        impl = "pallas_tpu"
    kernels = kernels_for(impl)
    tiles = None  # the kernels' own defaults for the chip they are compiled for (kernels/budgets.py)
    if (block_q is None or block_kv is None) and kernels.default_blocks is not None:
        tiles = kernels.default_blocks((q.shape[0], q_len) + tuple(q.shape[2:]),
                                       (k.shape[0], kv_len) + tuple(k.shape[2:]), q.dtype, device, n=n)
    bwd_blocks = None  # the backward's own defaults, when the caller names no tiles at all
    if block_q is None and block_kv is None and kernels.default_bwd_blocks is not None:
        bwd_blocks = kernels.default_bwd_blocks((q.shape[0], q_len) + tuple(q.shape[2:]),
                                                (k.shape[0], kv_len) + tuple(k.shape[2:]), q.dtype, device)
    if block_q is None:
        block_q = default_block(q_len) if tiles is None else tiles[0]
    if block_kv is None:
        block_kv = default_block(kv_len) if tiles is None else tiles[1]
    block_q = val.check_block(block_q, q_len, "block_q")
    block_kv = val.check_block(block_kv, kv_len, "block_kv")
    hop = HopConfig(scale=scale, causal=causal, window=window, block_q=block_q, block_kv=block_kv,
                    dropout_rate=dropout_rate, logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn,
                    bwd_blocks=None if bwd_blocks is None or tuple(bwd_blocks) == (block_q, block_kv) else tuple(bwd_blocks))
    # the fused ring schedules its own hops; the per-hop kernels skip the hops, the XLA hop the tiles too
    static = (impl != "pallas_tpu_fused" and not has_positions and not has_segments and not strategy.q_whole
              and strategy.hop_factor == 1)  # the hybrid's hops hold a group's tokens: no table for them
    spec = block_mask.spec_for(mask_fn=mask_fn if static else None, layout=layout, n=n, t=s_local * n,
                               s=kv_local * n, q_offset=q_offset, block_q=block_q, block_kv=block_kv,
                               heads=q.shape[2], causal=causal, window=window, whole_kv=strategy.kv_whole)
    cfg = RingConfig(axis_name, hop, impl, bias_mode, skip_empty_hops=kernels.skip_empty_hops,
                     comm_dtype=comm_dtype, grad_comm_dtype=grad_comm_dtype, block_mask=spec)
    return Settings(cfg, layout, padding_segment, has_positions, q_offset)


def check_shard_call(strategy, q, k, v, *, axis_name, segment_ids=None, bias=None, positions=None,
                     padding_segment=None, layout="contiguous", dropout_key=None, dropout_offsets=(0, 0),
                     sinks=None, kv_segment_ids=None, kv_positions=None, **settings):
    """Validate a per-host call (``*_attention_shard``): ``(Settings, Dropout | None)``.

    Shapes are this host's: q [b, sq, h, d], k [b, sk, kv_heads, d], v [b, sk, kv_heads, d_v] (``sk != sq``:
    cross-attention, each side sharded on its own), segment_ids and positions [b, sq], kv_segment_ids and
    kv_positions [b, sk] (default: the queries' when ``sk == sq``), bias per host (:func:`bias_mode`).
    ``settings``: the keywords of :func:`check_settings` that the caller passes through (causal, window,
    scale, blocks, impl, ...).
    """
    b, sq, sk, h, hk, _, _ = val.check_attention_shapes(q, k, v)
    n = axis_size(axis_name, strategy)
    if strategy.check_heads is not None:
        strategy.check_heads(h, hk, n, axis_name)
    seg = val.check_segment_ids(segment_ids, b, sq)
    kv_seg = check_kv_segment_ids(kv_segment_ids, seg, b, sq, sk)
    padding_segment = padding.check_padding_segment(padding_segment, seg)
    layout = check_cross_layout(layout, sq * n, sk * n)
    for length in {sq, sk}:
        val.check_n_hosts(n, length * n, layout, name=f"the size of mesh axis {axis_name!r}")
    mode = bias_mode(bias, b, h, sq, n, sk)
    if bias is not None and not val.is_float_dtype(bias.dtype):
        raise ValueError(f"bias must be a floating-point array; got dtype {bias.dtype}")
    val.check_positions(positions, b, sq)
    val.check_positions(kv_positions, b, sk, "kv_positions")
    laid_out = positions is None and kv_positions is None
    out = check_settings(strategy, q, k, v, n=n, s_local=sq, kv_local=sk, axis_name=axis_name, layout=layout,
                         window_seq=sk * n if laid_out and sq <= sk else None,
                         device=current_device(), bias_mode=mode, q_offset=(sk - sq) * n, has_segments=seg is not None,
                         padding_segment=padding_segment, has_positions=not laid_out,
                         dropout_key=dropout_key, sinks=sinks, **settings)
    drop = None
    if out.cfg.hop.dropout_rate > 0:
        drop = Dropout(dropout_seed(dropout_key), *(jnp.asarray(x).astype(jnp.uint32) for x in dropout_offsets))
    return out, drop


def check_kv_segment_ids(kv_segment_ids, segment_ids, batch, t, s):
    """The keys' segment ids of a cross-attention (``t != s``): needed with ``segment_ids``, and only then."""
    if kv_segment_ids is None:
        if segment_ids is not None and t != s:
            raise ValueError(f"segment_ids has the queries' length t = {t}; with keys of another length s = {s} "
                             f"pass kv_segment_ids [batch, s] too")
        return None
    if segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too")
    return val.check_segment_ids(kv_segment_ids, batch, s, "kv_segment_ids")


def check_cross_layout(layout, t, s):
    """``layout`` for queries of length t and keys of length s: a name lays out each on its own; a
    permutation needs ``t == s`` (one sequence)."""
    if t != s and not isinstance(layout, str):
        raise ValueError(f"layout: a permutation orders one sequence, but the queries (t = {t}) and keys "
                         f"(s = {s}) differ in length; use a layout name, which lays out each on its own")
    return val.check_layout(layout, t)


def check_user_fns(mask_fn, score_fn, heads):
    """``mask_fn`` / ``score_fn`` (``ringattn_ref.variants``), traced once on a small grid: jit-traceable,
    elementwise in the (query, key) pairs (`elementwise.first_cross_pair_op`: no reduction, cumulative
    op, sort or cross-pair read), a bool mask that broadcasts to [b, heads, q, k], floating-point scores
    of the logits' shape; else a ValueError naming the function, what was found and the shapes it was
    called with."""
    i32 = jnp.int32
    grid = (jax.ShapeDtypeStruct((1, 1, 2, 1), i32), jax.ShapeDtypeStruct((1, 1, 1, 3), i32))
    head, need = jax.ShapeDtypeStruct((1, heads, 1, 1), i32), (1, heads, 2, 3)
    shapes = lambda *xs: ", ".join(str(x.shape) for x in xs)  # noqa: E731
    for name, fn, args in (("mask_fn", mask_fn, grid + grid + (head,)),
                           ("score_fn", score_fn, (jax.ShapeDtypeStruct(need, jnp.float32),) + grid + (head,))):
        if fn is None:
            continue
        if not callable(fn):
            raise ValueError(f"{name} must be a function; got {fn!r}")
        try:
            closed, out = jax.make_jaxpr(fn, return_shape=True)(*args)
        except Exception as e:  # noqa: BLE001 - the user's function: say how it was called
            hint = (" (numpy functions cannot take the traced positions or scores: write them with jax.numpy; "
                    "indexing a numpy table by positions, table[k_pos], is fine)"
                    if type(e).__name__ == "TracerArrayConversionError" else "")
            raise ValueError(f"{name} is not traceable by jax (it must use array operations only): "
                             f"{type(e).__name__}: {e}; called with arrays of shapes {shapes(*args)}{hint}") from e
        mixing = first_cross_pair_op(closed.jaxpr)
        if mixing is not None:
            raise ValueError(f"{name} must be elementwise in the (query, key) pairs (it is evaluated per tile, so "
                             f"a value that depends on other pairs would see a tile, not the row); found "
                             f"{mixing!r} applied to its arguments (an operation that mixes pairs, or one not on "
                             f"the list of elementwise ones: ringattn_fast.elementwise.ELEMENTWISE). Reductions, "
                             f"cumulative ops, sorts, matmuls and slices or gathers across pairs are refused; a "
                             f"constant table indexed by positions is fine")
        dtype, shape = getattr(out, "dtype", type(out)), tuple(getattr(out, "shape", ()))
        if name == "score_fn" and not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"score_fn must return floating-point logits of the shape of s, {need}; got "
                             f"{dtype} {shape} from arrays of shapes {shapes(*args)}")
        if name == "mask_fn" and (dtype != jnp.bool_ or not val.broadcasts_to(shape, need)):
            raise ValueError(f"mask_fn must return a bool array that broadcasts to {need}; got {dtype} {shape} "
                             f"from arrays of shapes {shapes(*args)}")
        if name == "score_fn" and shape != need:
            raise ValueError(f"score_fn must return the shape of s, {need}; got {dtype} {shape} from arrays of "
                             f"shapes {shapes(*args)}")


def finish(o, lse, *, sinks, return_lse):
    """A strategy's ``(o, lse)`` as its public function returns it: sinks added (``softmax.add_sinks``)."""
    if sinks is not None:
        o, lse = add_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o


def int32_positions(positions, q, axis_name):
    """``(positions as int32, q)``; a traced position outside ``[0, 2**31)`` (possible only in a wider
    dtype: int64 under x64, uint32) makes ``q`` all-NaN on every host of the axis, so every row that
    sees a key is NaN: a cast would wrap ``2**32 + 5`` to ``5`` and give silently wrong output, and
    which rows a wrapped key would have reached cannot be known (one ``pmax`` of a flag, only then)."""
    if not val.is_wide_int(positions.dtype) or val.concrete_values(positions) is not None:
        return positions.astype(jnp.int32), q  # int32 (or checked by value): nothing can wrap
    bad = ((positions < 0) | (positions > val.INT32_MAX)).any().astype(jnp.int32)
    bad = lax.pmax(vary_like(bad, (axis_name,)), axis_name) > 0  # another host's key may be the one that wrapped
    return positions.astype(jnp.int32), jnp.where(bad, jnp.nan, q).astype(q.dtype)


def host_inputs(settings, q, k, v, *, segment_ids=None, bias=None, positions=None, drop=None, kv_segment_ids=None,
                kv_positions=None, head_offset=None):
    """One host's :class:`HostInputs` from validated ``settings`` and its shards (no checks here).

    Positions are the caller's or the layout's (``schedule.local_positions``; the queries' shifted by
    ``settings.q_offset``), the keys' their own for cross-attention and the queries' otherwise; every
    array is cast to vary over the same mesh axes (``shard_map(check_vma=True)``); the padding segment's
    queries get the id no key has (``padding.padding_queries``).
    """
    cfg = settings.cfg
    b, sq = q.shape[:2]
    sk = k.shape[1]
    if positions is None:
        pos = local_positions(settings.layout, sq, cfg.axis_name, b) + jnp.int32(settings.q_offset)
    else:
        pos, q = int32_positions(positions, q, cfg.axis_name)
    if kv_positions is not None:
        kv_pos, k = int32_positions(kv_positions, k, cfg.axis_name)  # a wrapped key position: NaN, as for q
    elif sq == sk:
        kv_pos = pos  # one sequence (q_offset is 0)
    else:
        kv_pos = local_positions(settings.layout, sk, cfg.axis_name, b)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    kv_seg = seg if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    names = (cfg.axis_name,) if isinstance(cfg.axis_name, str) else tuple(cfg.axis_name)  # the hybrid: two
    axes = tuple(sorted(set(varying_axes(q, k, v, seg, kv_seg, bias, pos, kv_pos) + names)))
    q, k, v, pos, kv_pos, seg, kv_seg, bias = vary_like((q, k, v, pos, kv_pos, seg, kv_seg, bias), axes)
    travels = cfg.bias_mode == "travel"
    k = padding.reserved_keys_bad(k, kv_seg, settings.padding_segment)  # a traced NO_KEY id: NaN, not seen silently
    qs = QShard(q, pos, None if seg is None else padding.padding_queries(seg, settings.padding_segment))
    kv = KVShard(k, v, kv_pos, kv_seg, bias if travels else None)
    return HostInputs(qs, kv, None if travels else bias, cfg, drop, head_offset)


_MAPPED = {}  # key of the static arguments -> the jitted shard_map (at most _MAPPED_MAX, oldest dropped)
_MAPPED_MAX = 256
_MAPPED_LOCK = threading.Lock()


def hashable(static):
    """The static arguments as a cache key, each by type and value (``True``, ``1`` and ``1.0`` are equal
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


def cached(key, build):
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


def _first_index(mesh_axes, local_size):
    """Global index of this host's first row along a dim split over ``mesh_axes`` (None: not split)."""
    if mesh_axes is None or mesh_axes == ():
        return 0
    return lax.axis_index(mesh_axes) * local_size


def on_mesh(strategy, q, k, v, *, mesh=None, axis_name="sp", causal=False, segment_ids=None, bias=None,
            window=None, scale=None, layout="contiguous", block_q=None, block_kv=None, impl="auto",
            padding_segment=None, return_lse=False, batch_axes=None, head_axis=None, dropout_rate=0.0,
            dropout_key=None, comm_dtype=None, grad_comm_dtype=None, sinks=None, logit_softcap=None, mask_fn=None,
            score_fn=None, kv_segment_ids=None):
    """``strategy`` on global q, k, v: validated here, sharded over ``mesh``, run per host, in true order.

    Arguments as ``ring_attention``'s. Returns [batch, t, heads, dim_v] in q's dtype, in true order
    (and lse [batch, heads, t] with ``return_lse``).
    """
    b, t, s, h, hk, _, _ = val.check_attention_shapes(q, k, v)
    return_lse = val.check_bool(return_lse, "return_lse")
    window = val.check_window(window, s if t <= s else None)  # the oracle's rule: keys 0..s-1, queries the last t
    padding_segment = padding.check_padding_segment(padding_segment, segment_ids)
    # traced ids are ranked (no value can wrap or hit a reserved id), known ones checked by value
    if kv_segment_ids is None:
        segment_ids, padding_segment = padding.rank_segment_ids(segment_ids, padding_segment)
    else:
        segment_ids, padding_segment, kv_segment_ids = padding.rank_segment_ids(segment_ids, padding_segment,
                                                                                kv_segment_ids)
    segment_ids = val.check_segment_ids(segment_ids, b, t)
    kv_segment_ids = check_kv_segment_ids(kv_segment_ids, segment_ids, b, t, s)
    val.check_bias(bias, b, h, t, s)
    layout = check_cross_layout(layout, t, s)
    mesh = resolve_mesh(mesh)
    axes = check_mesh_axes(mesh, axis_name, batch=b, heads=h, kv_heads=hk, batch_axes=batch_axes,
                           head_axis=head_axis)
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    if strategy.check_heads is not None:
        strategy.check_heads(h // tp, hk // tp, axes.n, axis_name)
    n, t_ring, s_ring = axes.n, padding.ring_length(t, axes.n, layout), padding.ring_length(s, axes.n, layout)
    ring_bias = None if bias is None else jax.ShapeDtypeStruct(
        padding.padded_bias_shape(bias.shape, t, t_ring, s, s_ring), bias.dtype)
    settings = check_settings(strategy, q, k, v, n=n, s_local=t_ring // n, kv_local=s_ring // n, q_offset=s - t,
                              axis_name=axis_name, causal=causal, window=window, window_seq=s if t <= s else None,
                              scale=scale, layout=padding.pad_layout(layout, t, t_ring),
                              block_q=block_q, block_kv=block_kv, impl=impl, device=mesh_device(mesh),
                              bias_mode=bias_mode(ring_bias, b, h, t_ring, 1, s_ring),
                              padding_segment=padding_segment, comm_dtype=comm_dtype,
                              grad_comm_dtype=grad_comm_dtype, dropout_rate=dropout_rate, dropout_key=dropout_key,
                              logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn, sinks=sinks,
                              has_segments=segment_ids is not None, heads_split=tp > 1)
    seed = dropout_seed(dropout_key) if settings.cfg.hop.dropout_rate > 0 else None
    run = partial(_run, _Call(strategy, settings, auto_mesh(mesh), axes, return_lse))
    qb, qseq, qh, _ = spec_of(q, 4)
    out_specs = (jax.P(qb, qseq, qh, None), jax.P(qb, qh, qseq)) if return_lse else jax.P(qb, qseq, qh, None)
    arrays = dict(q=q, k=k, v=v, segment_ids=segment_ids, bias=bias, seed=seed, sinks=sinks,
                  kv_segment_ids=kv_segment_ids)
    return call_auto(mesh, run, arrays, out_specs=out_specs)


class _Call(NamedTuple):
    """The static half of a validated global call: what :func:`_run` needs besides the arrays."""
    strategy: Strategy
    settings: Settings
    mesh: object
    axes: object
    return_lse: bool


def _run(call, arrays):
    """The global computation of :func:`on_mesh` on validated arguments: pad, permute, shard, attend.
    arrays: q, k, v, segment_ids, bias, the dropout seed and sinks (each but q, k, v may be None)."""
    strategy, settings, mesh, axes, return_lse = call
    q, k, v, segment_ids, bias, seed = (arrays[name] for name in ("q", "k", "v", "segment_ids", "bias", "seed"))
    n, layout = axes.n, settings.layout
    padded = padding.pad_for_ring(q, k, v, n_hosts=n, layout=layout, segment_ids=segment_ids, bias=bias,
                                  padding_segment=settings.padding_segment, kv_segment_ids=arrays["kv_segment_ids"])
    settings = dataclasses.replace(settings, padding_segment=padded.padding_segment)
    perm = partial(permute_axis, layout=layout, n_hosts=n)
    args = {"q": perm(padded.q), "k": perm(padded.k), "v": perm(padded.v)}
    specs = {name: axes.spec("batch", "seq", "heads", None) for name in args}
    if padded.segment_ids is not None:
        args["segment_ids"] = perm(jnp.asarray(padded.segment_ids).astype(jnp.int32))
        specs["segment_ids"] = axes.spec("batch", "seq")
    if padded.kv_segment_ids is not None:  # cross-attention: the keys' own ids
        args["kv_segment_ids"] = perm(jnp.asarray(padded.kv_segment_ids).astype(jnp.int32))
        specs["kv_segment_ids"] = axes.spec("batch", "seq")
    if padded.bias is not None:  # sharded as the ring shards it: rows by host, a key-only bias by keys
        pb = padded.bias
        rows = "seq" if pb.shape[2] > 1 else None
        cols = "seq" if settings.cfg.bias_mode == "travel" else None
        args["bias"] = perm(pb, axis=2) if rows else pb
        args["bias"] = perm(args["bias"], axis=3) if pb.shape[3] > 1 else args["bias"]
        specs["bias"] = axes.spec("batch" if pb.shape[0] > 1 else None, "heads" if pb.shape[1] > 1 else None,
                                  rows, cols)
    if seed is not None:  # the key is replicated; each host adds the global index of its first batch row and head
        args["seed"], specs["seed"] = seed, jax.P()
    names = tuple(args)

    def build():
        def per_host(*xs):
            kw = dict(zip(names, xs))
            seed_ = kw.pop("seed", None)
            drop = None
            if seed_ is not None:
                b_local, h_local = kw["q"].shape[0], kw["q"].shape[2]
                offsets = (_first_index(axes.batch, b_local), _first_index(axes.heads, h_local))
                drop = Dropout(seed_, *(jnp.asarray(x).astype(jnp.uint32) for x in offsets))
            first_head = None
            if axes.heads and (settings.cfg.hop.mask_fn is not None or settings.cfg.hop.score_fn is not None):
                first_head = jnp.asarray(_first_index(axes.heads, kw["q"].shape[2]), jnp.int32)
            return strategy.attend(host_inputs(settings, **kw, drop=drop, head_offset=first_head))

        return jax.jit(jax.shard_map(per_host, mesh=mesh, in_specs=tuple(specs[k_] for k_ in names),
                                     out_specs=(specs["q"], axes.spec("batch", "heads", "seq"))))

    static = dataclasses.asdict(settings) | {"layout": layout}
    key = (strategy, mesh, axes, names, tuple(specs.items()), hashable(_flat(static)))
    o, lse = cached(key, build)(*(args[k_] for k_ in names))
    o = padded.unpad(permute_axis(o, layout, n, inverse=True))
    if not return_lse and arrays["sinks"] is None:
        return o  # eager calls run this outside jit: no lse permutation nobody reads
    lse = padded.unpad(permute_axis(lse, layout, n, axis=2, inverse=True), axis=2)
    return finish(o, lse, sinks=arrays["sinks"], return_lse=return_lse)


def _flat(d, prefix=""):
    """A nested dict (``dataclasses.asdict``) as one level: ``{"cfg.hop.scale": 0.25, ...}``."""
    out = {}
    for k_, x in d.items():
        if isinstance(x, dict):
            out.update(_flat(x, f"{prefix}{k_}."))
        else:
            out[prefix + k_] = x
    return out
