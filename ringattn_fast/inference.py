"""Inference on a mesh: ring prefill into a sequence-sharded KV cache, then decode against it.

Mirrors ``ringattn_ref.inference`` (read its docstring first). The cache is a pytree
(:class:`KVCache`): K/V ``[batch, max_seq, kv_heads, dim]`` sharded ``P(data, sp)`` (the batch on
``"data"`` when the mesh has it), per-row ``lengths`` and ``overflow`` flags. Positions map to hosts
round-robin: position ``p`` lives on host ``p % N``, slot ``p // N``, so the global array is in the
striped layout (host ``r``'s shard = its slots). Every call is jit-able with the cache donated:
``jax.jit(partial(decode_step, mesh=mesh), donate_argnums=3)``; the new cache reuses the buffers.

- :func:`prefill`: the prompt is sharded striped (host ``r`` keeps prompt tokens ``r, r + N, ...``).
  Writing: the prompt's K/V chunk travels once around the ring (``N - 1`` ppermutes of ``m / N``
  tokens); at step ``s`` host ``r`` holds the chunk of host ``(r - s) % N`` and stores it for the rows
  whose length ``L`` has ``L % N == s`` (those are exactly the rows whose new tokens it owns).
  Attention: ``ring.ring_forward`` (the training ring, forward only) of the prompt queries against
  the cache shards, causal by true positions; empty slots and padding queries are masked with segment
  ids, as in the ref. The ring moves whole shards (``max_seq / N`` slots each), filled or not: a short
  prompt into a large, mostly empty cache pays for the empty slots (a ring that moves the prompt's
  queries and partial results instead would not; not done here).
- :func:`decode_step`: the new token's K/V is scattered into the shard of host ``L % N``; every host
  attends its own shard (:func:`attend_shard`, one query row) to a partial ``(o, lse)``; the partials are
  combined with **two all-reduces per token, whatever N**: ``pmax(lse)`` gives the global max ``M`` (so
  no ``exp`` overflows), then one ``psum`` of ``[exp(lse - M) o, exp(lse - M)]`` gives numerator and
  denominator of ``softmax.merge`` over all hosts at once. An all-reduce is a log-depth tree (or a
  bandwidth-optimal ring) inside the collective library, with ``b h (d + 1)`` floats per host; rotating
  the cache instead would cost ``N - 1`` ppermutes of ``S / N`` keys each.

Programmable attention (``docs/design.md``): both take ``logit_softcap``, ``sinks`` [heads], ``mask_fn``
and ``score_fn`` with ``ringattn_ref.inference``'s meaning (true positions: a decode step's query sits at
the row's length so far, a slot's key at its own position; segment ids 0 for the user functions), and
the cache may hold values of a width of their own (``init_cache(value_dim=)``, MLA). Prefill runs them
in the ring's XLA hop; decode in :func:`attend_shard`; sinks join after the merge across hosts
(``softmax.add_sinks`` on the merged ``(o, lse)``).

Errors. Shapes, dtypes, the mesh and anything whose values are concrete (``lengths`` or the cache
outside ``jit``) raise ``ValueError`` before anything runs, so the cache is untouched. Under ``jit``
the values of ``lengths`` and ``cache.lengths`` are traced: a row whose prompt length is outside
``[0, m]``, whose prompt does not fit in the room left, or that is full at a decode step is **not
written at all** (its K/V slots and its length stay as they were), ``cache.overflow[row]`` is set (it
stays set), and that row's output is NaN. No write ever lands past ``max_seq`` or on a cached token:
out-of-range slots are dropped by the scatter (``mode="drop"``), never clamped.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringattn_ref import validation as val
from ringattn_ref.inference import EMPTY_SLOT, PADDING_QUERY, VALID
from ringattn_ref.shards import default_block

from . import masks
from .fn_keys import canonical
from .front import cached, check_user_fns, hashable
from .layouts import permute_axis
from .mesh import auto_mesh, call_auto, check_mesh_axes, resolve_mesh, spec_of, varying_axes, vary_like
from .ring import ring_forward
from .schedule import HopConfig, KVShard, QShard, RingConfig, ring_loop, send_to_next
from .softmax import acc_dtype, add_sinks


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths", "overflow"],
         meta_fields=["n_hosts", "axis_name", "mesh"])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k: [batch, max_seq, kv_heads, dim], v: [batch, max_seq, kv_heads, value_dim], global index
    ``r * max_seq / N + i`` = position ``i * N + r`` (striped), sharded ``P(data, axis_name)``; lengths:
    int32 [batch]; overflow: bool [batch], True once a traced request did not fit (see the module
    docstring). n_hosts, axis_name and the mesh the cache lives on: static (``prefill`` / ``decode_step``
    with ``mesh=None`` use it)."""
    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    overflow: jax.Array
    n_hosts: int
    axis_name: str
    mesh: object = None

    max_seq = property(lambda self: self.k.shape[1])


