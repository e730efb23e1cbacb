"""The fused TPU ring's backward kernels (``pallas_tpu_fused``): FA-2 Alg. 2 with the ring as the outer loop.

dQ stays home and accumulates in HBM over the ring steps; dK/dV travel with K/V (``dkv``, float32) and make
one extra hop after the last step to arrive home (Ring Attention, Sec. 3). Two forms of one ring step:

- **one pass** (`_one_pass_kernel`, where it fits): the held shard's K, V and dK, dV of one (batch row, kv
  head) sit whole in VMEM ([sk, d] each; dK, dV float32) while that head group's Q tiles run through the
  shard's K/V tiles, read in place; Q tiles are double-buffered (the next one's q, dO, statistics copied in
  under this one's compute, its dQ written back asynchronously). S and dP once a tile, 5 matmuls (S, dP,
  dV, dK, dQ), as the per-hop kernel's fused backward (``pallas_tpu._bwd_fused_kernel``). Each finished
  (batch row, kv head) of dK/dV is sent on at once, so its transfer overlaps the next one's compute.
- **two passes** (`_two_pass_kernel`, the fallback: VMEM independent of the shard length): pass B (K/V
  tiles outer, the GQA group's Q tiles streamed) accumulates dK/dV a tile at a time, its send then
  overlaps pass A (Q tiles outer, K/V tiles streamed), which adds dQ. 7 matmuls a tile: S and dP twice.

Both add unscaled dS K and dS^T Q (the caller multiplies by the scale once, at the end: dK from Q as given
is as accurate as dQ), skip empty tiles and compute the built-in mask only on partial ones
(`fused_ring.by_kind`); the one-pass kernel runs a partial tile as 2 x 2 sub-tiles (`fused_tiles.sub_split`)
and a full one as 256-key chunks (``pallas_tpu.BWD_KEY_CHUNK``, as the per-hop kernel's backward).

On a ring of one v5e chip (1024 x 1024 tiles, 8 heads, bf16) the one-pass backward took 17.8 ms at 16K tokens
non-causal and 10.5 causal, the per-hop kernel's fused backward 17.7 and 10.8, the two-pass one 25.9 and 16.5
(docs/benchmarks.md, sixth chip session).
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import budgets
from ringattn_fast.kernels import fused_ring as fr
from ringattn_fast.kernels.fused_ring import I32
from ringattn_fast.kernels.fused_tiles import (ANY, LANES, SUBLANES, consts, dot, fused_call, kernel_shape, key_tiles,
                                               lanes, logits, outputs, query_head, ring_buffers, sub_split, unflatten,
                                               vmem)
from ringattn_fast.kernels import pallas_tpu
from ringattn_fast.kernels.pallas_tpu import key_major_grads
from ringattn_fast.kernels.tiles import finite_keys, same_vma
from ringattn_fast.masks import masked_grad

ONE_PASS = True  # `_one_pass_kernel` where it fits (benchmarks/tune_tpu.py --kernels fused_bwd,fused_bwd_two_pass)
_TN, _NN = ((0,), (0,)), ((1,), (0,))


def _grads(cfg, fn, q, do, st, qm, k, v, km, masked):
    """P, dS of one tile (FA-2 Alg. 2 lines 11-20), fp32 (bq, bk); st (bq, 256) = [lse | delta]; dS taken
    back through the tile's program (``fn``, as `fused_tiles.logits`) to the scaled logits."""
    s, pull = logits(cfg, fn, q, k, qm, km, grad=True, masked=masked)
    p = jnp.exp(s - st[:, :1])                                               # P = exp(S - lse), masked: 0
    ds = masked_grad(p, dot(do, v, ((1,), (1,))), st[:, LANES:LANES + 1])   # dS = P (dP - D)
    return p, ds if pull is None else pull(ds, p)


