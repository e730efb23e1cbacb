"""Fused TPU ring attention: one ``pallas_call`` per layer and direction runs the whole ring.

Ring Attention (Liu, Zaharia, Abbeel 2023, Algorithm 1) overlaps the transfer of the next K/V shard
with the attention over the current one. The other impls write that overlap as ``lax.ppermute`` plus
a per-hop kernel and hope that XLA schedules them concurrently. Here the kernel moves K/V itself with
remote DMA (``pltpu.make_async_remote_copy``), so the overlap is in the program text: a send starts,
the hop's tiles are computed, then the send is waited on.

Called inside ``shard_map`` on this host's shards: ``fused_ring_attention_shard(QShard, KVShard,
HopConfig, *, axis_name)`` (``kv`` is this host's own K/V shard, the kernel moves it). Inputs are
float16, bfloat16 or float32 (one dtype), computed in float32; o and the gradients come back in the
input dtype.

Memory: everything that grows with the shard stays in HBM (``memory_space=pl.ANY``): q, o, the
travelling K/V (and, backward, dK/dV) double buffers, the running statistics (a ring of one has no
travelling buffers and no state between steps: it reads its K/V in place). Where it fits the chip, a
kernel holds one kv head's K/V of the shard whole in VMEM (the forward with GQA, :data:`WHOLE_KV`; the
one-pass backward, with that head's dK/dV: `fused_ring_bwd`) and reads each K/V tile in place, once per
head group; 21 MiB forward and 39 MiB backward at 16K tokens per device, d = 128, bf16, 1024 x 1024 tiles.
Elsewhere it copies one Q tile and a stream of double-buffered K/V tiles into VMEM
(`fused_ring.stream_tiles`: tile j + 1's DMA overlaps tile j's compute), so its VMEM is a few tiles,
whatever ``s_local`` (`budgets`: 0.63 MiB forward, 1.51 MiB two-pass backward at 128 x 128 tiles, 12 and
23 MiB at 1024 x 1024). Q tiles are double-buffered in the forward and the one-pass backward: the next
tile's inputs are copied in, and the last one's outputs written back, under the current tile's compute.
The remote DMA of the whole next shard runs, HBM to HBM, underneath.

Notation (FlashAttention-2, Dao 2023, Algorithms 1 and 2):

- Br, Bc: ``cfg.hop.block_q``, ``cfg.hop.block_kv``.
- m, l, O (Alg. 1 lines 8-10): per Q tile in VMEM (``stat_v`` = [m | l] as two lane-replicated
  (Br, 128) halves, ``acc_v`` the unnormalised O) while the tile runs through the hop's K/V tiles;
  between ring steps in HBM (``stat``, ``acc``): the ring *is* FA-2's outer Bc loop, so the running
  statistics of every Q tile live across the grid axis.
- S: ``scale * q @ k.T``, soft-capped, ``score_fn`` and ``mask_fn`` applied as in the per-hop kernels
  (`tiles.programmed`; their consts sit whole in VMEM), -inf where ``masks.allowed`` is False. K/V
  arrive marked by ``masks.mark_bad_keys``; dQ reads ``tiles.finite_keys(K)``, dS is zeroed where P is 0.
- lse = m + log l (-inf for a row that saw nothing; then o = 0); D = rowsum(dO * O) (outside).
- backward (`fused_ring_bwd`): per ring step one pass over the held shard where it fits (a kv head's dK
  and dV of the shard resident in VMEM, key-major tiles, 5 matmuls a tile, as the per-hop fused
  backward), else two passes (dK/dV, then dQ; 7 matmuls a tile). dQ accumulates in HBM over the steps.
- a tile that `masks.bounds_full` proves full computes no built-in mask, and a partial one runs as 2 x 2
  sub-tiles, each skipped, unmasked or masked by its own bounds (`fused_ring.by_kind`, `fused_tiles.sub_split`;
  the forward and the one-pass backward).

What travels (HBM to HBM). Forward: ``kv`` = stack(K, V) ``[2, b, hk, sk, d]`` (with ``d_v != d`` the
narrower of q/K and V zero-padded to the wider, `_pack`) and ``kmeta`` =
stack(k_pos, k_seg) ``[b, 2, sk]`` (positions travel with their K/V, so every layout gets exact masks).
Backward: the same plus ``dkv`` = stack(dK, dV) float32, which makes one extra hop after the last step
to arrive home; dQ stays (Ring Attention, Sec. 3).

Double buffer, semaphores and handshake (each device, N = axis_size, slot = step % 2; a ring of
4, seen from device 1, whose right neighbour is 2 and left neighbour is 0)::

          step 0                     step 1                        step 2              step 3 = N-1
  dev 1 | barrier with 0 and 2     | wait cap (2 freed its slot 0)| wait cap           |
        | send slot 0 -> 2.slot 1  | send slot 1 -> 2.slot 0      | send 0 -> 2.slot 1 | (no send)
        | compute K/V 1 in slot 0  | compute K/V 0 in slot 1      | compute K/V 3      | compute K/V 2
        | wait send, wait recv 1   | wait send, wait recv 0       | wait send, recv 1  | write o, lse
        | signal cap on 0          | signal cap on 0              | (0 sends no more)  |
  dev 0 |   writes 1.slot 1        |   writes 1.slot 0 only after | ...                |
        |   (never read yet)       |   1's "cap" of step 0        |                    |

*wait recv* orders my reads of a slot after the write into it; *wait send* orders the end of my
DMA's read of a slot before I declare it free; the *handshake* (REGULAR semaphore ``cap_sem``,
signalled on the left neighbour, "my slot is free") orders the left neighbour's next write into a
slot after my last read of it (every tile copy out of the slot is waited on before the step ends).
Without it a device can run a step ahead and overwrite the slot its right neighbour is still reading;
the TPU interpreter's race detector reports exactly that (``tests/_fused_race_probe.py``). With N = 2
each device sends once, into a slot never read, so the handshake only matters from N = 3 on. The
backward sends ``dkv`` every step *including* the last (N sends for N - 1 of K/V, so dK/dV end at home
in slot ``N % 2``), and ``cap`` is signalled at steps 0..N-2 (forward 0..N-3). A barrier-semaphore
exchange with both neighbours at step 0 makes sure they are inside the kernel before any DMA.
The plumbing (tables, ring position, handshake, sends, tile streams) is ``fused_ring.py``.

Skipping (docs/design.md, "Skipping"): the SMEM tables hold each tile's position / segment bounds and
which Q (K/V) tiles are live in which hop (`fused_ring.schedule`); a tile that is not live in a hop
costs no DMA, and inside a hop a tile that ``masks.bounds_empty`` proves empty costs neither DMA nor
compute. With ``count=True`` the kernels
also return how many tiles they computed (the backward counts its dQ pass).

Failure modes (JAX "Distributed computing in Pallas for TPUs" style):

- a device that waits for a receive nobody sends hangs: every ``wait_recv`` pairs with the left
  neighbour's send of the same step, and there is no K/V send (and no wait) after the last step;
- a semaphore left non-zero at exit crashes the kernel: ``cap_sem`` is signalled exactly as often as
  it is waited, and every DMA is waited on by both ends;
- dropping the handshake (``_handshake=False``) is a silent data race on TPU; the interpreter with
  ``detect_races=True`` reports it, and the interpreter must then be reset (use a subprocess);
- two kernels with different communication patterns must not share ``collective_id``; forward and
  backward here talk only to ring neighbours on one axis, so they share ``fused_tiles.COLLECTIVE_ID``.

On TPU use ``block_q`` a multiple of 8 and ``block_kv`` a multiple of 128 (or the whole shard).
Lowered for TPU v4 / v5e / v5p / v6e in CI (``tests/test_lowering.py``) and compiled for 4-chip slices of
each (``tests/test_compile.py``, libtpu with no chip). On a real chip it has run only as a ring of one (a
v5e; its tiles tuned there, :data:`TUNED`; docs/benchmarks.md); its remote DMA has run only in the CPU TPU
interpreter. ``ring_attention`` runs a ring of one as one hop of the
per-hop kernel instead (nothing to overlap).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import budgets
from ringattn_fast.kernels import fused_ring as fr
from ringattn_fast.kernels import fused_ring_bwd as bwd
from ringattn_fast.kernels.fused_ring import I32
from ringattn_fast.kernels.fused_tiles import (ANY, LANES, SUBLANES, consts, dot, fused_call, kernel_shape, lanes,
                                               logits, outputs, sub_split, unflatten, vmem)
from ringattn_fast.kernels.tiles import NEG_INF, check_budget, check_kernel_call, interpret_mode, same_vma, target_chip
from ringattn_fast.schedule import HopConfig, KVShard, QShard

IMPL = "pallas_tpu_fused"
WHOLE_KV = True  # the forward holds a GQA kv head's K/V whole in VMEM where it fits (`_whole_kv`); else streams


# ---------------------------------------------------------------- forward kernel

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
    kv_src, kmeta_src, lse_rows = fr.held(ring, kv_hbm, kv_ring), fr.held(ring, kmeta_hbm, kmeta_ring), _lse_rows(cfg)
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

    def head_of(kv_head, t):
        member, i = unflatten(t, (group, nq))
        return kv_head * I32(group) + member, i

    def q_loads(bi, kv_head, t, buf, action):  # Q tile t's q (and positions) -> buffer buf: start or wait them
        hi, i = head_of(kv_head, t)
        action(pltpu.make_async_copy(q_hbm.at[bi, hi, rows(i), :], q_v.at[buf], q_sems.at[I32(0), buf]))
        if cfg.masked:
            action(pltpu.make_async_copy(qmeta_hbm.at[bi, :, rows(i), :], qm_v.at[buf], q_sems.at[I32(1), buf]))

    def write_backs(bi, kv_head, t, buf):  # Q tile t's o and lse: VMEM buffer buf -> HBM (at the last step)
        hi, i = head_of(kv_head, t)
        lse_at = lse_hbm.at[bi, hi, :, rows(i)] if lse_rows else lse_hbm.at[bi, hi, rows(i), :]
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
            lse_v[buf] = jnp.transpose(lse)[:1, :] if lse_rows else lse  # a lane-dense (1, bq) row
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
            seen = lax.fori_loop(I32(0), I32(nk),
                                 lambda j, acc: acc | fr.live(k_live_ref, ring.kv_idx, bi, j, b, nk), jnp.bool_(False))

            @pl.when(seen)
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


def _lse_rows(cfg):
    """lse leaves the forward as rows [b, h, 1, sq] (block_q a multiple of 128: Mosaic's lane rule for a
    (1, block_q) row and its transpose) or as lane-replicated columns [b, h, sq, 128] (128x the bytes)."""
    return cfg.hop.block_q % LANES == 0


def _fwd_scratch(cfg, d, dtype, sk):
    """(shape, dtype) of the forward's VMEM, in kernel order (`_fwd_call`, `footprints`): double-buffered q,
    positions, o and lse of a Q tile, its running acc and [m | l]; then a kv head's K, V ([sk, d]) and key
    positions ((nk, 2, bk) tiles) whole (``cfg.whole_kv``), or double-buffered K/V tiles."""
    bq, bk, f32, i32 = cfg.hop.block_q, cfg.hop.block_kv, jnp.float32, jnp.int32
    lse = ((2, 1, bq) if _lse_rows(cfg) else (2, bq, LANES), f32)
    kv = ([((sk, d), dtype)] * 2 + [((sk // bk, 2, bk), i32)] if cfg.whole_kv else
          [((2, bk, d), dtype)] * 2 + [((2, 2, bk), i32)])
    return [((2, bq, d), dtype), ((2, 2, bq, LANES), i32), ((bq, d), f32), ((bq, 2 * LANES), f32),
            ((2, bq, d), dtype), lse] + kv


def _fwd_call(cfg, sched, q_t, qmeta, kv, kmeta):
    """q_t [b, h, sq, d], qmeta [b, 2, sq, 128], kv [2, b, hk, sk, d], kmeta [b, 2, sk] -> o [b, h, sq, d]
    (q dtype), lse [b, h, sq] float32, computed-tile count int32 [1] or None. The running state between
    ring steps (``stat`` [m | l] and ``acc``, float32) and the ring buffers exist only for N > 1."""
    f32 = jnp.float32
    prog, values, const_specs = consts(cfg)
    q_t, qmeta, kv, kmeta, *values = same_vma(q_t, qmeta, kv, kmeta, *values)
    b, h, sq, d = q_t.shape
    ring = cfg.axis_size > 1
    out_shape, out_specs = outputs(cfg, q_t, (q_t.shape, q_t.dtype),
                                   ((b, h, 1, sq) if _lse_rows(cfg) else (b, h, sq, LANES), f32),
                                   ((b, h, sq, 2 * LANES), f32) if ring else None, (q_t.shape, f32) if ring else None,
                                   ((2,) + kv.shape, kv.dtype) if ring else None,
                                   ((2,) + kmeta.shape, jnp.int32) if ring else None)
    dma = pltpu.SemaphoreType.DMA
    sems = [dma(()), dma((3, 2)), dma((2, 2)), dma((2, 2)), dma((2,)), dma((2, 2)), pltpu.SemaphoreType.REGULAR]
    call = fused_call(_fwd_kernel, "ring_fused_fwd_tpu", cfg, prog, out_shape=out_shape,
                      in_specs=[ANY] * 4 + [const_specs], out_specs=out_specs,
                      scratch=vmem(_fwd_scratch(cfg, d, q_t.dtype, kv.shape[3])) + sems,
                      vmem_limit=cfg.whole_kv_limit if cfg.whole_kv else None)
    o, lse, _, _, _, _, cnt = call(*sched, q_t, qmeta, kv, kmeta, tuple(values))
    return o, lse[:, :, 0, :] if _lse_rows(cfg) else lse[..., 0], cnt


# ---------------------------------------------------------------- layout glue and custom_vjp

def _width(x, width):
    """x zero-padded on its last axis to ``width``."""
    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _pack(qs, kv):
    """[b, s, h, d] -> head-major kernel layout; positions and segments packed per side as rows [b, 2, s] (the
    forward and the two-pass backward read the queries' lane-replicated, `fused_tiles.lanes`). K and V
    travel as one buffer, so with d_v != d the narrower of q/k and v is zero-padded to the wider, ``D =
    max(d, d_v)`` (zeros change neither q.k nor o's first d_v columns; the padded gradients' columns are 0
    and cut off)."""
    width = max(qs.q.shape[-1], kv.v.shape[-1])
    meta = lambda pos, seg: jnp.stack([pos, jnp.zeros_like(pos) if seg is None else seg], 1).astype(jnp.int32)
    kv_t = jnp.stack([_width(kv.k, width), _width(kv.v, width)]).transpose(0, 1, 3, 2, 4)  # (2, b, hk, sk, D)
    return _width(qs.q, width).transpose(0, 2, 1, 3), meta(qs.pos, qs.seg), kv_t, meta(kv.pos, kv.seg)


def _schedule(cfg, qs, kv):
    """`fused_ring.schedule`'s tables, the sub-tile bounds at the sides `fused_tiles.sub_split` gives."""
    return fr.schedule(cfg, qs, kv, sub_split(cfg, consts(cfg)[0]))


def _forward(cfg, qs, kv):
    """-> o [b, sq, h, d] (q dtype), lse [b, h, sq] float32, tiles computed on this device (int32 [1]
    with ``cfg.count``, else None)."""
    q_t, qmeta, kv_t, kmeta = _pack(qs, kv)
    if cfg.whole_kv:  # key positions as (2, bk) tiles, indexed by tile in VMEM
        b, _, sk = kmeta.shape
        kmeta = kmeta.reshape(b, 2, sk // cfg.hop.block_kv, cfg.hop.block_kv).swapaxes(1, 2)  # (b, nk, 2, bk)
    o, lse, cnt = _fwd_call(cfg, _schedule(cfg, qs, kv), q_t, lanes(qmeta), kv_t, kmeta)
    return o[..., :kv.v.shape[-1]].transpose(0, 2, 1, 3), lse, cnt


def _backward(cfg, qs, kv, *, o, lse, do, dlse):
    """-> (dq, dk, dv) in the input dtypes and the tiles computed; ``dlse`` is the lse cotangent.

    d lse / d s = P, so an lse cotangent only shifts FA-2's D: dS = P o (dP - (D - dlse)).
    """
    q_t, qmeta, kv_t, kmeta = _pack(qs, kv)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))  # (b, h, sq)
    delta = delta - dlse.astype(jnp.float32)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # a row that saw nothing: every p is 0 anyway
    dq, dkv, cnt = bwd.backward_call(cfg, _schedule(cfg, qs, kv), q_t, qmeta, kv_t, kmeta,
                                     do_t=_width(do, q_t.shape[-1]).transpose(0, 2, 1, 3),
                                     lse=lse.astype(jnp.float32), delta=delta)
    home = cfg.axis_size % 2 if cfg.axis_size > 1 else 0  # after N sends (none when N == 1: one slot)
    d, d_v, scale = qs.q.shape[-1], kv.v.shape[-1], cfg.hop.scale  # the kernels add dS K and dS^T Q unscaled

    def grad(x, width, dtype, by=1.0):  # float32 [b, h, s, D] -> [b, s, h, width]; cast first, one pass of XLA
        return (by * x[..., :width]).astype(dtype).transpose(0, 2, 1, 3)
    return (grad(dq, d, qs.q.dtype, scale), grad(dkv[home, 0], d, kv.k.dtype, scale),
            grad(dkv[home, 1], d_v, kv.v.dtype), cnt)