def _specs(mesh, axis_name, batch, heads, kv_heads):
    axes = check_mesh_axes(mesh, axis_name, batch=batch, heads=heads, kv_heads=kv_heads)
    return axes, axes.spec("batch", "seq", None, None), axes.spec("batch")


def init_cache(batch, max_seq, kv_heads, dim, *, mesh=None, axis_name="sp", dtype=jnp.float32, value_dim=None):
    """An empty cache on ``mesh`` (zeros, lengths 0), ``max_seq`` divisible by the ring size; values
    ``value_dim`` wide (default ``dim``; MLA's ``d_v != d``)."""
    value_dim = dim if value_dim is None else value_dim
    for x, name in ((batch, "batch"), (max_seq, "max_seq"), (kv_heads, "kv_heads"), (dim, "dim"),
                    (value_dim, "value_dim")):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be a positive int; got {x!r}")
    mesh = resolve_mesh(mesh)
    axes, kv_spec, row_spec = _specs(mesh, axis_name, batch, kv_heads, kv_heads)
    if max_seq % axes.n:
        raise ValueError(f"max_seq ({max_seq}) must be divisible by the size of mesh axis {axis_name!r} "
                         f"({axes.n}): every host holds max_seq / {axes.n} slots")
    try:  # every spelling: np.float32, jnp.bfloat16, "float32", np.dtype(...), jnp.dtype(...)
        cache_dtype = jnp.dtype(dtype)
    except TypeError:
        cache_dtype = None
    if cache_dtype is None or not val.is_float_dtype(cache_dtype):
        raise ValueError(f"dtype must be a floating-point dtype (the cache holds K and V); got {dtype!r}")
    zeros = _zeros_on_mesh(mesh, kv_spec, row_spec, (batch, max_seq, kv_heads), (dim, value_dim), cache_dtype)()
    return KVCache(*zeros, n_hosts=axes.n, axis_name=axis_name, mesh=mesh)


@lru_cache(maxsize=64)
def _zeros_on_mesh(mesh, kv_spec, row_spec, shape, widths, dtype):
    """A jitted function making an empty cache's arrays on ``mesh`` (one compile per configuration):
    K and V ``shape + (width,)`` for their two widths, lengths and overflow ``[shape[0]]``."""
    shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    return jax.jit(lambda: tuple(jnp.zeros(shape + (w,), dtype) for w in widths) +
                   (jnp.zeros(shape[0], jnp.int32), jnp.zeros(shape[0], bool)),
                   out_shardings=(shard(kv_spec),) * 2 + (shard(row_spec),) * 2)


def _check(q, k, v, cache, mesh):
    """Trace-time checks (shapes, mesh); returns ``(mesh, axes, b, m, h)``."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache from ringattn_fast.inference.init_cache; got "
                         f"{type(cache).__name__}")
    b, m, h, hk, d = val.check_qkv(q, k, v, value_width=True)
    bc, _, hkc, dc = cache.k.shape
    if b != bc:
        raise ValueError(f"q, k, v must have the cache's batch {bc}; got q {tuple(q.shape)}")
    if (hk, d) != (hkc, dc):
        raise ValueError(f"k/v must have the cache's kv_heads = {hkc} and dim = {dc}; got k {tuple(k.shape)}")
    if v.shape[3] != cache.v.shape[3]:
        raise ValueError(f"v must have the cache's value_dim = {cache.v.shape[3]} (init_cache(value_dim=)); got v "
                         f"{tuple(v.shape)}")
    if mesh is not None and cache.mesh is not None and mesh != cache.mesh:
        raise ValueError(f"mesh must be the mesh the cache lives on (init_cache's), or None to use it; got "
                         f"{mesh}, the cache is on {cache.mesh}")
    mesh = resolve_mesh(cache.mesh if mesh is None else mesh)
    axes = check_mesh_axes(mesh, cache.axis_name, batch=b, heads=h, kv_heads=hk)
    if axes.n != cache.n_hosts:
        raise ValueError(f"mesh axis {cache.axis_name!r} has size {axes.n} but the cache was made for "
                         f"{cache.n_hosts} hosts")
    return mesh, axes, b, m, h


def _check_variants(heads, *, logit_softcap, sinks, mask_fn, score_fn):
    """The programmable-attention keywords, checked as the ring checks them (a ValueError naming the
    argument); returns ``(static settings, sinks)``: the settings are the hop's, sinks an array or None."""
    logit_softcap = val.check_softcap(logit_softcap)
    if val.check_sinks(sinks, heads) is not None:
        sinks = jnp.asarray(sinks)
    mask_fn, score_fn = canonical(mask_fn), canonical(score_fn)  # numpy closures made traceable, shared programs
    check_user_fns(mask_fn, score_fn, heads)
    return dict(logit_softcap=logit_softcap, mask_fn=mask_fn, score_fn=score_fn), sinks