def _opening(cfg, ring_ref, kv_ring, kv_hbm, kmeta_ring, kmeta_hbm, cnt_ref, sem, send_sem, recv_sem, cap_sem):
    """Both kernels' step opening: the `fused_ring.Ring`, K/V's remote sends (started at steps 0 .. N-2,
    after the handshake that also covers the dK/dV slot this step writes)."""
    def init():
        if cnt_ref is not None:
            cnt_ref[0] = 0

    ring = fr.prologue(cfg, ring_ref, [(kv_ring, kv_hbm), (kmeta_ring, kmeta_hbm)], init, sem)
    kv_copies = [] if ring.n == 1 else fr.remote_sends(cfg, ((0, kv_ring), (1, kmeta_ring)), send_sem, recv_sem,
                                                       ring.slot, ring.right)
    fr.wait_cap(cfg, ring, cap_sem, fr.last_send(ring.n, backward=True))

    @pl.when(ring.step < ring.n - 1)
    def _():
        for c in kv_copies:
            c.start()
    return ring, kv_copies


def _count(cnt_ref):
    if cnt_ref is not None:
        cnt_ref[0] += 1


def _acc_in(first, load, src, accs, sem):
    """float32 accumulators ``accs`` (dK and dV, or dQ) into VMEM: zeros at step 0, else, where ``load``, what
    HBM holds (``src(a)``: the view for ``accs[a]``, e.g. the ``dkv`` slot's dK for a = 0, dV for a = 1);
    elsewhere they are not read."""
    @pl.when(first)
    def _():
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(jnp.logical_not(first) & load)
    def _():
        for a, acc in enumerate(accs):
            fr.copy(src(a), acc, sem)


def _load_q_side(refs, tiles, bi, hi, rows, sem, masked):
    """Copy one Q tile's q, dO, [lse | delta] (and positions) from HBM into VMEM."""
    q_hbm, do_hbm, stat_hbm, qmeta_hbm = refs
    q_v, do_v, st_v, qm_v = tiles
    for src, dst in ((q_hbm, q_v), (do_hbm, do_v), (stat_hbm, st_v)):
        fr.copy(src.at[bi, hi, rows, :], dst, sem)
    if masked:
        fr.copy(qmeta_hbm.at[bi, :, rows, :], qm_v, sem)


def _kv_pairs(cfg, held, bi, kv_head, cols, tiles):
    """The `fused_ring.Stream` pairs of the held shard's K/V tiles (and key positions) of one kv head;
    ``held`` = (K/V, key metadata) in HBM (`fused_ring.held`)."""
    (kv_src, kmeta_src), (k_s, v_s, km_s) = held, tiles
    pairs = [(lambda j: kv_src.at[I32(0), bi, kv_head, cols(j), :], k_s),
             (lambda j: kv_src.at[I32(1), bi, kv_head, cols(j), :], v_s)]
    return tuple(pairs + ([(lambda j: kmeta_src.at[bi, :, cols(j)], km_s)] if cfg.masked else []))


