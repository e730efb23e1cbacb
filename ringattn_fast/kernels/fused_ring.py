"""The fused TPU ring's plumbing, shared by its forward and backward kernels (``pallas_tpu_fused``).

Three things live here: the SMEM tables that steer a kernel (`schedule`), where a device stands in the
ring and how it talks to its neighbours (`prologue`, `wait_cap`, `signal_cap`, `remote_sends`,
`finish`: the double buffer, semaphores and handshake drawn in ``pallas_tpu_fused``'s docstring), and
the streaming of tiles from HBM into double-buffered VMEM (`stream_tiles`), which keeps a kernel's VMEM
independent of the shard length. All index arithmetic is int32 (`I32`), so the kernels also run with
``jax_enable_x64`` on.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.tiles import by_kind as tile_by_kind
from ringattn_fast.kernels.tiles import sub_tiles, tile_bounds
from ringattn_fast.masks import bounds_empty

I32 = jnp.int32  # every index constant: with jax_enable_x64 a Python int would become int64


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static configuration of one fused-ring call (hashable: a custom_vjp nondiff argument).
    ``vmem_limit``: the compiler's ``vmem_limit_bytes`` for the chip (None: its default; `budgets`);
    ``one_pass``: which backward runs (`fused_ring_bwd`), ``one_pass_limit`` its limit; ``whole_kv``: which
    forward runs, ``whole_kv_limit`` its limit."""
    axis_name: object
    axis_size: int
    hop: object  # the checked HopConfig (blocks clamped to the shard)
    has_seg: bool
    interpret: object
    handshake: bool = True
    count: bool = False  # return the number of computed tiles (tests)
    vmem_limit: int | None = None
    one_pass: bool = False  # the backward in one pass (`fused_ring_bwd`), with its own vmem_limit_bytes
    one_pass_limit: int | None = None
    whole_kv: bool = False  # the forward holds a kv head's K/V whole in VMEM (`pallas_tpu_fused._whole_kv`)
    whole_kv_limit: int | None = None

    @property
    def masked(self):
        """Whether positions are read: a pair can be masked, or a user function sees them (``mask_fn``,
        ``score_fn``); else positions are never copied."""
        hop = self.hop
        return (hop.causal or hop.window is not None or self.has_seg or hop.mask_fn is not None
                or hop.score_fn is not None)


# ---------------------------------------------------------------- tables