def _check_lengths(lengths, m):
    """``lengths`` values outside [0, m], when they are known now (not traced)."""
    values = val.concrete_values(lengths)
    if values is not None and (values.min() < 0 or values.max() > m):
        raise ValueError(f"lengths must lie in [0, m = {m}]; got {values.tolist()}")


def _check_room(cache, need, what):
    """A row without room for ``need[row]`` more tokens, when the cache's lengths are known now."""
    held, need = val.concrete_values(cache.lengths), val.concrete_values(need)
    if held is None or need is None:
        return
    room = cache.max_seq - held.astype(np.int64)
    if (need > room).any():
        row = int(np.argmax(need > room))
        raise ValueError(f"{what} of row {row} ({need[row]} tokens) does not fit: the row holds {held[row]} of "
                         f"max_seq = {cache.max_seq} tokens ({room[row]} free)")


def int32_lengths(lengths, m):
    """``lengths`` as int32 without wrapping: a value of a wider dtype outside ``[0, m]`` becomes ``m + 1``
    *before* the cast, so its row overflows (flag set, NaN output, nothing stored); a plain cast would
    turn a traced int64 ``2**32 + 3`` into 3 and store 3 tokens."""
    if not val.is_wide_int(lengths.dtype):
        return lengths.astype(jnp.int32)  # every value fits; _prefill_shard checks the range
    ok = (lengths >= 0) & (lengths <= m)
    return jnp.where(ok, lengths.astype(jnp.int32), m + 1)


def _slots(n, r, c, batch):
    """True positions of host ``r``'s slots, int32 [batch, c]: ``i * n + r``."""
    return jnp.broadcast_to((jnp.arange(c, dtype=jnp.int32) * n + r)[None], (batch, c))


def _store(ck, cv, k, v, ok, slot):
    """Scatter new K/V [b, t, hk, d] at ``slot`` [b, t] where ``ok`` [b, t] (the rest is dropped).

    Keys holding a nan/inf are stored marked (``masks.mark_bad_keys``: K all-NaN, V 0), so reading the
    cache needs no finiteness pass. The optimization barrier makes XLA materialise the updated shard
    before it is read: without it, the reads fused the old buffer with the update and kept both, so
    every step copied the whole shard (measured: 4 shard copies per decode step at 64K).
    """
    c = ck.shape[1]
    slot = jnp.where(ok, slot, c)  # c is out of range: mode="drop" discards it (never clamps)
    rows = jnp.arange(ck.shape[0])[:, None]
    k, v = masks.mark_bad_keys(k, v)
    ck = ck.at[rows, slot].set(k.astype(ck.dtype), mode="drop")
    cv = cv.at[rows, slot].set(v.astype(cv.dtype), mode="drop")
    return lax.optimization_barrier((ck, cv))