def _one_pass_kernel(cfg, prog, ring_ref, q_live_ref, k_live_ref, qb_ref, kb_ref, qsb_ref, ksb_ref,  # SMEM
                     q_hbm, do_hbm, stat_hbm, qrow_hbm, kv_hbm, kmeta_hbm, const_refs,   # inputs (HBM)
                     dq_hbm, kv_ring, kmeta_ring, dkv_ring, cnt_ref,                     # outputs (HBM; cnt SMEM)
                     dk_v, dv_v, k_v, v_v, km_v, q_v, do_v, st_v, qm_v, dq_in, dq_v, qs_v,  # VMEM
                     sem, q_sems, wb_sems, kv_sems, send_sem, recv_sem, cap_sem):
    """Grid = ring steps. Per step, per (batch row bi, kv head): the held shard's K, V (and key positions)
    of that head and its dK, dV (zeros at step 0) into VMEM, then each live Q tile of the head group runs
    through the shard's K/V tiles, read in place; then dK, dV back to the ``dkv`` slot and sent to the
    right neighbour's other slot. Every send is waited on at the step's end.

    Q tiles are double-buffered: tile t + 1's q, dO, [lse; delta] and positions (and its dQ so far, after
    step 0) are copied in while tile t computes, and tile t's dQ goes back to HBM while t + 1 computes
    (waited on two tiles later, when its buffer comes round again). On a v5e these copies, waited on
    in place, cost 2-9 % of the backward (docs/benchmarks.md, sixth chip session).

    The tile is key-major, as the per-hop fused backward's (``pallas_tpu.key_major_grads``): S^T = K
    (scale Q)^T is (bk, bq), lse and delta are the (1, bq) rows of ``stat`` [b, h, 2, sq], query positions
    rows of ``qrow`` [b, 2, sq], key positions (2, bk) tiles of ``kmeta`` [b, nk, 2, bk]; dV_j += P^T dO and
    dK_j += dS^T Q are plain matmuls, dQ += dS K transposes dS^T once. No program (`one_pass_applies`)."""
    del const_refs
    b, h, hk, nq, nk = kernel_shape(cfg, q_hbm.shape, kv_hbm.shape)
    bq, bk, group, seg, split = cfg.hop.block_q, cfg.hop.block_kv, h // hk, cfg.has_seg, sub_split(cfg, prog)
    ring, kv_copies = _opening(cfg, ring_ref, kv_ring, kv_hbm, kmeta_ring, kmeta_hbm, cnt_ref, sem, send_sem,
                               recv_sem, cap_sem)
    held = fr.held(ring, kv_hbm, kv_ring), fr.held(ring, kmeta_hbm, kmeta_ring)
    n, slot, first = ring.n, ring.slot, ring.step == 0
    tables, shape, count = (qb_ref, kb_ref), (b, nq, nk), group * nq  # count: Q tiles of one head group
    rows = lambda i: pl.ds(i * I32(bq), bq)  # noqa: E731
    # A tile not split runs as key chunks, as the per-hop fused backward's (`pallas_tpu.BWD_KEY_CHUNK`): each adds
    # its keys' dK/dV rows and its share of dQ_i. On a v5e (ring of one, 1024 x 1024 tiles, 8 heads, bf16;
    # `tpu_checks --checks variants --variant-path fused`, 2026-12-07) 256-key chunks took 0.4-3.5 % off the
    # forward+backward at 8K and 16K tokens (the forward's 1024-query tile in 512-row chunks did not help: -0.6 to
    # +0.5 %, so `fused_ring_fwd` runs its tiles whole).
    chunks = [(slice(None), keys) for keys in pallas_tpu._chunks(bk, pallas_tpu.BWD_KEY_CHUNK)]

    def dkv_sends(bi, kv_head):  # this (batch row, kv head)'s dK, dV: my slot -> the right neighbour's other slot
        return [pltpu.make_async_remote_copy(dkv_ring.at[slot, I32(a), bi, kv_head],
                                             dkv_ring.at[I32(1) - slot, I32(a), bi, kv_head], send_sem.at[I32(2)],
                                             recv_sem.at[I32(2), I32(1) - slot], device_id={cfg.axis_name: ring.right})
                for a in (0, 1)]

    def q_loads(bi, kv_head, t, buf, action):  # Q tile t's inputs -> buffer buf: start or wait them (`action`)
        hi, i = query_head(kv_head, t, group, nq)
        pairs = [(q_hbm.at[bi, hi, rows(i), :], q_v), (do_hbm.at[bi, hi, rows(i), :], do_v),
                 (stat_hbm.at[bi, hi, :, rows(i)], st_v)]
        pairs += [(qrow_hbm.at[bi, :, rows(i)], qm_v)] if cfg.masked else []
        for a, (src, dst) in enumerate(pairs):
            action(pltpu.make_async_copy(src, dst.at[buf], q_sems.at[I32(a), buf]))
        if n > 1:  # dQ so far: none at step 0
            pl.when(jnp.logical_not(first))(lambda: action(pltpu.make_async_copy(
                dq_hbm.at[bi, hi, rows(i), :], dq_in.at[buf], q_sems.at[I32(4), buf])))

    def write_back(bi, kv_head, t, buf):  # Q tile t's dQ: VMEM buffer buf -> HBM
        hi, i = query_head(kv_head, t, group, nq)
        return pltpu.make_async_copy(dq_v.at[buf], dq_hbm.at[bi, hi, rows(i), :], wb_sems.at[buf])

    live = lambda bi, t: fr.live(q_live_ref, ring.kv_idx, bi, lax.rem(t, I32(nq)), b, nq)  # noqa: E731
    writes = lambda bi, t: first | live(bi, t)  # noqa: E731  Q tiles whose dQ goes to HBM (all of them at step 0)

    def q_tile(bi, kv_head, t, carry):
        i, buf, nxt = lax.rem(t, I32(nq)), lax.rem(t, I32(2)), t + I32(1)

        @pl.when((nxt < I32(count)) & live(bi, jnp.minimum(nxt, I32(count - 1))))
        def _():  # its buffer held tile t - 1, whose compute is done
            q_loads(bi, kv_head, nxt, I32(1) - buf, lambda c: c.start())

        @pl.when((t >= I32(2)) & writes(bi, jnp.maximum(t - I32(2), I32(0))))
        def _():  # tile t - 2 wrote dQ from this buffer
            write_back(bi, kv_head, t - I32(2), buf).wait()

        @pl.when(live(bi, t))
        def _():
            q_loads(bi, kv_head, t, buf, lambda c: c.wait())
            qs_v[...] = (q_v[buf].astype(jnp.float32) * cfg.hop.scale).astype(qs_v.dtype)  # once per Q tile

        @pl.when(first)
        def _():
            dq_v[buf] = jnp.zeros(dq_v.shape[1:], jnp.float32)
        if n > 1:
            @pl.when(jnp.logical_not(first) & live(bi, t))
            def _():
                dq_v[buf] = dq_in[buf]

        def fold(j, masked, qp=slice(None), kp=slice(None)):  # the tile, or its sub-tile (rows qp, keys kp)
            start, size = (0, bk) if kp.start is None else (kp.start, kp.stop - kp.start)
            keys = pl.ds(pl.multiple_of(j * I32(bk) + I32(start), size), size)  # these keys' rows of K, V, dK, dV
            do, k = do_v[buf, qp, :], k_v[keys, :]
            # the (2, n) rows loaded whole, a sub-tile's part sliced from the value: the TPU v4's Mosaic refuses
            # to load part of one row of a 2-row VMEM array (its lane tiles are not contiguous)
            st = st_v[buf]

            def pos_rows(ref):  # (positions, segment ids) rows, read only on a masked tile
                x = ref[...] if masked else None
                return (None, None) if x is None else (x[0:1], x[1:2] if seg else None)
            (q_pos, q_seg), (k_pos, k_seg) = pos_rows(qm_v.at[buf]), pos_rows(km_v.at[j])
            pt, dst = key_major_grads(k, qs_v[qp, :], v_v[keys, :], do, st[0:1], st[1:2], q_pos, k_pos, q_seg,
                                      k_seg, cfg.hop, masked, part=(qp, kp))
            dv_v[keys, :] += dot(pt.astype(do.dtype), do, _NN)                  # dV_j += P^T dO_i
            dk_v[keys, :] += dot(dst.astype(k.dtype), q_v[buf, qp, :], _NN)     # dK_j += dS^T Q_i (scale: caller)
            dq_v[buf, qp, :] += dot(dst.T.astype(k.dtype), finite_keys(k), _NN)  # dQ_i += dS K_j; masked NaN key: 0

        def k_tile(j, c):
            @pl.when(jnp.logical_not(fr.tile_empty(cfg, tables, shape, kv_idx=ring.kv_idx, bi=bi, i=i, j=j)))
            def _():
                _count(cnt_ref)
                fr.by_kind(cfg, tables, shape, functools.partial(fold, j), kv_idx=ring.kv_idx, bi=bi, i=i, j=j,
                           split=split, sub_tables=(qsb_ref, ksb_ref), chunks=chunks)
            return c

        @pl.when(live(bi, t))
        def _():
            lax.fori_loop(I32(0), I32(nk), k_tile, I32(0))
        pl.when(writes(bi, t))(lambda: write_back(bi, kv_head, t, buf).start())
        return carry

    def head(t, carry):  # one (batch row, kv head): its K, V, dK, dV resident while the group's Q tiles run
        bi, kv_head = unflatten(t, (b, hk))
        touched = first | fr.any_live(k_live_ref, ring.kv_idx, bi, b, nk)  # else dK, dV pass through as received
        # each on its own semaphore: a DMA semaphore counts bytes, so a wait for dK on one that K's copy
        # also signals could return before dK has landed
        kv_loads = [pltpu.make_async_copy(held[0].at[I32(a), bi, kv_head], dst, kv_sems.at[I32(a)])
                    for a, dst in ((0, k_v), (1, v_v))]
        kv_loads += [pltpu.make_async_copy(held[1].at[bi], km_v, kv_sems.at[I32(2)])] if cfg.masked else []

        @pl.when(touched)
        def _():  # under the dK, dV copies in
            for c in kv_loads:
                c.start()

        _acc_in(first, touched, lambda a: dkv_ring.at[slot, I32(a), bi, kv_head], (dk_v, dv_v), sem)

        @pl.when(touched)
        def _():
            for c in kv_loads:
                c.wait()
            pl.when(live(bi, I32(0)))(lambda: q_loads(bi, kv_head, I32(0), I32(0), lambda c: c.start()))
            lax.fori_loop(I32(0), I32(count), functools.partial(q_tile, bi, kv_head), I32(0))
            for tail in range(max(count - 2, 0), count):  # the write-backs no later tile waited on
                pl.when(writes(bi, I32(tail)))(lambda t=tail: write_back(bi, kv_head, I32(t), I32(t % 2)).wait())
            fr.copy(dk_v, dkv_ring.at[slot, I32(0), bi, kv_head], sem)
            fr.copy(dv_v, dkv_ring.at[slot, I32(1), bi, kv_head], sem)
        if n > 1:
            for c in dkv_sends(bi, kv_head):
                c.start()  # every step, the last one included: the N-th move brings dK/dV home
        return carry

    lax.fori_loop(I32(0), I32(b * hk), head, I32(0))

    @pl.when(ring.step < n - 1)
    def _():
        fr.finish(kv_copies)
    if n > 1:
        def wait(t, carry):
            fr.finish(dkv_sends(*unflatten(t, (b, hk))))  # one wait per send, each of its own size
            return carry
        lax.fori_loop(I32(0), I32(b * hk), wait, I32(0))
    fr.signal_cap(cfg, ring, cap_sem, fr.last_send(n, backward=True))