def _int_zeros(x):
    return None if x is None else np.zeros(x.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, qs, kv):
    return _forward(cfg, qs, kv)[:2]


def _ring_fwd(cfg, qs, kv):
    o, lse, _ = _forward(cfg, qs, kv)
    return (o, lse), (qs, kv, o, lse)


def _ring_bwd(cfg, res, cotangents):
    qs, kv, o, lse = res
    do, dlse = cotangents
    dq, dk, dv, _ = _backward(cfg, qs, kv, o=o, lse=lse, do=do, dlse=dlse)
    return (QShard(dq, _int_zeros(qs.pos), _int_zeros(qs.seg)),
            KVShard(dk, dv, _int_zeros(kv.pos), _int_zeros(kv.seg), None))


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------- budget and entry points

def footprints(hop, q_shape, k_shape, dtype, *, n, has_seg=True):
    """VMEM / SMEM of the forward and the two-pass backward kernel (`budgets`): their VMEM tiles (`_fwd_scratch`,
    `fused_ring_bwd.two_pass_scratch`, all shard-length independent) plus the score-sized temporaries, and the
    SMEM tables (`fused_ring.schedule`). q [b, sq, h, d], k [b, sk, hk, d] per device; ``n`` devices. The tiles
    are chosen to fit these; the one-pass backward runs where it fits too (`_one_pass`)."""
    cfg = fr.FusedConfig(None, n, hop, has_seg, False)
    smem = _smem(cfg, q_shape, k_shape)
    temps = [((hop.block_q, hop.block_kv), jnp.float32)]
    return [budgets.Footprint(budgets.tpu_vmem_bytes(scratch=_fwd_scratch(cfg, q_shape[-1], dtype, k_shape[1]),
                                                     temps=temps * 2), smem, "the fused forward"),
            bwd.footprints(cfg, q_shape, k_shape, dtype, smem)[1]]


