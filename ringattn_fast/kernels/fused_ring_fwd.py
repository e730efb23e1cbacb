"""The fused TPU ring's forward kernel (``pallas_tpu_fused``): FA-2 Alg. 1 with the ring as its outer Bc loop.

Per ring step, per (batch row, kv head), each Q tile of the head group runs through the held shard's K/V
tiles; its m, l and unnormalised O sit in VMEM meanwhile (``stat_v`` = [m | l] as two lane-replicated
(Br, 128) halves, ``acc_v``), and in HBM between ring steps (N > 1: the ring *is* FA-2's outer loop). At the
last step o and lse = m + log l leave (lse as lane-dense rows where block_q allows, `lse_rows`). Two ways to
hold K/V, one kernel:

- **whole** (``cfg.whole_kv``, :data:`WHOLE_KV`; where it fits): the kv head's K, V and key
  positions of the shard copied into VMEM once and read in place by every query head of the group;
- **streamed** (the fallback: VMEM independent of the shard length): K/V tiles copied into double buffers
  a tile ahead (`fused_ring.stream_tiles`), once per query head and Q tile.

Both double-buffer the Q tiles (the next tile's q copied in under this one's compute, o and lse written
back asynchronously), skip empty tiles, compute the built-in mask only on partial ones and run a partial
tile as 2 x 2 sub-tiles (`fused_ring.by_kind`). The ring's plumbing (remote sends, handshake) is
``fused_ring``; the backward is ``fused_ring_bwd``.

On a ring of one v5e chip (1024 x 1024 tiles, bf16, 16K tokens) the forward took 32.5 ms whole and 33.2
streamed at 32 / 8 heads, 9.3 ms either way at 8 / 8 (docs/benchmarks.md, sixth chip session).
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import fused_ring as fr
from ringattn_fast.kernels.fused_ring import I32
from ringattn_fast.kernels.fused_tiles import (ANY, LANES, consts, dot, fused_call, kernel_shape, logits, outputs,
                                               query_head, ring_buffers, sub_split, unflatten, vmem)
from ringattn_fast.kernels.tiles import NEG_INF, same_vma

WHOLE_KV = True  # a kv head's K/V whole in VMEM where it fits (``pallas_tpu_fused._whole_kv`` decides)


def _fwd_kernel(cfg, prog, ring_ref, q_live_ref, k_live_ref, qb_ref, kb_ref, qsb_ref, ksb_ref,  # SMEM tables
                q_hbm, qmeta_hbm, kv_hbm, kmeta_hbm, const_refs,                     # inputs (HBM; consts VMEM)
                o_hbm, lse_hbm, stat_hbm, acc_hbm, kv_ring, kmeta_ring, cnt_ref,     # outputs (HBM; cnt SMEM)
                q_v, qm_v, acc_v, stat_v, o_v, lse_v, k_t, v_t, km_t,                # VMEM
                sem, tile_sems, q_sems, wb_sems, send_sem, recv_sem, cap_sem):
    """Grid = (axis_size,): grid step ``step`` is ring step ``step`` (FA-2 Alg. 1 with the ring as its
    outer Bc loop); per step, per (batch row, kv head), every Q tile of the head group that is live in
    this hop runs through the held shard's K/V tiles. A Q tile that sees nothing of the shard is not
    touched (its state stays in HBM), except at step 0 (its state is initialised) and at the last step
    (its o and lse are written). On a ring of one there is no state between steps (``stat``, ``acc`` and
    the ring buffers are None).

    K/V: with ``cfg.whole_kv`` the kv head's K, V (and key positions, (nk, 2, bk) tiles of ``kmeta`` [b,
    nk, 2, bk]) of the shard are copied into VMEM once (``k_t``, ``v_t``, ``km_t`` [sk, d]) and read in
    place, shared by the group's query heads; else streamed a tile at a time into double buffers (VMEM
    independent of the shard). Q tiles are double-buffered: tile t + 1's q (and positions) are copied in
    while tile t computes; o and lse leave asynchronously, waited on two tiles later."""
    b, h, hk, nq, nk = kernel_shape(cfg, q_hbm.shape, kv_hbm.shape)
    bq, bk, split, group = cfg.hop.block_q, cfg.hop.block_kv, sub_split(cfg, prog), h // hk
    count = group * nq  # Q tiles of one head group

    def init():
        if cnt_ref is not None:
            cnt_ref[0] = 0

    ring = fr.prologue(cfg, ring_ref, [(kv_ring, kv_hbm), (kmeta_ring, kmeta_hbm)], init, sem)
    n, slot, last_send = ring.n, ring.slot, fr.last_send(ring.n)  # K/V are sent at steps 0 .. N-2
    kv_src, kmeta_src, as_rows = fr.held(ring, kv_hbm, kv_ring), fr.held(ring, kmeta_hbm, kmeta_ring), lse_rows(cfg)
    first, last = ring.step == 0, ring.step == n - 1
    copies = [] if n == 1 else fr.remote_sends(cfg, ((0, kv_ring), (1, kmeta_ring)), send_sem, recv_sem, slot,
                                               ring.right)
    fr.wait_cap(cfg, ring, cap_sem, last_send)

    @pl.when(ring.step <= last_send)
    def _():
        for c in copies:
            c.start()

    rows, cols = (lambda i: pl.ds(i * I32(bq), bq)), (lambda j: pl.ds(j * I32(bk), bk))
    live = lambda bi, t: fr.live(q_live_ref, ring.kv_idx, bi, lax.rem(t, I32(nq)), b, nq)  # noqa: E731

    head_of = lambda kv_head, t: query_head(kv_head, t, group, nq)  # noqa: E731

    def q_loads(bi, kv_head, t, buf, action):  # Q tile t's q (and positions) -> buffer buf: start or wait them
        hi, i = head_of(kv_head, t)
        action(pltpu.make_async_copy(q_hbm.at[bi, hi, rows(i), :], q_v.at[buf], q_sems.at[I32(0), buf]))
        if cfg.masked:
            action(pltpu.make_async_copy(qmeta_hbm.at[bi, :, rows(i), :], qm_v.at[buf], q_sems.at[I32(1), buf]))

    def write_backs(bi, kv_head, t, buf):  # Q tile t's o and lse: VMEM buffer buf -> HBM (at the last step)
        hi, i = head_of(kv_head, t)
        lse_at = lse_hbm.at[bi, hi, :, rows(i)] if as_rows else lse_hbm.at[bi, hi, rows(i), :]
        return [pltpu.make_async_copy(o_v.at[buf], o_hbm.at[bi, hi, rows(i), :], wb_sems.at[I32(0), buf]),
                pltpu.make_async_copy(lse_v.at[buf], lse_at, wb_sems.at[I32(1), buf])]

    def q_tile(bi, kv_head, t, carry):
        (hi, i), buf, nxt = head_of(kv_head, t), lax.rem(t, I32(2)), t + I32(1)

        @pl.when((nxt < I32(count)) & live(bi, jnp.minimum(nxt, I32(count - 1))))
        def _():  # its buffer held tile t - 1, whose compute is done
            q_loads(bi, kv_head, nxt, I32(1) - buf, lambda c: c.start())

        @pl.when(last & (t >= I32(2)))
        def _():  # tile t - 2 wrote o and lse from this buffer
            for c in write_backs(bi, kv_head, t - I32(2), buf):
                c.wait()

        pl.when(live(bi, t))(lambda: q_loads(bi, kv_head, t, buf, lambda c: c.wait()))

        @pl.when(first)
        def _():
            stat_v[:, :LANES] = jnp.full((bq, LANES), NEG_INF, jnp.float32)
            stat_v[:, LANES:] = jnp.zeros((bq, LANES), jnp.float32)
            acc_v[...] = jnp.zeros(acc_v.shape, jnp.float32)

        if n > 1:
            @pl.when(jnp.logical_not(first) & (live(bi, t) | last))
            def _():
                fr.copy(acc_hbm.at[bi, hi, rows(i), :], acc_v, sem)
                fr.copy(stat_hbm.at[bi, hi, rows(i), :], stat_v, sem)

        def fold(j, buf_kv, masked, qp=slice(None), kp=slice(None)):  # the tile, or its sub-tile (rows qp, keys kp)
            if cfg.whole_kv:  # this tile's (or sub-tile's) keys of the resident shard
                start, size = (0, bk) if kp.start is None else (kp.start, kp.stop - kp.start)
                keys = pl.ds(pl.multiple_of(j * I32(bk) + I32(start), size), size)
                k, v, km = k_t[keys, :], v_t[keys, :], km_t.at[j]
            else:
                k, v, km = k_t[buf_kv, kp, :], v_t[buf_kv, kp, :], km_t.at[buf_kv]
            s = logits(cfg, (prog, const_refs, hi), q_v[buf, qp, :], k, qm_v.at[buf], km, masked=masked,
                       part=(qp, kp))                                    # (bq, bk)
            m_prev, l_prev = stat_v[qp, :LANES], stat_v[qp, LANES:]      # (bq, 128) each, lane-replicated
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: no NaN
            p = jnp.exp(s - m_safe[:, :1])                    # FA-2 P~ (masked: 0)
            alpha = jnp.exp(m_prev - m_safe)                  # e^{m_old - m}
            stat_v[qp, LANES:] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            stat_v[qp, :LANES] = m_new
            acc_v[qp, :] = alpha[:, :1] * acc_v[qp, :] + dot(p.astype(v.dtype), v, ((1,), (0,)))

        def kv_tile(j, buf_kv):
            if cnt_ref is not None:
                cnt_ref[0] += 1
            fr.by_kind(cfg, (qb_ref, kb_ref), (b, nq, nk), functools.partial(fold, j, buf_kv), kv_idx=ring.kv_idx,
                       bi=bi, i=i, j=j, split=split, sub_tables=(qsb_ref, ksb_ref))

        tile_empty = lambda j: fr.tile_empty(cfg, (qb_ref, kb_ref), (b, nq, nk),  # noqa: E731
                                             kv_idx=ring.kv_idx, bi=bi, i=i, j=j)

        @pl.when(live(bi, t))
        def _():
            if cfg.whole_kv:
                def step(j, c):
                    pl.when(jnp.logical_not(tile_empty(j)))(lambda: kv_tile(j, None))
                    return c
                lax.fori_loop(I32(0), I32(nk), step, I32(0))
            else:
                pairs = [(lambda j: kv_src.at[I32(0), bi, kv_head, cols(j), :], k_t),
                         (lambda j: kv_src.at[I32(1), bi, kv_head, cols(j), :], v_t)]
                pairs += [(lambda j: kmeta_src.at[bi, :, cols(j)], km_t)] if cfg.masked else []
                fr.stream_tiles(nk, fr.Stream(tuple(pairs), tile_sems), tile_empty, lambda j, bkv: kv_tile(j, bkv))

        @pl.when(last)
        def _():
            l, m = stat_v[:, LANES:], stat_v[:, :LANES]
            empty = l == 0.0  # saw nothing (a NaN l stays NaN)
            l_safe = jnp.where(empty, 1.0, l)
            o_v[buf] = jnp.where(empty[:, :1], 0.0, acc_v[...] / l_safe[:, :1]).astype(o_v.dtype)
            lse = jnp.where(empty, NEG_INF, m + jnp.log(l_safe))  # (bq, 128), lane-replicated
            lse_v[buf] = jnp.transpose(lse)[:1, :] if as_rows else lse  # a lane-dense (1, bq) row
            for c in write_backs(bi, kv_head, t, buf):
                c.start()

        if n > 1:
            @pl.when(jnp.logical_not(last) & (live(bi, t) | first))
            def _():
                fr.copy(acc_v, acc_hbm.at[bi, hi, rows(i), :], sem)
                fr.copy(stat_v, stat_hbm.at[bi, hi, rows(i), :], sem)
        return carry

    def head(t, carry):  # one (batch row, kv head): the group's Q tiles, its K/V whole in VMEM (``whole_kv``)
        bi, kv_head = unflatten(t, (b, hk))
        if cfg.whole_kv:
            @pl.when(fr.any_live(k_live_ref, ring.kv_idx, bi, b, nk))
            def _():
                fr.copy(kv_src.at[I32(0), bi, kv_head], k_t, sem)
                fr.copy(kv_src.at[I32(1), bi, kv_head], v_t, sem)
                if cfg.masked:
                    fr.copy(kmeta_src.at[bi], km_t, sem)
        pl.when(live(bi, I32(0)))(lambda: q_loads(bi, kv_head, I32(0), I32(0), lambda c: c.start()))
        lax.fori_loop(I32(0), I32(count), functools.partial(q_tile, bi, kv_head), I32(0))

        @pl.when(last)
        def _():  # the write-backs no later tile waited on
            for tail in range(max(count - 2, 0), count):
                for c in write_backs(bi, kv_head, I32(tail), I32(tail % 2)):
                    c.wait()
        return carry

    lax.fori_loop(I32(0), I32(b * hk), head, I32(0))

    @pl.when(ring.step <= last_send)
    def _():
        fr.finish(copies)
    fr.signal_cap(cfg, ring, cap_sem, last_send)


def lse_rows(cfg):
    """lse leaves the forward as rows [b, h, 1, sq] (block_q a multiple of 128: Mosaic's lane rule for a
    (1, block_q) row and its transpose) or as lane-replicated columns [b, h, sq, 128] (128x the bytes)."""
    return cfg.hop.block_q % LANES == 0


def fwd_scratch(cfg, d, dtype, sk):
    """(shape, dtype) of the forward's VMEM, in kernel order (`forward_call`, ``pallas_tpu_fused.footprints``):
    double-buffered q, positions, o and lse of a Q tile, its running acc and [m | l]; then a kv head's K, V
    ([sk, d]) and key positions ((nk, 2, bk) tiles) whole (``cfg.whole_kv``), or double-buffered K/V tiles."""
    bq, bk, f32, i32 = cfg.hop.block_q, cfg.hop.block_kv, jnp.float32, jnp.int32
    lse = ((2, 1, bq) if lse_rows(cfg) else (2, bq, LANES), f32)
    kv = ([((sk, d), dtype)] * 2 + [((sk // bk, 2, bk), i32)] if cfg.whole_kv else
          [((2, bk, d), dtype)] * 2 + [((2, 2, bk), i32)])
    return [((2, bq, d), dtype), ((2, 2, bq, LANES), i32), ((bq, d), f32), ((bq, 2 * LANES), f32),
            ((2, bq, d), dtype), lse] + kv


def forward_call(cfg, sched, q_t, qmeta, kv, kmeta):
    """q_t [b, h, sq, d], qmeta [b, 2, sq, 128], kv [2, b, hk, sk, d], kmeta [b, 2, sk] -> o [b, h, sq, d]
    (q dtype), lse [b, h, sq] float32, computed-tile count int32 [1] or None. The running state between
    ring steps (``stat`` [m | l] and ``acc``, float32) and the ring buffers exist only for N > 1."""
    f32 = jnp.float32
    prog, values, const_specs = consts(cfg)
    q_t, qmeta, kv, kmeta, *values = same_vma(q_t, qmeta, kv, kmeta, *values)
    b, h, sq, d = q_t.shape
    ring = cfg.axis_size > 1
    out_shape, out_specs = outputs(cfg, q_t, (q_t.shape, q_t.dtype),
                                   ((b, h, 1, sq) if lse_rows(cfg) else (b, h, sq, LANES), f32),
                                   ((b, h, sq, 2 * LANES), f32) if ring else None, (q_t.shape, f32) if ring else None,
                                   *ring_buffers(cfg, kv, kmeta))
    dma = pltpu.SemaphoreType.DMA
    sems = [dma(()), dma((3, 2)), dma((2, 2)), dma((2, 2)), dma((2,)), dma((2, 2)), pltpu.SemaphoreType.REGULAR]
    call = fused_call(_fwd_kernel, "ring_fused_fwd_tpu", cfg, prog, out_shape=out_shape,
                      in_specs=[ANY] * 4 + [const_specs], out_specs=out_specs,
                      scratch=vmem(fwd_scratch(cfg, d, q_t.dtype, kv.shape[3])) + sems,
                      vmem_limit=cfg.whole_kv_limit if cfg.whole_kv else None)
    o, lse, _, _, _, _, cnt = call(*sched, q_t, qmeta, kv, kmeta, tuple(values))
    return o, lse[:, :, 0, :] if lse_rows(cfg) else lse[..., 0], cnt