def _two_pass_kernel(cfg, prog, ring_ref, q_live_ref, k_live_ref, qb_ref, kb_ref, qsb_ref, ksb_ref,  # SMEM
                     q_hbm, do_hbm, stat_hbm, qmeta_hbm, kv_hbm, kmeta_hbm, const_refs,  # inputs (HBM; consts VMEM)
                     dq_hbm, kv_ring, kmeta_ring, dkv_ring, cnt_ref,                     # outputs (HBM; cnt SMEM)
                     k_v, v_v, km_v, dk_v, dv_v, q_s, do_s, st_s, qm_s,                  # pass B tiles (dK, dV)
                     q_v, do_v, st_v, qm_v, dq_v, k_s, v_s, km_s,                        # pass A tiles (dQ)
                     sem, q_sems, kv_sems, send_sem, recv_sem, cap_sem):
    """Per ring step, pass B then pass A (module docstring). dK/dV make N sends (K/V make N-1): the last
    step sends only ``dkv``, and the device receives its own shard's dK/dV into slot N % 2."""
    del qsb_ref, ksb_ref  # whole tiles here
    b, h, hk, nq, nk = kernel_shape(cfg, q_hbm.shape, kv_hbm.shape)
    bq, bk, group = cfg.hop.block_q, cfg.hop.block_kv, h // hk
    ring, kv_copies = _opening(cfg, ring_ref, kv_ring, kv_hbm, kmeta_ring, kmeta_hbm, cnt_ref, sem, send_sem,
                               recv_sem, cap_sem)
    held = fr.held(ring, kv_hbm, kv_ring), fr.held(ring, kmeta_hbm, kmeta_ring)
    n, slot, first = ring.n, ring.slot, ring.step == 0
    dkv_copies = [] if n == 1 else fr.remote_sends(cfg, ((2, dkv_ring),), send_sem, recv_sem, slot, ring.right)
    tables, shape = (qb_ref, kb_ref), (b, nq, nk)
    rows, cols = (lambda i: pl.ds(i * I32(bq), bq)), (lambda j: pl.ds(j * I32(bk), bk))

    def kv_tile(t, carry):  # pass B: dK_j, dV_j += over the group's heads and my Q tiles
        bi, kv_head, j = unflatten(t, (b, hk, nk))
        live = fr.live(k_live_ref, ring.kv_idx, bi, j, b, nk)  # not live: dK_j, dV_j pass through untouched

        @pl.when(live)
        def _():
            fr.copy(held[0].at[I32(0), bi, kv_head, cols(j), :], k_v, sem)
            fr.copy(held[0].at[I32(1), bi, kv_head, cols(j), :], v_v, sem)
            if cfg.masked:
                fr.copy(held[1].at[bi, :, cols(j)], km_v, sem)

        _acc_in(first, live, lambda a: dkv_ring.at[slot, I32(a), bi, kv_head, cols(j), :], (dk_v, dv_v), sem)

        head = lambda u: query_head(kv_head, u, group, nq)[0]  # noqa: E731  query head of stream tile u
        pairs = [(lambda u: q_hbm.at[bi, head(u), rows(lax.rem(u, I32(nq))), :], q_s),
                 (lambda u: do_hbm.at[bi, head(u), rows(lax.rem(u, I32(nq))), :], do_s),
                 (lambda u: stat_hbm.at[bi, head(u), rows(lax.rem(u, I32(nq))), :], st_s)]
        pairs += [(lambda u: qmeta_hbm.at[bi, :, rows(lax.rem(u, I32(nq))), :], qm_s)] if cfg.masked else []

        def fold(u, buf, masked):
            q, do = q_s[buf], do_s[buf]
            p, ds = _grads(cfg, (prog, const_refs, head(u)), q, do, st_s[buf], qm_s.at[buf], k_v[...], v_v[...],
                           km_v, masked)
            dv_v[...] += dot(p.astype(do.dtype), do, _TN)   # dV_j += P^T dO_i
            dk_v[...] += dot(ds.astype(q.dtype), q, _TN)    # dK_j += dS^T Q_i (scale: the caller)

        def q_tile(u, buf):
            fr.by_kind(cfg, tables, shape, functools.partial(fold, u, buf), kv_idx=ring.kv_idx, bi=bi,
                       i=lax.rem(u, I32(nq)), j=j)

        tile_empty = lambda u: fr.tile_empty(cfg, tables, shape,  # noqa: E731
                                             kv_idx=ring.kv_idx, bi=bi, i=lax.rem(u, I32(nq)), j=j)
        pl.when(live)(lambda: fr.stream_tiles(group * nq, fr.Stream(tuple(pairs), q_sems), tile_empty, q_tile))

        @pl.when(live | first)
        def _():
            fr.copy(dk_v, dkv_ring.at[slot, I32(0), bi, kv_head, cols(j), :], sem)
            fr.copy(dv_v, dkv_ring.at[slot, I32(1), bi, kv_head, cols(j), :], sem)
        return carry

    def dq_tile(t, carry):  # pass A: dQ_i += over the held shard's K/V tiles
        bi, hi, i = unflatten(t, (b, h, nq))
        kv_head, live = hi // I32(group), fr.live(q_live_ref, ring.kv_idx, bi, i, b, nq)
        pl.when(live)(lambda: _load_q_side((q_hbm, do_hbm, stat_hbm, qmeta_hbm), (q_v, do_v, st_v, qm_v), bi, hi,
                                           rows(i), sem, cfg.masked))

        _acc_in(first, live, lambda _: dq_hbm.at[bi, hi, rows(i), :], (dq_v,), sem)

        def fold(buf, masked):
            k = k_s[buf]
            _, ds = _grads(cfg, (prog, const_refs, hi), q_v[...], do_v[...], st_v[...], qm_v, k, v_s[buf],
                           km_s.at[buf], masked)
            dq_v[...] += dot(ds.astype(k.dtype), finite_keys(k), _NN)  # a masked NaN key: 0 (scale: the caller)

        def k_tile(j, buf):
            _count(cnt_ref)
            fr.by_kind(cfg, tables, shape, functools.partial(fold, buf), kv_idx=ring.kv_idx, bi=bi, i=i, j=j)

        stream = fr.Stream(_kv_pairs(cfg, held, bi, kv_head, cols, (k_s, v_s, km_s)), kv_sems)
        tile_empty = lambda j: fr.tile_empty(cfg, tables, shape, kv_idx=ring.kv_idx, bi=bi, i=i, j=j)  # noqa: E731
        pl.when(live)(lambda: fr.stream_tiles(nk, stream, tile_empty, k_tile))
        pl.when(live | first)(lambda: fr.copy(dq_v, dq_hbm.at[bi, hi, rows(i), :], sem))
        return carry

    lax.fori_loop(I32(0), I32(b * hk * nk), kv_tile, I32(0))
    for c in dkv_copies:
        c.start()  # every step, the last one included: it carries dK/dV home; overlaps pass A
    lax.fori_loop(I32(0), I32(b * h * nq), dq_tile, I32(0))

    @pl.when(ring.step < n - 1)
    def _():
        fr.finish(kv_copies)
    fr.finish(dkv_copies)
    fr.signal_cap(cfg, ring, cap_sem, fr.last_send(n, backward=True))