def _smem(cfg, q_shape, k_shape):
    """Bytes of `fused_ring.schedule`'s SMEM tables for a compiled ``cfg`` (the sub-tile bounds only where
    `fused_tiles.sub_split` splits; else two 4-entry placeholders)."""
    hop, n, split = cfg.hop, cfg.axis_size, sub_split(cfg, consts(cfg)[0])
    b, nq, nk = q_shape[0], q_shape[1] // hop.block_q, k_shape[1] // hop.block_kv
    subs = split * (b * nq * 4 + n * b * nk * 4) if split > 1 else 8
    return 4 * (3 + n * b * (nq + nk) + b * nq * 4 + n * b * nk * 4 + subs)


def _one_pass(hop, q_shape, k_shape, dtype, *, n, has_seg, chip):
    """``(one_pass, vmem_limit)`` of the backward: one pass (`fused_ring_bwd.ONE_PASS`) where its footprint,
    which holds a kv head's dK and dV of the whole shard, fits ``chip`` (always when interpreted: ``chip``
    None), with the ``vmem_limit_bytes`` it needs (None: the default holds it)."""
    cfg = fr.FusedConfig(None, n, hop, has_seg, False)
    if not bwd.ONE_PASS or not bwd.one_pass_applies(cfg, consts(cfg)[0], chip):
        return False, None
    if chip is None:
        return True, None
    one = bwd.footprints(cfg, q_shape, k_shape, dtype, _smem(cfg, q_shape, k_shape))[0]
    return (True, budgets.vmem_limit(chip, [one])) if budgets.fits(chip, one) else (False, None)