def _prefill_shard(q, k, v, ck, cv, held, overflow, counts, sinks, *, axis_name, m, scale, window, **variants):
    """One host: write its rows' new tokens during one trip of the prompt K/V, then the ring (then the
    sinks, None or [heads], replicated). variants: ``HopConfig``'s logit_softcap, mask_fn, score_fn."""
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, mc, h, d = q.shape  # mc = m_pad / n prompt tokens on this host: indices r, r + n, ...
    c = ck.shape[1]
    ok = (counts >= 0) & (counts <= m) & (held + counts <= c * n)  # (b,): traced facts
    counts = jnp.where(ok, counts, 0)
    t = jnp.arange(mc, dtype=jnp.int32)[None]  # (1, mc)

    def write(step, chunk, ck, cv):  # chunk: the prompt K/V of host src = (r - step) % n
        src = (r - step) % n
        mine = (held % n == step)[:, None] & (src + n * t < counts[:, None])  # (b, mc)
        slot = (held[:, None] + src) // n + t  # position held + src + n t lives in slot (held + src) // n + t
        return _store(ck, cv, chunk[0], chunk[1], mine, slot)

    def step_fn(carry, step):
        chunk, ck, cv = carry
        chunk_next = send_to_next(chunk, axis_name)
        return (chunk_next,) + write(step, chunk, ck, cv)

    chunk, ck, cv = ring_loop(step_fn, ((k, v), ck, cv), n)
    ck, cv = write(n - 1, chunk, ck, cv)
    new_len = held + counts
    q_pos = held[:, None] + r + n * t  # (b, mc) true positions of this host's queries
    qs = QShard(q, q_pos, jnp.where(r + n * t < counts[:, None], VALID, PADDING_QUERY).astype(jnp.int32))
    k_pos = _slots(n, r, c, b)
    kv = KVShard(ck, cv, k_pos, jnp.where(k_pos < new_len[:, None], VALID, EMPTY_SLOT).astype(jnp.int32))
    axes = tuple(sorted(set(varying_axes(*qs, *kv) + (axis_name,))))
    qs, kv = vary_like((qs, kv), axes)
    hop = HopConfig(scale=scale, causal=True, window=window, block_q=default_block(mc), block_kv=default_block(c),
                    **variants)
    o, lse = ring_forward(RingConfig(axis_name, hop), qs, kv, None)  # o [b, mc, h, d_v]
    if sinks is not None:
        o, _ = add_sinks(o, lse, sinks)
    o = jnp.where(ok[:, None, None, None], o, jnp.nan).astype(q.dtype)
    return o, ck, cv, new_len, overflow | ~ok


def prefill(q, k, v, cache, *, lengths=None, window=None, scale=None, logit_softcap=None, sinks=None, mask_fn=None,
            score_fn=None, mesh=None):
    """Write a prompt into the sharded cache and attend to it (the ring); ``ringattn_ref.prefill``'s twin.

    q: [batch, m, heads, dim]; k: [batch, m, kv_heads, dim]; v: [batch, m, kv_heads, value_dim]; lengths:
    int [batch] in [0, m] (default m), tokens past it are padding (not cached, output 0); under ``jit`` a
    row whose traced length is outside [0, m], in any int dtype, overflows (module docstring).
    logit_softcap, sinks [heads], mask_fn, score_fn: as :func:`~ringattn_fast.ring_attention`, positions
    true (module docstring). Returns ``(o [batch, m, heads, value_dim] in q's dtype, new cache)``. Any m
    (padded inside to a multiple of the ring size).
    """
    mesh, axes, b, m, h = _check(q, k, v, cache, mesh)
    scale, window = val.check_scale(scale, q.shape[-1]), val.check_window(window)
    variants, sinks = _check_variants(h, logit_softcap=logit_softcap, sinks=sinks, mask_fn=mask_fn,
                                      score_fn=score_fn)
    if lengths is None:
        lengths = jnp.full((b,), m, jnp.int32)
    elif not hasattr(lengths, "shape"):  # a list or tuple of ints
        lengths = np.asarray(lengths)
    if tuple(lengths.shape) != (b,) or not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise ValueError(f"lengths must be an int array of shape [batch] = ({b},); got shape "
                         f"{tuple(lengths.shape)}, dtype {lengths.dtype}")
    _check_lengths(lengths, m)
    _check_room(cache, lengths, "q: the prompt")
    kv_spec, row_spec = axes.spec("batch", "seq", None, None), axes.spec("batch")
    static = dict(axis_name=cache.axis_name, m=m, scale=scale, window=window, **variants)

    def run(q, k, v, ck, cv, held, overflow, lengths, sinks):
        n = axes.n
        striped = lambda x: permute_axis(jnp.pad(x, ((0, 0), (0, -m % n), (0, 0), (0, 0))), "striped", n)  # noqa: E731
        build = lambda: jax.jit(jax.shard_map(  # noqa: E731
            partial(_prefill_shard, **static), mesh=auto_mesh(mesh),
            in_specs=(kv_spec,) * 5 + (row_spec,) * 3 + (jax.P(),), out_specs=(kv_spec,) * 3 + (row_spec,) * 2))
        per_host = cached(("prefill", auto_mesh(mesh), axes, sinks is None, hashable(static)), build)
        o, *new = per_host(striped(q), striped(k), striped(v), ck, cv, held, overflow, int32_lengths(lengths, m), sinks)
        return (permute_axis(o, "striped", n, inverse=True)[:, :m], *new)

    out_specs = (jax.P(*spec_of(q, 4)),) + (kv_spec,) * 2 + (row_spec,) * 2
    o, ck, cv, new_len, overflow = call_auto(mesh, run, q, k, v, cache.k, cache.v, cache.lengths, cache.overflow,
                                             lengths, sinks, out_specs=out_specs)
    return o, dataclasses.replace(cache, k=ck, v=cv, lengths=new_len, overflow=overflow)


