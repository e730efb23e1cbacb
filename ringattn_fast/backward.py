"""The backward ring: the second ring that ``ring.py``'s ``custom_vjp`` runs for the gradients.

The forward saved only its inputs, ``o`` and ``lse``: ``O(S/N)`` per host. The backward recomputes
every tile FlashAttention-2 style (arXiv:2307.08691, Algorithm 2) with ``D = rowsum(dO * O)`` and
runs the ring again, as the authors' code does (arXiv:2310.01889): ``dQ`` stays on its host;
``dK, dV`` (float32/64 accumulators, and the gradient of a key-only bias) travel *with* their K/V
shard as :class:`KVGrads`.

Schedule ("delayed accumulators", issue 45): every send is issued at the top of a step and needs nothing
that step computes, so XLA can fly it under the hop's kernel (when the dK/dV send followed the hop's
kernel, the compiler sent K/V with it, after the kernel: no backward transfer overlapped,
``benchmarks/overlap.py``). At step ``step`` host ``i`` holds K/V shard ``i - step``; it sends them on
together with the accumulators it finished at the previous step (shard ``i - step + 1``), runs the hop,
then adds the hop's dK/dV to the accumulators of shard ``i - step`` that arrive from host ``i - 1``. The
own shard's hop (step 0) is split in two halves of query rows when its tiles allow
(:func:`row_halves`): the first half overlaps the first K/V send, the second the last dK/dV send, which
brings shard ``i``'s accumulators home from host ``i - 1``. Message count as before: K/V ``N - 1`` sends,
dK/dV ``N``; a token that visits all ``N`` hosts and returns needs ``N`` moves. K and V travel stacked as one
array, and so do dK and dV (one transfer each a step: with five XLA:TPU left some of them after the kernel).
Cost: one more dK/dV pair in flight (the one being sent while the next is received); docs/benchmarks.md,
"Does the compiled ring hide its transfers?", has the measured temp and peak bytes. ``ringattn_ref.backward``
keeps the simple order (the sums are the same; only the float32 rounding order of the own hop's two halves
differs).
Mirrors ``ringattn_ref.backward``.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax.numpy as jnp
from jax import lax

from . import block_mask, comm, masks
from .dispatch import kernels_for
from .mesh import varying_axes, vary_like
from .schedule import KVGrads, QShard, hop_kv, kv_index, ring_loop, send_to_next, single_hop
from .softmax import acc_dtype


def _rows(x, part, axis):
    """``x``'s query rows ``part`` (a slice) along ``axis``; ``x`` itself where it broadcasts over them (size 1),
    is None or ``part`` is None (all rows)."""
    if x is None or part is None or x.shape[axis] == 1:
        return x
    return lax.slice_in_dim(x, part.start, part.stop, axis=axis)


def _add_rows(acc, g, part, axis):
    """``acc + g`` with ``g`` holding only the query rows ``part`` of ``acc`` along ``axis`` (or all of them)."""
    if part is None or acc.shape[axis] == g.shape[axis]:
        return acc + g
    return acc.at[(slice(None),) * axis + (part,)].add(g)


def row_halves(cfg, sq):
    """The own hop's two halves of query rows, ``(slice(0, sq/2), slice(sq/2, sq))``, and the hop configuration
    they run with: the kernels' query tiles (``block_q``, the backward's own) cut to a divisor of ``sq/2`` where
    they do not divide it (a shard that is one tile: two tiles of half). None where the rows cannot be halved:
    ``sq`` odd, a block mask's tiles that do not divide ``sq/2``, or a query tile that would drop below 128
    rows (or below the tile asked for, if smaller)."""
    half = sq // 2
    if sq % 2 or (cfg.block_mask is not None and half % cfg.block_mask.block_q):
        return None

    def fit(b):
        f = b if half % b == 0 else math.gcd(b, half)
        return f if f >= min(b, 128) else None

    bwd = cfg.hop.bwd_blocks
    tiles = [fit(cfg.hop.block_q)] + ([fit(bwd[0])] if bwd is not None else [])
    if None in tiles:
        return None
    hop = dataclasses.replace(cfg.hop, block_q=tiles[0],
                              bwd_blocks=None if bwd is None else (tiles[1],) + tuple(bwd[1:]))
    return slice(0, half), slice(half, sq), hop


def _add_hop(cfg, hop_grads, *, grads, dq, dbias, kv_idx, rows=None):
    """Fold one hop's :class:`~ringattn_fast.schedule.HopGrads` into the accumulators: the travelling
    ``grads`` (:class:`~ringattn_fast.schedule.KVGrads`), this host's ``dq`` and its non-travelling
    ``dbias``; ``kv_idx``: the shard the hop attended (a "columns" bias's block); ``rows``: the query rows
    the hop computed (a slice, None: all)."""
    dbias_t = grads.dbias
    if cfg.bias_mode == "travel":
        dbias_t = dbias_t + hop_grads.dbias
    elif cfg.bias_mode == "columns":  # each block of key columns is visited once (the own block: in two halves)
        sk = hop_grads.dk.shape[1]
        block = lax.dynamic_slice_in_dim(dbias, kv_idx * sk, sk, axis=3)
        block = _add_rows(block, hop_grads.dbias.astype(dbias.dtype), rows, axis=2)
        dbias = lax.dynamic_update_slice_in_dim(dbias, block, kv_idx * sk, axis=3)
    elif cfg.bias_mode == "static":
        dbias = _add_rows(dbias, hop_grads.dbias, rows, axis=2)
    if grads.dv is None:  # packed (see ring_backward)
        grads = KVGrads(grads.dk + jnp.stack([hop_grads.dk, hop_grads.dv]).astype(grads.dk.dtype), None, dbias_t)
    else:
        grads = KVGrads(grads.dk + hop_grads.dk, grads.dv + hop_grads.dv, dbias_t)
    return grads, _add_rows(dq, hop_grads.dq, rows, axis=1), dbias


def ring_backward(cfg, qs, kv, bias, *, o, lse, do, dlse=None, drop=None, head_offset=None):
    """The backward ring on this host: ``(dq, KVGrads, dbias)`` in float32/64, dK/dV home.

    - qs, kv, bias: as given to ``ring.ring_forward``; o [b, sq, h, d] and lse [b, h, sq]: its
      results;
    - do: the output cotangent; dlse: the cotangent of lse or None (``d lse / d S = P``, so it only
      shifts FA-2's D: ``dS = P (dP - (D - dlse))``).

    drop: the forward's ``schedule.Dropout`` or None (the hops recompute the same mask); head_offset: as
    in ``ring.ring_forward``.
    dbias: the gradient of the non-travelling bias (or None). The gradients of a key that held a
    nan/inf are those of its marked K and V (unspecified: NaN where it was seen).
    """
    hop_bwd = kernels_for(cfg.impl).hop_bwd
    hop_bwd = hop_bwd if drop is None else partial(hop_bwd, drop=drop)
    n, my_idx = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    kv = masks.marked_for_ring(kv, cfg.impl, cfg.comm_dtype)  # as the forward did
    acc, kv_dtype = acc_dtype(qs.q.dtype), kv.k.dtype
    send_grads = partial(comm.sent_as, partial(send_to_next, axis_name=cfg.axis_name), dtype=cfg.grad_comm_dtype)
    skip = cfg.skip_empty_hops and (masks.can_be_empty(cfg.hop.causal, cfg.hop.window, qs.seg is not None)
                                    or cfg.block_mask is not None)
    axes = varying_axes(*qs, *kv, bias, o, lse, do)
    # FA-2's D, (b, h, sq): an elementwise product summed over d fuses into one pass over do and o (an
    # einsum became a batched matmul with float32 copies of both on TPU)
    delta = jnp.sum(do.astype(acc) * o.astype(acc), axis=-1).swapaxes(1, 2)
    if dlse is not None:
        delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(acc), 0.0)  # a row that saw nothing: no key
    if n == 1:  # one hop: its gradients are the gradients (no accumulators, no loop, no send)
        kv = comm.decode(comm.encode(kv, cfg.comm_dtype), kv_dtype)  # as the forward rounded it
        g = hop_bwd(qs, hop_kv(cfg, kv, bias, 0), single_hop(cfg.hop, qs.q.dtype), do=do, lse=lse, delta=delta,
                    **block_mask.hop_extras(cfg, my_idx, 0, head_offset))
        travels = cfg.bias_mode == "travel"
        return g.dq, KVGrads(g.dk, g.dv, g.dbias if travels else None), None if travels else g.dbias
    zeros = lambda x: None if x is None else jnp.zeros(x.shape, acc)  # noqa: E731
    # dK and dV travel stacked, [2, b, sk, hk, d], where their shapes agree: one transfer a step, as K/V
    # (``comm.encode(..., pack=True)``); dv None marks the packed form
    packed = kv.k.shape == kv.v.shape
    grads = KVGrads(jnp.zeros((2,) + kv.k.shape, acc), None, zeros(kv.bias)) if packed else \
        KVGrads(zeros(kv.k), zeros(kv.v), zeros(kv.bias))
    dq, dbias = zeros(qs.q), zeros(bias)  # both stay here

    def hop(step, kv, grads, dq, dbias, rows=None, hop_cfg=cfg.hop):
        """Add the hop of ``step`` (query ``rows`` only, if given, with ``hop_cfg``) to the accumulators."""
        kv_idx, kv = kv_index(my_idx, step, n), comm.decode(kv, kv_dtype)  # K/V travel as the forward's did
        q_part = QShard(*(_rows(x, rows, 1) for x in qs))
        extras = block_mask.hop_extras(cfg, my_idx, kv_idx, head_offset)
        if rows is not None and "tiles" in extras:  # the block mask's tiles of these rows
            bq = cfg.block_mask.block_q
            extras["tiles"] = extras["tiles"][rows.start // bq:rows.stop // bq]

        def backward(grads, dq, dbias):
            hop_grads = hop_bwd(q_part, hop_kv(cfg, kv, _rows(bias, rows, 2), kv_idx), hop_cfg, do=_rows(do, rows, 1),
                                lse=_rows(lse, rows, 2), delta=_rows(delta, rows, 2), **extras)
            return _add_hop(cfg, hop_grads, grads=grads, dq=dq, dbias=dbias, kv_idx=kv_idx, rows=rows)

        if skip:  # the cond adds to fresh zeros: handed the received accumulators, it (and the kernel in it)
            # waited for their transfer, which then had nothing to hide under (8 H100s, causal)
            fresh = KVGrads(*(None if x is None else jnp.zeros_like(x) for x in grads))
            mine, dq, dbias = lax.cond(block_mask.hop_is_empty(cfg, q_part, kv, my_idx, step), lambda *a: a, backward,
                                       fresh, dq, dbias)
            return KVGrads(*(None if a is None else a + b for a, b in zip(grads, mine))), dq, dbias
        return backward(grads, dq, dbias)

    # Delayed accumulators: every send is issued before the hop's kernel and needs nothing it computes, so
    # it flies while the kernel runs. At step s host i holds K/V shard i - s; it sends them on with the
    # accumulators of shard i - s + 1 (step s - 1's, its own hop added), computes its hop's grads, then adds
    # them to the accumulators of shard i - s just received from host i - 1. The own shard's hop is split
    # in two halves of query rows: the first overlaps the first K/V send, the second the last dK/dV send
    # (shard i's accumulators coming home from host i - 1). With 4 hosts, host 0 holds shards 0, 3, 2, 1;
    # shard 0's accumulators go 0 (first half) -> 1 -> 2 -> 3 -> 0 (second half): N sends, as before.
    first, last, half_cfg = row_halves(cfg, qs.q.shape[1]) or (None, None, cfg.hop)
    # The first send leaves the loop, so nothing orders it after the forward ring any more: XLA's CPU runtime
    # then ran it beside the forward loop's sends on the same axis, in a different order on each device, and
    # they exchanged the wrong buffers (the hybrid's tests, 2 x 2 mesh: wrong results in 5 of 8 runs). Tied to
    # delta (the forward's o and the cotangent), it waits for what the first hop's kernel waits for anyway.
    own, delta = lax.optimization_barrier((comm.encode(kv, cfg.comm_dtype, pack=True), delta))
    kv_home = kv
    kv_next = send_to_next(own, cfg.axis_name)
    grads, dq, dbias = hop(0, own, *vary_like((grads, dq, dbias), axes), rows=first, hop_cfg=half_cfg)

    def step_fn(carry, step):  # steps 1 .. N - 2
        kv, grads, dq, dbias = carry
        kv_next = send_to_next(kv, cfg.axis_name)
        received = send_grads(grads)  # shard i - step's accumulators, from host i - 1
        return (kv_next,) + hop(step, kv, received, dq, dbias)

    kv, grads, dq, dbias = ring_loop(step_fn, (kv_next, grads, dq, dbias), n, first=1)
    grads, dq, dbias = hop(n - 1, kv, send_grads(grads), dq, dbias)  # the last step: no K/V left to send
    if last is not None:  # the second half's kernel must run under the home send, not before the last hop
        # (it needs nothing that hop makes, and XLA:TPU moved it there): its K/V come out of a barrier with
        # the accumulators that send carries. The barrier takes the K/V as given, not the kernel's copy of
        # them made for the first half, which would then stay live through the loop.
        grads, kv_home = lax.optimization_barrier((grads, kv_home))
    grads = send_grads(grads)  # the N-th move: home
    if last is not None:
        grads, dq, dbias = hop(0, comm.encode(kv_home, cfg.comm_dtype, pack=True), grads, dq, dbias, rows=last,
                               hop_cfg=half_cfg)
    if packed:
        grads = KVGrads(grads.dk[0], grads.dk[1], grads.dbias)
    return dq, grads, dbias