def _whole_kv(hop, q_shape, k_shape, dtype, *, n, has_seg, chip):
    """``(whole_kv, vmem_limit)`` of the forward: a kv head's K/V of the shard whole in VMEM (:data:`WHOLE_KV`)
    where it serves more than one query head (GQA) and fits ``chip`` (always when interpreted: ``chip`` None),
    with the ``vmem_limit_bytes`` it needs. Measured on a v5e (1024 x 1024 tiles, 8K and 16K tokens): at
    32 / 8 heads whole K/V was 1-7 % faster than streaming (a K/V tile read once per head group, not once
    per query head); at 8 / 8 heads, where nothing is shared, 0-5 % slower (the head's K/V copy in is
    not overlapped), so there the forward streams (tune_forms, tune_forms_gqa in benchmarks/results)."""
    if not WHOLE_KV or q_shape[2] == k_shape[2]:
        return False, None
    if chip is None:
        return True, None
    cfg = fr.FusedConfig(None, n, hop, has_seg, False, whole_kv=True)
    temps = [((hop.block_q, hop.block_kv), jnp.float32)] * 2
    need = budgets.Footprint(budgets.tpu_vmem_bytes(scratch=_fwd_scratch(cfg, q_shape[-1], dtype, k_shape[1]),
                                                    temps=temps), _smem(cfg, q_shape, k_shape),
                             "the fused forward, K/V whole")
    return (True, budgets.vmem_limit(chip, [need])) if budgets.fits(chip, need) else (False, None)