def merge_across(o, lse, axis_name):
    """``softmax.merge`` of every host's ``(o [b, 1, h, d], lse [b, h, 1])`` with one pmax and one psum:
    the merged ``(o, lse)``, the same on every host (lse -inf for a row no host saw)."""
    top = lax.pmax(lse, axis_name)  # (b, h, 1) the global max: every exp below is <= 1
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)  # 0 for a host that saw nothing
    w_o = jnp.einsum("bhs->bsh", w)[..., None]  # (b, 1, h, 1)
    both = lax.psum(jnp.concatenate([w_o * o, w_o], axis=-1), axis_name)  # one all-reduce: [num, den]
    num, den = both[..., :-1], both[..., -1:]
    den_bhs = jnp.einsum("bsh->bhs", den[..., 0])  # (b, h, 1)
    lse = jnp.where(den_bhs == 0, -jnp.inf, top + jnp.log(jnp.where(den_bhs == 0, 1.0, den_bhs)))
    return num / jnp.where(den == 0, 1.0, den), lse


def attend_shard(q, k, v, ok, *, cfg, q_pos=None, k_pos=None):
    """One query row per example against this host's shard: ``(o [b, 1, h, d_v], lse [b, h, 1])``.

    q: [b, 1, h, d]; k: [b, c, hk, d], v: [b, c, hk, d_v] (the cache shard, in its own layout); ok: bool
    [b, c], the slots this query may see; cfg: a ``HopConfig`` (scale, logit_softcap, score_fn,
    mask_fn); q_pos int [b], k_pos int [b, c]: the true positions the user functions see.
    ``hop.hop_fwd``'s arithmetic for a single row, written as broadcast products summed over ``d`` and
    over the slots: XLA fuses each into one pass over the shard, where a batched matmul would first copy
    the shard into ``[b, hk, c, d]`` (measured on the dense twin in ``benchmarks/decode.py`` at 64K:
    206 ms per token with the copy, 33 ms without). Non-finite keys were marked when written
    (:func:`_store`: K all-NaN, V 0), so a seen one makes its row NaN and a masked one adds 0.
    """
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    acc = acc_dtype(q.dtype)
    qg = (q[:, 0].astype(acc) * cfg.scale).reshape(b, 1, hk, h // hk, d)  # (b, 1, hk, g, d)
    s = jnp.sum(k.astype(acc)[:, :, :, None, :] * qg, axis=-1)  # (b, c, hk, g) logits
    if cfg.logit_softcap is not None:  # Gemma 2, before the score function and the mask
        s = cfg.logit_softcap * jnp.tanh(s / cfg.logit_softcap)
    ok = ok[:, :, None, None]
    if cfg.score_fn is not None or cfg.mask_fn is not None:
        s, ok = _user_fns(s, ok, cfg, q_pos, k_pos)
    s = jnp.where(ok, s, -jnp.inf)
    m = s.max(axis=1)  # (b, hk, g)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[:, None])  # (b, c, hk, g); 0 where not seen
    l = p.sum(axis=1)
    o = jnp.sum(p[..., None] * v.astype(acc)[:, :, :, None, :], axis=1)  # (b, hk, g, d_v)
    o = (o / jnp.where(l == 0, 1.0, l)[..., None]).reshape(b, 1, h, dv)
    lse = jnp.where(l == 0, -jnp.inf, m_safe + jnp.log(jnp.where(l == 0, 1.0, l))).reshape(b, h, 1)
    return o, lse


def _user_fns(s, ok, cfg, q_pos, k_pos):
    """``cfg.score_fn`` and ``cfg.mask_fn`` (``ringattn_ref.variants``) on one query row's logits s [b, c, hk, g]
    and mask ok [b, c, 1, 1]: called in their own layout (s [b, h, 1, c], q_pos [b, 1, 1, 1], k_pos
    [b, 1, 1, c], segment ids 0, head [1, h, 1, 1]; query head ``kv_head * g + member``); returns
    ``(s, ok [b, c, hk, g])``."""
    b, c, hk, g = s.shape
    h = hk * g
    to_fn = lambda x: jnp.swapaxes(x.reshape(b, c, h), 1, 2)[:, :, None]  # noqa: E731  (b, c, hk, g) -> (b, h, 1, c)
    from_fn = lambda x: jnp.swapaxes(x[:, :, 0], 1, 2).reshape(b, c, hk, g)  # noqa: E731
    qp, kp = q_pos[:, None, None, None], k_pos[:, None, None, :]
    head = jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
    if cfg.score_fn is not None:
        s = from_fn(cfg.score_fn(to_fn(s), qp, kp, head).astype(s.dtype))
    if cfg.mask_fn is not None:
        allow = cfg.mask_fn(qp, kp, jnp.zeros_like(qp), jnp.zeros_like(kp), head)
        ok = ok & from_fn(jnp.broadcast_to(allow, (b, h, 1, c)))
    return s, ok


def _decode_shard(q, k, v, ck, cv, held, overflow, sinks, *, axis_name, window, **variants):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    b, c = q.shape[0], ck.shape[1]
    full = held >= c * n  # (b,): a full row is not written
    mine = (~full & (held % n == r))[:, None]  # (b, 1): this host owns position held
    ck, cv = _store(ck, cv, k, v, mine, (held // n)[:, None])
    new_len = held + ~full
    k_pos = _slots(n, r, c, b)
    ok = masks.allowed(held[:, None], k_pos, causal=True, window=window) & (k_pos < new_len[:, None])  # (b, c)
    o, lse = attend_shard(q, ck, cv, ok, cfg=HopConfig(causal=True, window=window, **variants), q_pos=held,
                          k_pos=k_pos)
    o, lse = merge_across(o, lse, axis_name)
    if sinks is not None:  # after the merge: the sink joins the denominator over every host's keys
        o, _ = add_sinks(o, lse, sinks)
    o = jnp.where(full[:, None, None, None], jnp.nan, o).astype(q.dtype)
    return o, ck, cv, new_len, overflow | full


def decode_step(q, k, v, cache, *, window=None, scale=None, logit_softcap=None, sinks=None, mask_fn=None,
                score_fn=None, mesh=None):
    """Append one token per row and attend it to the whole cached prefix; ``ringattn_ref.decode_step``'s twin.

    q: [batch, 1, heads, dim]; k: [batch, 1, kv_heads, dim]; v: [batch, 1, kv_heads, value_dim]. Local
    attention per host (:func:`attend_shard`), then :func:`merge_across` (2 all-reduces), then the sinks.
    The keywords are :func:`prefill`'s; the query's true position is the row's length so far. Returns
    ``(o [batch, 1, heads, value_dim] in q's dtype, new cache)``. Eager calls run one jitted program per
    static configuration.
    """
    mesh, axes, b, m, h = _check(q, k, v, cache, mesh)
    if m != 1:
        raise ValueError(f"q must hold exactly one token per row (m = 1) in decode_step; got shape "
                         f"{tuple(q.shape)}: use prefill for a prompt")
    scale, window = val.check_scale(scale, q.shape[-1]), val.check_window(window)
    variants, sinks = _check_variants(h, logit_softcap=logit_softcap, sinks=sinks, mask_fn=mask_fn,
                                      score_fn=score_fn)
    _check_room(cache, np.ones(b, np.int64), "cache: the decode step")
    kv_spec, row_spec, tok_spec = axes.spec("batch", "seq", None, None), axes.spec("batch"), axes.spec("batch")
    static = dict(axis_name=cache.axis_name, scale=scale, window=window, **variants)
    build = lambda: jax.jit(jax.shard_map(  # noqa: E731
        partial(_decode_shard, **static), mesh=auto_mesh(mesh),
        in_specs=(tok_spec,) * 3 + (kv_spec,) * 2 + (row_spec,) * 2 + (jax.P(),),
        out_specs=(tok_spec,) + (kv_spec,) * 2 + (row_spec,) * 2))
    per_host = cached(("decode", auto_mesh(mesh), axes, sinks is None, hashable(static)), build)
    out_specs = (jax.P(*spec_of(q, 4)),) + (kv_spec,) * 2 + (row_spec,) * 2
    o, ck, cv, new_len, overflow = call_auto(mesh, per_host, q, k, v, cache.k, cache.v, cache.lengths,
                                             cache.overflow, sinks, out_specs=out_specs)
    return o, dataclasses.replace(cache, k=ck, v=cv, lengths=new_len, overflow=overflow)