def schedule(cfg, qs, kv, split=1):
    """The scalar-prefetched (SMEM) tables, computed outside the kernel, all int32 and flat:

    ring     [3]              (my_idx, right, left) = (my_idx, (my_idx + 1) % N, (my_idx - 1) % N);
    q_live   [N * b * nq]     1 (live) if my Q tile i (of batch row bi) sees some key of shard r, else 0;
    k_live   [N * b * nk]     1 (live) if K/V tile j of shard r is seen by some of my queries, else 0;
    q_bounds [b * nq * 4]     (pos_min, pos_max, seg_min, seg_max) of each of my Q tiles;
    k_bounds [N * b * nk * 4] the same for each K/V tile of every shard (`tiles.tile_bounds`);
    q_sub, k_sub              the same two at sides block / ``split`` (`by_kind`'s sub-tiles).

    With ``split`` = 1, ``q_sub`` and ``k_sub`` are unread 4-entry placeholders.
    A tile is skipped when ``masks.bounds_empty`` proves it empty from these bounds (`tile_empty`),
    and a Q (K/V) tile that is not live in a hop (all its tiles empty) costs no DMA at all: O(tiles)
    of SMEM, not O(tiles^2). Building ``k_bounds`` needs every shard's k positions: an ``all_gather`` of int32
    metadata only; the K/V themselves move inside the kernel.
    """
    n, hop = I32(cfg.axis_size), cfg.hop
    my_idx = lax.axis_index(cfg.axis_name).astype(jnp.int32)
    ring = jnp.stack([my_idx, lax.rem(my_idx + I32(1), n), lax.rem(my_idx + n - I32(1), n)])
    k_pos = lax.all_gather(kv.pos, cfg.axis_name)                           # (N, b, sk)
    k_seg = None if kv.seg is None else lax.all_gather(kv.seg, cfg.axis_name)
    k_bounds = lambda block: jnp.stack([tile_bounds(k_pos[r], None if k_seg is None else k_seg[r], block)  # noqa: E731
                                        for r in range(cfg.axis_size)])  # (N, b, sk / block, 4)
    qb, kb = tile_bounds(qs.pos, qs.seg, hop.block_q), k_bounds(hop.block_kv)  # (b, nq, 4), (N, b, nk, 4)
    nb = 4 if cfg.has_seg else 2
    empty = bounds_empty(tuple(jnp.moveaxis(qb[None, :, :, None, :nb], -1, 0)),
                         tuple(jnp.moveaxis(kb[:, :, None, :, :nb], -1, 0)), causal=hop.causal, window=hop.window)
    shape = (cfg.axis_size,) + qb.shape[:2] + kb.shape[2:3]                # (N, b, nq, nk)
    empty = jnp.zeros(shape, bool) if empty is None else jnp.broadcast_to(empty, shape)
    q_live, k_live = (jnp.logical_not(jnp.all(empty, axis=a)).astype(jnp.int32).reshape(-1) for a in (3, 2))
    subs = ((tile_bounds(qs.pos, qs.seg, hop.block_q // split), k_bounds(hop.block_kv // split)) if split > 1
            else (jnp.zeros(4, jnp.int32),) * 2)  # unread placeholders: whole tiles only
    return (ring, q_live, k_live) + tuple(x.reshape(-1).astype(jnp.int32) for x in (qb, kb) + subs)


def live(table_ref, kv_idx, bi, i, b, n_tiles):
    """bool scalar: entry (kv_idx, bi, i) of a ``q_live`` / ``k_live`` table (`schedule`); True = live
    (the tile is not empty against every tile of the other side: it must be loaded)."""
    return table_ref[(kv_idx * I32(b) + bi) * I32(n_tiles) + i] == 1


def any_live(table_ref, kv_idx, bi, b, n_tiles):
    """bool scalar: some tile of batch row ``bi`` is live against shard ``kv_idx`` (`live` over all ``n_tiles``)."""
    return lax.fori_loop(I32(0), I32(n_tiles), lambda j, acc: acc | live(table_ref, kv_idx, bi, j, b, n_tiles),
                         jnp.bool_(False))


def _bounds(cfg, tables, shape, kv_idx, bi, i, j):
    """The SMEM bounds (`schedule`) of my Q tile i and of K/V tile j of shard ``kv_idx``, batch row ``bi``."""
    qb_ref, kb_ref = tables
    b, nq, nk = shape
    nb = 4 if cfg.has_seg else 2
    q0, k0 = (bi * I32(nq) + i) * I32(4), ((kv_idx * I32(b) + bi) * I32(nk) + j) * I32(4)
    return tuple(qb_ref[q0 + I32(c)] for c in range(nb)), tuple(kb_ref[k0 + I32(c)] for c in range(nb))


def tile_empty(cfg, tables, shape, *, kv_idx, bi, i, j):
    """bool scalar, True = empty: `masks.bounds_empty` on the SMEM bounds proves that tile (Q tile i,
    K/V tile j) of batch row ``bi`` against shard ``kv_idx`` holds no visible pair. shape = (b, nq, nk)."""
    empty = bounds_empty(*_bounds(cfg, tables, shape, kv_idx, bi, i, j), causal=cfg.hop.causal,
                         window=cfg.hop.window)
    return jnp.bool_(False) if empty is None else empty


def by_kind(cfg, tables, shape, body, *, kv_idx, bi, i, j, split=1, sub_tables=None, chunks=None):
    """`tiles.by_kind` for a tile the caller has proved not empty (`tile_empty`): ``body(False)`` (no built-in
    mask computed) where `masks.bounds_full` proves every pair visible, ``body(True)`` on a partial tile;
    without a built-in mask, ``body(False)``. With ``split`` > 1 a partial tile runs as ``split`` x ``split``
    sub-tiles (`tiles.sub_tiles`), each by its own kind from ``sub_tables`` (`schedule`'s ``q_sub``,
    ``k_sub``): ``body(masked, query rows, key rows)`` with static slices, an empty sub-tile skipped (on a
    causal diagonal, a quarter of the tile at ``split`` = 2). ``chunks``: (query rows, key rows) static
    slices that a tile not split runs as, ``body(masked, rows, keys)`` each (`pallas_tpu._chunks`)."""
    hop = cfg.hop

    def compute(masked):
        if not masked or split == 1:
            if chunks is None:
                body(masked)
            for rows, keys in chunks or ():
                body(masked, rows, keys)
            return
        b, nq, nk = shape
        sub_shape = (b, nq * split, nk * split)
        at = lambda r, c: dict(kv_idx=kv_idx, bi=bi, i=i * I32(split) + I32(r), j=j * I32(split) + I32(c))  # noqa: E731
        sub_tiles(body, lambda r, c: _bounds(cfg, sub_tables, sub_shape, **at(r, c)), (hop.block_q, hop.block_kv),
                  split, causal=hop.causal, window=hop.window)

    tile_by_kind(compute, *_bounds(cfg, tables, shape, kv_idx=kv_idx, bi=bi, i=i, j=j), causal=hop.causal,
                 window=hop.window, skip_empty=False)


# ---------------------------------------------------------------- the ring

class Ring(NamedTuple):
    """Where this device stands at grid step ``step``: ``slot = step % 2`` holds K/V shard ``kv_idx``."""
    step: jax.Array
    n: int
    slot: jax.Array
    right: jax.Array
    left: jax.Array
    kv_idx: jax.Array


def copy(src, dst, sem):
    """A local DMA, waited on (``src``/``dst`` refs or ref views; ``sem`` a DMA semaphore)."""
    c = pltpu.make_async_copy(src, dst, sem)
    c.start()
    c.wait()


def prologue(cfg, ring_ref, fill, init, sem):
    """The opening both kernels share. Returns the `Ring` of this step; at step 0: the barrier with
    both neighbours, slot 0 of each travelling HBM buffer filled with this device's own shard
    (``fill``: pairs ``(ring_buf, own)``, one local DMA each; none on a ring of one) and ``init()`` (the
    counter)."""
    step, n = pl.program_id(0), cfg.axis_size
    my_idx, right, left = ring_ref[0], ring_ref[1], ring_ref[2]
    ring = Ring(step, n, lax.rem(step, I32(2)), right, left, lax.rem(my_idx - step + I32(n), I32(n)))

    @pl.when(step == 0)
    def _():
        if n > 1:  # a ring of one has no travelling buffers (`held`): nothing to fill
            _barrier(cfg, right, left)
            for buf, own in fill:
                copy(own, buf.at[I32(0)], sem)
        init()
    return ring


def held(ring, own, ring_buf):
    """The HBM K/V (or key metadata) of the shard this step holds: the ring buffer's slot, or on a ring of one,
    where nothing travels and no ring buffer exists (`ring_slots`), the kernel's input itself (no copy of the
    shard into a slot: at 8K tokens, 8 heads, 64 MiB of HBM traffic in each kernel)."""
    return own if ring.n == 1 else ring_buf.at[ring.slot]


def ring_slots(n):
    """Slots of a travelling HBM buffer: two (the double buffer), one on a ring of one (dK/dV's accumulator)."""
    return 2 if n > 1 else 1


def _barrier(cfg, right, left):
    """Both ring neighbours have entered the kernel (their buffers exist) before any remote DMA."""
    sem = pltpu.get_barrier_semaphore()
    for nb in (left, right):
        pl.semaphore_signal(sem, 1, device_id={cfg.axis_name: nb})
    pl.semaphore_wait(sem, 2)


def last_send(n, *, backward=False):
    """The last ring step at which a device sends: K/V at steps ``0 .. N-2`` in the forward (no send after
    the last hop), K/V and dK/dV at ``0 .. N-1`` in the backward (the N-th move brings dK/dV home)."""
    return n - 1 if backward else n - 2


def wait_cap(cfg, ring, cap_sem, last_send):
    """Before my send of step ``0 < step <= last_send``: the right neighbour freed the slot I write."""
    if ring.n > 1 and cfg.handshake:
        @pl.when((ring.step > 0) & (ring.step <= last_send))
        def _():
            pl.semaphore_wait(cap_sem, 1)


def signal_cap(cfg, ring, cap_sem, last_send):
    """After step ``step``: my slot ``step % 2`` is free; tell the left neighbour, which writes it at
    its step + 1, if it sends again then (``step + 1 <= last_send``). Signals = waits, exactly."""
    if ring.n > 1 and cfg.handshake:
        @pl.when(ring.step < last_send)
        def _():
            pl.semaphore_signal(cap_sem, 1, device_id={cfg.axis_name: ring.left})


def remote_sends(cfg, bufs, send_sem, recv_sem, slot, right):
    """One remote copy per travelling HBM buffer ``(a, buf)``: my ``buf[slot]`` -> the right
    neighbour's ``buf[1 - slot]``, with send semaphore ``send_sem[a]``, receive ``recv_sem[a, 1 - slot]``."""
    return [pltpu.make_async_remote_copy(buf.at[slot], buf.at[I32(1) - slot], send_sem.at[I32(a)],
                                         recv_sem.at[I32(a), I32(1) - slot], device_id={cfg.axis_name: right})
            for a, buf in bufs]


def finish(copies):
    for c in copies:
        c.wait_send()  # my DMA has read my slot: it may be declared free
        c.wait_recv()  # the left neighbour's DMA has filled my other slot: it may be read


# ---------------------------------------------------------------- streaming tiles

class Stream(NamedTuple):
    """Tiles copied from HBM into double-buffered VMEM: ``pairs`` of ``(src(u) -> HBM ref view of tile
    u, dst VMEM scratch with a leading buffer axis of 2)`` and the DMA semaphores ``sems
    [len(pairs), 2]``; tile ``u`` goes into buffer ``u % 2``."""
    pairs: tuple
    sems: object

    def copies(self, u, buf):
        return [pltpu.make_async_copy(src(u), dst.at[buf], self.sems.at[I32(a), buf])
                for a, (src, dst) in enumerate(self.pairs)]


def stream_tiles(n, stream: Stream, empty: Callable, body: Callable):
    """``body(u, buf)`` for each tile ``u < n`` that is not ``empty(u)``, once its copies into buffer ``buf =
    u % 2`` have landed. The copy of tile ``u + 1`` starts before tile ``u``'s is waited on, so one
    tile's DMA overlaps the previous tile's compute; an empty tile costs neither DMA nor compute.
    Buffer ``(u + 1) % 2`` is free then: it held tile ``u - 1``, whose compute is done."""
    def start(u, buf):
        for c in stream.copies(u, buf):
            c.start()

    @pl.when(jnp.logical_not(empty(I32(0))))
    def _():
        start(I32(0), I32(0))

    def step(u, carry):
        buf, nxt = lax.rem(u, I32(2)), u + I32(1)

        @pl.when((nxt < I32(n)) & jnp.logical_not(empty(jnp.minimum(nxt, I32(n - 1)))))
        def _():
            start(nxt, I32(1) - buf)

        @pl.when(jnp.logical_not(empty(u)))
        def _():
            for c in stream.copies(u, buf):
                c.wait()
            body(u, buf)
        return carry

    lax.fori_loop(I32(0), I32(n), step, I32(0))