# The tile side measured on a TPU v5e (JAX 0.10.2, `benchmarks/tune_tpu.py --kernels fused_fwd,fused_bwd`,
# 2026-12-06; benchmarks/results/tpu_v5e_2026-12-06_tune_fused.jsonl): a ring of one chip, bfloat16, d = 128,
# 8 heads, 4K and 16K tokens, causal or not, every pair of {512, 1024, 2048}. 1024 x 1024 was within 3 % of
# the best pair of each kernel in every case (the best: the forward 2048 x 1024 non-causal, 1024 x 1024
# causal; the backward 1024 x 1024 but at 16K non-causal, 2048 x 2048, 2.7 % faster); the earlier cap of
# 128 ran 4-6x slower. The chip's VMEM budget shrinks it where it does not fit.
TUNED = 1024


def default_blocks(q_shape, k_shape, dtype, device, *, n=8):
    """``(block_q, block_kv)`` when the caller gives none, compiled for ``device``: the largest tiles up
    to the chip-measured :data:`TUNED` side that Mosaic's tile rule allows and that fit the chip (forward
    and backward kernel); None (``default_block``) when interpreted. ``n``: the ring size (the SMEM
    tables grow with it)."""
    if device.platform != "tpu":
        return None
    est = lambda bq, bk: footprints(HopConfig(block_q=bq, block_kv=bk), q_shape, k_shape, dtype, n=n)  # noqa: E731
    return budgets.default_tiles(budgets.chip(device.device_kind), est, q_shape[1], k_shape[1],
                                 q_multiple=SUBLANES, kv_multiple=LANES, top=TUNED)