def _q_side(cfg, d, dtype):
    bq, f32, i32 = cfg.hop.block_q, jnp.float32, jnp.int32
    return ((bq, d), dtype), ((bq, 2 * LANES), f32), ((2, bq, LANES), i32)


def two_pass_scratch(cfg, d, dtype):
    """(shape, dtype) of `_two_pass_kernel`'s VMEM tiles, in kernel order (none grows with the shard)."""
    bk, f32 = cfg.hop.block_kv, jnp.float32
    q, st, qm = _q_side(cfg, d, dtype)
    k, km = ((bk, d), dtype), ((2, bk), jnp.int32)
    two = lambda t: ((2,) + t[0], t[1])  # noqa: E731  double-buffered
    return ([k, k, km, ((bk, d), f32), ((bk, d), f32), two(q), two(q), two(st), two(qm)]
            + [q, q, st, qm, ((cfg.hop.block_q, d), f32), two(k), two(k), two(km)])


def one_pass_scratch(cfg, d, dtype, sk):
    """(shape, dtype) of `_one_pass_kernel`'s VMEM, in kernel order: one kv head's dK, dV ([sk, d] float32
    each), K, V ([sk, d]) and key positions ((nk, 2, block_kv) tiles) of the shard; then, double-buffered,
    a Q tile's q, dO, [lse; delta] and positions as rows, its dQ so far (N > 1; else a placeholder) and its
    dQ; the scaled q."""
    bq, bk, f32, i32 = cfg.hop.block_q, cfg.hop.block_kv, jnp.float32, jnp.int32
    two = lambda shape, dt: ((2,) + shape, dt)  # noqa: E731  double-buffered
    dq_in = two((bq, d), f32) if cfg.axis_size > 1 else ((1, SUBLANES, LANES), f32)
    return [((sk, d), f32), ((sk, d), f32), ((sk, d), dtype), ((sk, d), dtype), ((sk // bk, 2, bk), i32),
            two((bq, d), dtype), two((bq, d), dtype), two((2, bq), f32), two((2, bq), i32), dq_in, two((bq, d), f32),
            ((bq, d), dtype)]


def one_pass_applies(cfg, prog, chip):
    """Whether the one-pass kernel can run this call: no program (its tile is key-major, the programs'
    tables are query-major) and, compiled, lse / delta / positions rows of block_q a multiple of 128 lanes."""
    return prog is None and (chip is None or cfg.hop.block_q % LANES == 0)


def footprints(cfg, q_shape, k_shape, dtype, smem):
    """`budgets.Footprint` of each backward form, ``(one pass, two passes)``: VMEM scratch plus the
    score-sized float32 temporaries (two more for float32 inputs: Mosaic's bfloat16 parts of full-precision
    matmuls, as ``pallas_tpu._split_temps``). q [b, sq, h, d], k [b, sk, hk, d]; ``smem``: the tables' bytes."""
    d, sk = q_shape[-1], k_shape[1]
    temps = [((cfg.hop.block_q, cfg.hop.block_kv), jnp.float32)] * (3 + (2 if jnp.dtype(dtype) == jnp.float32 else 0))
    return (budgets.Footprint(budgets.tpu_vmem_bytes(scratch=one_pass_scratch(cfg, d, dtype, sk), temps=temps), smem,
                              "the fused one-pass backward"),
            budgets.Footprint(budgets.tpu_vmem_bytes(scratch=two_pass_scratch(cfg, d, dtype), temps=temps[:3]), smem,
                              "the fused backward"))


def backward_call(cfg, sched, q_t, qmeta, kv, kmeta, *, do_t, lse, delta):
    """q_t, do_t [b, h, sq, d], qmeta [b, 2, sq] (query positions, segment ids), kv [2, b, hk, sk, d], kmeta [b, 2, sk],
    lse, delta [b, h, sq] float32 -> dq [b, h, sq, d] float32, dkv ring [2, 2, b, hk, sk, d] float32 (home: slot
    N % 2; one slot on a ring of one), both unscaled (times the softmax scale: the caller), computed-tile
    count or None. One pass where ``cfg.one_pass``: lse and delta as rows [b, h, 2, sq], key positions as
    tiles [b, nk, 2, bk]; else [lse | delta] lane-replicated [b, h, sq, 256] and query positions
    lane-replicated [b, 2, sq, 128] (the two-pass kernel's query-major columns)."""
    f32 = jnp.float32
    prog, values, const_specs = consts(cfg)
    if cfg.one_pass:
        stat = jnp.stack([lse, delta], axis=2)                                                    # (b, h, 2, sq)
        kmeta = key_tiles(kmeta, cfg.hop.block_kv)                                               # (b, nk, 2, bk)
    else:
        stat = jnp.concatenate([lanes(lse), lanes(delta)], axis=-1)                             # (b, h, sq, 256)
        qmeta = lanes(qmeta)                                                                     # (b, 2, sq, 128)
    q_t, do_t, stat, qmeta, kv, kmeta, *values = same_vma(q_t, do_t, stat, qmeta, kv, kmeta, *values)
    out_shape, out_specs = outputs(cfg, q_t, (q_t.shape, f32), *ring_buffers(cfg, kv, kmeta),
                                   ((fr.ring_slots(cfg.axis_size),) + kv.shape, f32))
    d, dma = q_t.shape[-1], pltpu.SemaphoreType.DMA
    if cfg.one_pass:
        kernel, name, limit = _one_pass_kernel, "ring_fused_bwd_one_pass_tpu", cfg.one_pass_limit
        scratch = vmem(one_pass_scratch(cfg, d, q_t.dtype, kv.shape[3])) + [dma(()), dma((5, 2)), dma((2,)),
                                                                             dma((3,))]
    else:
        kernel, name, limit = _two_pass_kernel, "ring_fused_bwd_tpu", None
        scratch = vmem(two_pass_scratch(cfg, d, q_t.dtype)) + [dma(()), dma((4, 2)), dma((3, 2))]
    scratch += [dma((3,)), dma((3, 2)), pltpu.SemaphoreType.REGULAR]
    call = fused_call(kernel, name, cfg, prog, out_shape=out_shape, in_specs=[ANY] * 6 + [const_specs],
                      out_specs=out_specs, scratch=scratch, vmem_limit=limit)
    dq, _, _, dkv, cnt = call(*sched, q_t, do_t, stat, qmeta, kv, kmeta, tuple(values))
    return dq, dkv, cnt