def make_config(qs, kv, cfg, *, axis_name, interpret=None, _handshake=True, count=False):
    """Validate the per-device shards and return the static `fused_ring.FusedConfig` (call inside
    ``shard_map``). Compiled, the tiles are checked against the chip's VMEM and SMEM (`budgets`)
    before anything is lowered; a ValueError names block_q / block_kv and what fits."""
    hop = check_kernel_call(IMPL, qs, kv, cfg)
    try:
        axis_size = int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(f"impl={IMPL!r}: axis_name {axis_name!r} is not a mesh axis of an enclosing "
                         f"jax.shard_map; call it on per-device shards inside shard_map") from None
    interpret = interpret_mode(IMPL) if interpret is None else interpret
    (sq, sk), limit, chip = (qs.q.shape[1], kv.k.shape[1]), None, target_chip(interpret)
    if chip is not None:
        if (hop.block_q != sq and hop.block_q % SUBLANES) or (hop.block_kv != sk and hop.block_kv % LANES):
            raise ValueError(f"impl={IMPL!r}: TPU tiles need block_q % {SUBLANES} == 0 (or block_q == sq) and "
                             f"block_kv % {LANES} == 0 (or block_kv == sk); got block_q={hop.block_q}, sq={sq}, "
                             f"block_kv={hop.block_kv}, sk={sk}")
        width = max(qs.q.shape[-1], kv.v.shape[-1])  # q, K and V as `_pack` pads them
        est = lambda c: footprints(c, qs.q.shape[:-1] + (width,), kv.k.shape[:-1] + (width,),  # noqa: E731
                                    qs.q.dtype, n=axis_size, has_seg=qs.seg is not None)
        limit = check_budget(IMPL, chip, est, hop, q_blocks=budgets.candidate_blocks(sq, multiple=SUBLANES, top=2048),
                             kv_blocks=budgets.candidate_blocks(sk, multiple=LANES, top=2048),
                             shape=f"head dim {width}, {jnp.dtype(qs.q.dtype).name}")
    width = max(qs.q.shape[-1], kv.v.shape[-1])
    one_pass, one_pass_limit = _one_pass(hop, qs.q.shape[:-1] + (width,), kv.k.shape[:-1] + (width,), qs.q.dtype,
                                         n=axis_size, has_seg=qs.seg is not None, chip=chip)
    whole_kv, whole_kv_limit = _whole_kv(hop, qs.q.shape[:-1] + (width,), kv.k.shape[:-1] + (width,), qs.q.dtype,
                                         n=axis_size, has_seg=qs.seg is not None, chip=chip)
    return fr.FusedConfig(axis_name=axis_name, axis_size=axis_size, hop=hop, has_seg=qs.seg is not None,
                          interpret=interpret, handshake=_handshake, count=count, vmem_limit=limit,
                          one_pass=one_pass, one_pass_limit=one_pass_limit, whole_kv=whole_kv,
                          whole_kv_limit=whole_kv_limit)


def fused_ring_attention_shard(qs, kv, cfg, *, axis_name, interpret=None, return_lse=False, _handshake=True):
    """Ring attention over mesh axis ``axis_name`` in one fused Pallas TPU kernel (call inside shard_map).

    Per-device shards: qs = QShard(q [b, sq, h, d], pos int32 [b, sq], seg int32 [b, sq] or None);
    kv = KVShard(k, v [b, sk, hk, d] (h % hk == 0, GQA), pos int32 [b, sk], seg or None, bias None)
    (this host's own K/V, marked by ``masks.mark_bad_keys``; any layout of true positions);
    cfg = HopConfig (scale, causal, window, block_q / block_kv clamped to the shard, dividing it).
    Returns o [b, sq, h, d] in q's dtype (and lse [b, h, sq] float32 with ``return_lse=True``).
    Differentiable (``jax.custom_vjp``; the backward is a second fused ring kernel in which dK/dV
    travel with K/V).

    ``interpret``: None -> `tiles.interpret_mode` on the mesh's platform (CPU: the TPU interpreter with
    race detection; TPU, real or abstract: compiled; elsewhere a ValueError); or a
    ``pltpu.InterpretParams`` / bool for ``pallas_call``. ``_handshake=False`` drops the per-hop
    handshake (tests only: it makes the kernel racy).
    """
    fcfg = make_config(qs, kv, cfg, axis_name=axis_name, interpret=interpret, _handshake=_handshake)
    o, lse = _ring(fcfg, qs, kv)
    return (o, lse) if return_lse else o
