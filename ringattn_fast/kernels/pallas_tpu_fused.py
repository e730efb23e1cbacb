"""Fused TPU ring attention: one ``pallas_call`` per layer and direction runs the whole ring.

Ring Attention (Liu, Zaharia, Abbeel 2023, Algorithm 1) overlaps the transfer of the next K/V shard
with the attention over the current one. The other impls write that overlap as ``lax.ppermute`` plus
a per-hop kernel and hope that XLA schedules them concurrently. Here the kernel moves K/V itself with
remote DMA (``pltpu.make_async_remote_copy``), so the overlap is in the program text: a send starts,
the hop's tiles are computed, then the send is waited on.

Called inside ``shard_map`` on this host's shards: ``fused_ring_attention_shard(QShard, KVShard,
HopConfig, *, axis_name)`` (``ringattn_fast.schedule``; ``kv`` is this host's own K/V shard, the
kernel moves it). Inputs are float16, bfloat16 or float32 (one dtype, ``dispatch.check_kernel_dtypes``),
computed in float32; o and the gradients come back in the input dtype. All index arithmetic is int32
(``jnp.int32`` constants), so the kernel also runs with ``jax_enable_x64`` on.

Notation (FlashAttention-2, Dao 2023, Algorithms 1 and 2):

- Br, Bc: ``cfg.hop.block_q``, ``cfg.hop.block_kv``: one tile is ``q[Br rows] x k[Bc rows]``.
- m, l, o: running row max, running row sum of ``exp(s - m)`` and the unnormalised output, float32
  VMEM scratch ``m_scr``, ``l_scr``, ``acc_scr`` (FA-2 Alg. 1 lines 8-10); they live across the
  ring steps (the grid axis), so the ring *is* the Bc loop.
- S: ``s = scale * q @ k.T``, -inf where ``masks.allowed`` is False. ``kv`` arrives marked by
  ``masks.mark_bad_keys`` (``ring_attention`` does it): a key that held a nan/inf has V = 0 and an
  all-NaN K, so a masked one contributes nothing and exactly the rows that see it are NaN; dQ reads
  ``masks.finite_part(K)``, dS is zeroed where P is 0 (``masks.masked_grad``).
- lse: ``m + log(l)`` saved by the forward (FA-2 Alg. 1 line 13); -inf for a row that saw no key
  (then o = 0).
- D: ``delta = rowsum(dO * O)`` (FA-2 Alg. 2 line 4), computed outside the kernel.
- step, my_idx: ring step (the grid index) and this device's index on ``axis_name``; at step
  ``step`` device ``my_idx`` holds K/V shard ``kv_idx = (my_idx - step) % axis_size``.

What travels. Forward: ``kv`` = stack(K, V) ``[2, b, hk, sk, d]`` and ``kmeta`` = stack(k_pos,
k_seg) ``[b, 2, sk]`` (positions travel with their K/V, so any layout - contiguous, striped, zigzag,
an explicit permutation - gets exact masks). Backward: the same plus ``dkv`` = stack(dK, dV)
float32, which makes one extra hop after the last step to arrive home; dQ stays (Ring Attention,
Sec. 3).

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

*wait recv* (DMA semaphore ``recv_sem[array, slot]``) orders my reads of a slot after the write
into it; *wait send* orders the end of my DMA's read of a slot before I declare it free; the
*handshake* (REGULAR semaphore ``cap_sem``, signalled on the left neighbour, "my slot is free")
orders the left neighbour's next write into a slot after my last read of it. Without it a device
can run a step ahead and overwrite the slot its right neighbour is still computing on; the TPU
interpreter's race detector reports exactly that (``tests/_fused_race_probe.py``). With N = 2 each
device sends once, into a slot never read, so the handshake only matters from N = 3 on. The
backward is the same ring plus ``dkv``: it is accumulated into during the compute, sent every step
*including* the last (N sends for N - 1 of K/V, so dK/dV end at home in slot ``N % 2``), and
``cap`` is signalled at steps 0..N-2 (forward 0..N-3). A barrier-semaphore exchange with both
neighbours at step 0 makes sure they are inside the kernel (their scratch exists) before any DMA.

Both kernels open with the same `_prologue` (ring position; at step 0 the barrier, slot 0 filled
with this device's own shard, the accumulators zeroed) and keep the same handshake rule, written
once in `_wait_cap` / `_signal_cap` in terms of the ring's last send (forward N-2, backward N-1):
wait before each send but the first, signal after each step after which the left neighbour still
sends.

Skipping (docs/design.md, "Skipping"): outside the kernel, `tiles.empty_tiles` marks which
``block_q x block_kv`` tiles of my Q shard against each K/V shard are provably empty (min/max of
positions and segment ids, ``masks.bounds_empty``); the tables arrive by scalar prefetch in SMEM and
the kernel skips a whole hop (``hop_empty[kv_idx] == 1``) or a tile (``empty[kv_idx, b, i, j] == 1``) with
``pl.when``. With ``count=True`` (``_forward`` / ``_backward``) the kernels also return how many tiles
they computed, so tests can check that; otherwise the counter ref is None.

Memory: the whole per-device shards (q, o, both K/V slots and, backward, dQ and both dK/dV slots)
sit in VMEM; fine for the shards a reference implementation is tested with and for a few thousand
tokens per device on TPU v5e/v5p, not for 32K+ tokens per device (that needs HBM slots and a tile
pipeline, ``pltpu.emit_pipeline``; not done here). Statistics use a trailing unit axis in the kernel
(``[b, h, sq, 1]``). On TPU use ``block_q`` a multiple of 8 and ``block_kv`` a multiple of 128 (or
the whole shard). Verified only in the CPU TPU interpreter: no TPU was available to compile it.

Failure modes (JAX "Distributed computing in Pallas for TPUs" style):

- a device that waits for a receive nobody sends hangs: every ``wait_recv`` here pairs with the left
  neighbour's send of the same step, and there is no K/V send (and no wait) after the last step;
- a semaphore left non-zero at exit crashes the kernel: ``cap_sem`` is signalled exactly as often as
  it is waited, and every DMA is waited on by both ends;
- dropping the handshake (``_handshake=False``) is a silent data race on TPU; the interpreter with
  ``detect_races=True`` reports it, and the interpreter must then be reset (use a subprocess);
- two kernels with different communication patterns must not share ``collective_id``; forward and
  backward here talk only to ring neighbours on one axis, so they share ``_COLLECTIVE_ID``. A
  neighbour cannot finish a kernel (and re-signal the barrier for the next one) before this device
  has passed its barrier: it needs this device's data or ``cap`` first.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.tiles import NEG_INF, check_kernel_call, empty_tiles, finite_keys, interpret_mode, out_struct, same_vma
from ringattn_fast.masks import allowed, masked_grad
from ringattn_fast.schedule import KVShard, QShard

IMPL = "pallas_tpu_fused"
_COLLECTIVE_ID = 7
_I32 = jnp.int32  # every index constant: with jax_enable_x64 a Python int would become int64


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one fused-ring call (hashable: a custom_vjp nondiff argument)."""
    axis_name: object
    axis_size: int
    hop: object  # the checked HopConfig (blocks clamped to the shard)
    has_seg: bool
    interpret: object
    handshake: bool = True
    count: bool = False  # return the number of computed tiles (tests)


# ---------------------------------------------------------------- ring plumbing (shared by fwd/bwd)

def _schedule(cfg, qs, kv):
    """The scalar-prefetched (SMEM) tables that steer the kernel, computed outside it:

    ring int32 [3]            (my_idx, right, left) = (my_idx, (my_idx + 1) % N, (my_idx - 1) % N);
    hop_empty  int32 [N]            1 if hop ``kv_idx`` has no tile to compute (the hop is skipped);
    empty      int32 [N, b, nq, nk] 1 if tile (i, j) of my Q shard against K/V shard ``kv_idx`` is
                                    provably empty (`tiles.empty_tiles`: min/max of positions, segments).
    Building ``empty`` needs every shard's k positions: an ``all_gather`` of int32 metadata only, the
    K/V themselves move inside the kernel. ``lax.axis_index`` is also kept out of the kernel: inside,
    its arithmetic trips the interpreter's ``check_vma`` bookkeeping.
    """
    n, hop = _I32(cfg.axis_size), cfg.hop
    my_idx = lax.axis_index(cfg.axis_name).astype(jnp.int32)
    ring = jnp.stack([my_idx, lax.rem(my_idx + _I32(1), n), lax.rem(my_idx + n - _I32(1), n)])
    k_pos_all = lax.all_gather(kv.pos, cfg.axis_name)                      # (N, b, sk)
    k_seg_all = None if kv.seg is None else lax.all_gather(kv.seg, cfg.axis_name)
    empty = jnp.stack([empty_tiles(qs.pos, k_pos_all[r], qs.seg, None if kv.seg is None else k_seg_all[r],
                                   causal=hop.causal, window=hop.window, block_q=hop.block_q,
                                   block_kv=hop.block_kv) for r in range(cfg.axis_size)]).astype(jnp.int32)
    return ring, jnp.min(empty.reshape(cfg.axis_size, -1), axis=1), empty


class _Ring(NamedTuple):
    """Where this device stands at grid step ``step``: ``slot = step % 2`` holds K/V shard ``kv_idx``."""
    step: jax.Array
    n: int
    slot: jax.Array
    right: jax.Array
    left: jax.Array
    kv_idx: jax.Array


def _prologue(cfg, ring_ref, fill, init):
    """The opening both kernels share. Returns the `_Ring` of this step; at step 0: the barrier with
    both neighbours, slot 0 of each travelling buffer filled (``fill``: pairs ``(buf, value)``, a
    callable giving slot 0's content) and ``init()`` (zero the accumulators, the counter)."""
    step, n = pl.program_id(0), cfg.axis_size
    my_idx, right, left = ring_ref[0], ring_ref[1], ring_ref[2]
    ring = _Ring(step, n, lax.rem(step, _I32(2)), right, left, lax.rem(my_idx - step + _I32(n), _I32(n)))

    @pl.when(step == 0)
    def _():
        if n > 1:
            _barrier(cfg, right, left)
        for buf, value in fill:
            buf[0] = value()
        init()
    return ring


def _barrier(cfg, right, left):
    """Both ring neighbours have entered the kernel (their scratch exists) before any remote DMA."""
    sem = pltpu.get_barrier_semaphore()
    for nb in (left, right):
        pl.semaphore_signal(sem, 1, device_id={cfg.axis_name: nb})
    pl.semaphore_wait(sem, 2)


def _wait_cap(cfg, ring, cap_sem, last_send):
    """Before my send of step ``0 < step <= last_send``: the right neighbour freed the slot I write."""
    if ring.n > 1 and cfg.handshake:
        @pl.when((ring.step > 0) & (ring.step <= last_send))
        def _():
            pl.semaphore_wait(cap_sem, 1)


def _signal_cap(cfg, ring, cap_sem, last_send):
    """After step ``step``: my slot ``step % 2`` is free; tell the left neighbour, which writes it at
    its step + 1, if it sends again then (``step + 1 <= last_send``). Signals = waits, exactly."""
    if ring.n > 1 and cfg.handshake:
        @pl.when(ring.step < last_send)
        def _():
            pl.semaphore_signal(cap_sem, 1, device_id={cfg.axis_name: ring.left})


def _sends(cfg, bufs, send_sem, recv_sem, slot, right):
    """One remote copy per travelling buffer ``(a, buf)``: my ``buf[slot]`` -> right neighbour's
    ``buf[1 - slot]``, with send semaphore ``send_sem[a]`` and receive semaphore ``recv_sem[a, 1 - slot]``."""
    return [pltpu.make_async_remote_copy(buf.at[slot], buf.at[1 - slot], send_sem.at[a],
                                         recv_sem.at[a, 1 - slot], device_id={cfg.axis_name: right})
            for a, buf in bufs]


def _finish(copies):
    for c in copies:
        c.wait_send()  # my DMA has read my slot: it may be declared free
        c.wait_recv()  # the left neighbour's DMA has filled my other slot: it may be read


# ---------------------------------------------------------------- tiles

def _tile_index(t, h, nq, nk):
    """Flat tile counter -> (bi, hi, i, j): batch, query head, q tile (Br), kv tile (Bc)."""
    j = lax.rem(t, _I32(nk))
    i = lax.rem(t // _I32(nk), _I32(nq))
    hi = lax.rem(t // _I32(nk * nq), _I32(h))
    return t // _I32(nk * nq * h), hi, i, j


def _logits(cfg, q, k, qmeta_ref, kmeta_buf, slot, bi, rows, cols):
    """fp32 (bq, bk) ``scale * q k^T``, -inf where the true positions (and segments) forbid the pair."""
    s = _dot(q, k, ((1,), (1,))) * cfg.hop.scale
    q_pos, k_pos = qmeta_ref[bi, 0, rows, :], kmeta_buf[slot, bi, pl.ds(0, 1), cols]    # (bq, 1), (1, bk)
    seg = (qmeta_ref[bi, 1, rows, :], kmeta_buf[slot, bi, pl.ds(1, 1), cols]) if cfg.has_seg else (None, None)
    allow = allowed(q_pos, k_pos, *seg, causal=cfg.hop.causal, window=cfg.hop.window)
    return s if allow is None else jnp.where(allow, s, NEG_INF)


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _for_each_tile_unless_empty(cfg, shape, tables, kv_idx, cnt_ref, tile_fn):
    """Run ``tile_fn(bi, hi, kv_head, rows, cols)`` on every tile of hop ``kv_idx`` that the tables
    ``(hop_empty_ref, empty_ref)`` do not mark empty (``kv_head`` of query head ``hi``); count them in
    ``cnt_ref`` (None: no counting)."""
    hop_empty_ref, empty_ref = tables
    b, h, sq, hk, sk = shape
    nq, nk = sq // cfg.hop.block_q, sk // cfg.hop.block_kv

    @pl.when(hop_empty_ref[kv_idx] == 0)
    def _():
        def body(t, carry):
            bi, hi, i, j = _tile_index(t, h, nq, nk)

            @pl.when(empty_ref[kv_idx, bi, i, j] == 0)
            def _():
                if cnt_ref is not None:
                    cnt_ref[0] += 1
                rows = pl.ds(i * _I32(cfg.hop.block_q), cfg.hop.block_q)
                cols = pl.ds(j * _I32(cfg.hop.block_kv), cfg.hop.block_kv)
                tile_fn(bi, hi, hi // _I32(h // hk), rows, cols)
            return carry
        lax.fori_loop(_I32(0), _I32(b * h * nq * nk), body, _I32(0))


# ---------------------------------------------------------------- forward kernel

def _fwd_kernel(cfg, ring_ref, hop_empty_ref, empty_ref,                                  # SMEM tables
                q_ref, qmeta_ref, kv_ref, kmeta_ref,                                 # inputs
                o_ref, lse_ref, cnt_ref,                                             # outputs (cnt: None)
                kv_buf, kmeta_buf, m_scr, l_scr, acc_scr, send_sem, recv_sem, cap_sem):
    """Grid = (axis_size,): grid step ``step`` is ring step ``step`` (FA-2 Alg. 1 with the ring as Bc loop)."""
    b, h, sq, _ = q_ref.shape
    hk, sk = kv_ref.shape[2], kv_ref.shape[3]

    def init():
        m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        if cnt_ref is not None:
            cnt_ref[0] = 0

    ring = _prologue(cfg, ring_ref, [(kv_buf, lambda: kv_ref[...]), (kmeta_buf, lambda: kmeta_ref[...])], init)
    n, slot, last_send = ring.n, ring.slot, ring.n - 2  # K/V are sent at steps 0 .. N-2
    copies = _sends(cfg, ((0, kv_buf), (1, kmeta_buf)), send_sem, recv_sem, slot, ring.right) if n > 1 else []
    _wait_cap(cfg, ring, cap_sem, last_send)

    @pl.when(ring.step <= last_send)
    def _():
        for c in copies:
            c.start()

    def tile(bi, hi, kv_head, rows, cols):
        q = q_ref[bi, hi, rows, :]                      # (bq, d)
        k = kv_buf[slot, 0, bi, kv_head, cols, :]             # (bk, d)
        v = kv_buf[slot, 1, bi, kv_head, cols, :]             # (bk, d)
        s = _logits(cfg, q, k, qmeta_ref, kmeta_buf, slot, bi, rows, cols)  # (bq, bk)
        m_prev = m_scr[bi, hi, rows, :]                 # (bq, 1)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: no NaN
        p = jnp.exp(s - m_safe)                         # (bq, bk)  FA-2 P~ (masked: 0)
        alpha = jnp.exp(m_prev - m_safe)                # (bq, 1)   e^{m_old - m}
        l_scr[bi, hi, rows, :] = alpha * l_scr[bi, hi, rows, :] + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[bi, hi, rows, :] = alpha * acc_scr[bi, hi, rows, :] + _dot(p.astype(v.dtype), v, ((1,), (0,)))
        m_scr[bi, hi, rows, :] = m_new

    _for_each_tile_unless_empty(cfg, (b, h, sq, hk, sk), (hop_empty_ref, empty_ref), ring.kv_idx, cnt_ref, tile)

    @pl.when(ring.step <= last_send)
    def _():
        _finish(copies)
    _signal_cap(cfg, ring, cap_sem, last_send)

    @pl.when(ring.step == n - 1)
    def _():
        l = l_scr[...]
        empty = l == 0.0  # saw nothing (a NaN l stays NaN)
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = jnp.where(empty, 0.0, acc_scr[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, NEG_INF, m_scr[...] + jnp.log(l_safe))


def _vmem():
    return pl.BlockSpec(memory_space=pltpu.VMEM)


def _smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _structs(like, *shapes_dtypes):
    """Output types (`tiles.out_struct`) from ``(shape, dtype)`` pairs; None stays None."""
    return tuple(None if sd is None else out_struct(*sd, like) for sd in shapes_dtypes)


def _call(kernel, cfg, out_shape, in_specs, out_specs, scratch):
    return pl.pallas_call(
        functools.partial(kernel, cfg),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(cfg.axis_size,), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             collective_id=_COLLECTIVE_ID, has_side_effects=True),
        interpret=cfg.interpret,
    )


def _counter(cfg):
    """Shape and spec of the computed-tile counter output (None, None unless ``cfg.count``)."""
    return (((1,), jnp.int32), _smem()) if cfg.count else (None, None)


def _fwd_call(cfg, sched, q_t, qmeta, kv, kmeta):
    """q_t [b, h, sq, d], qmeta [b, 2, sq, 1], kv [2, b, hk, sk, d], kmeta [b, 2, sk] ->
    o [b, h, sq, d] (q dtype), lse [b, h, sq, 1] float32, computed-tile count int32 [1] or None."""
    b, h, sq, d = q_t.shape
    f32 = jnp.float32
    q_t, qmeta, kv, kmeta = same_vma(q_t, qmeta, kv, kmeta)
    count_shape, count_spec = _counter(cfg)
    out_shape = _structs(q_t, (q_t.shape, q_t.dtype), ((b, h, sq, 1), f32), count_shape)
    scratch = [pltpu.VMEM((2,) + kv.shape, kv.dtype), pltpu.VMEM((2,) + kmeta.shape, jnp.int32),
               pltpu.VMEM((b, h, sq, 1), f32), pltpu.VMEM((b, h, sq, 1), f32), pltpu.VMEM(q_t.shape, f32),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.REGULAR]
    call = _call(_fwd_kernel, cfg, out_shape, [_vmem()] * 4, (_vmem(), _vmem(), count_spec), scratch)
    return call(*sched, q_t, qmeta, kv, kmeta)


# ---------------------------------------------------------------- backward kernel

def _bwd_kernel(cfg, ring_ref, hop_empty_ref, empty_ref,                                  # SMEM tables
                q_ref, do_ref, lse_ref, delta_ref, qmeta_ref, kv_ref, kmeta_ref,     # inputs
                dq_ref, dkv_ref, cnt_ref,                                            # outputs (cnt: None)
                kv_buf, kmeta_buf, dkv_buf, send_sem, recv_sem, cap_sem):
    """FA-2 Alg. 2 with the ring as the Bc loop: dQ accumulates here, dK/dV travel with K/V.

    dK/dV make N sends (K/V make N-1): after the last step the partial sums are one device short of
    home, so the last step sends only ``dkv`` and the device receives its own shard's finished
    dK/dV into slot ``N % 2``.
    """
    b, h, sq, _ = q_ref.shape
    hk, sk = kv_ref.shape[2], kv_ref.shape[3]

    def init():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)
        if cnt_ref is not None:
            cnt_ref[0] = 0

    fill = [(kv_buf, lambda: kv_ref[...]), (kmeta_buf, lambda: kmeta_ref[...]),
            (dkv_buf, lambda: jnp.zeros(dkv_ref.shape, jnp.float32))]
    ring = _prologue(cfg, ring_ref, fill, init)
    n, slot, last_send = ring.n, ring.slot, ring.n - 1  # dK/dV are sent at steps 0 .. N-1
    kv_copies, dkv_copies = [], []
    if n > 1:
        kv_copies = _sends(cfg, ((0, kv_buf), (1, kmeta_buf)), send_sem, recv_sem, slot, ring.right)
        dkv_copies = _sends(cfg, ((2, dkv_buf),), send_sem, recv_sem, slot, ring.right)
    _wait_cap(cfg, ring, cap_sem, last_send)  # covers the K/V and the dK/dV slot I write

    @pl.when(ring.step < n - 1)
    def _():
        for c in kv_copies:
            c.start()

    def tile(bi, hi, kv_head, rows, cols):
        q = q_ref[bi, hi, rows, :]                      # (bq, d)
        do = do_ref[bi, hi, rows, :]                    # (bq, d)
        k = kv_buf[slot, 0, bi, kv_head, cols, :]             # (bk, d)
        v = kv_buf[slot, 1, bi, kv_head, cols, :]             # (bk, d)
        s = _logits(cfg, q, k, qmeta_ref, kmeta_buf, slot, bi, rows, cols)  # (bq, bk)
        p = jnp.exp(s - lse_ref[bi, hi, rows, :])       # (bq, bk)  P = exp(S - lse), masked: 0
        dp = _dot(do, v, ((1,), (1,)))                  # (bq, bk)  dP = dO V^T
        ds = masked_grad(p, dp, delta_ref[bi, hi, rows, :])  # dS = P o (dP - D), 0 where P is 0
        dq_ref[bi, hi, rows, :] += _dot(ds.astype(k.dtype), finite_keys(k), ((1,), (0,))) * cfg.hop.scale
        dkv_buf[slot, 0, bi, kv_head, cols, :] += _dot(ds.astype(q.dtype), q, ((0,), (0,))) * cfg.hop.scale
        dkv_buf[slot, 1, bi, kv_head, cols, :] += _dot(p.astype(do.dtype), do, ((0,), (0,)))

    _for_each_tile_unless_empty(cfg, (b, h, sq, hk, sk), (hop_empty_ref, empty_ref), ring.kv_idx, cnt_ref, tile)

    for c in dkv_copies:
        c.start()  # every step, the last one included: it carries dK/dV home

    @pl.when(ring.step < n - 1)
    def _():
        _finish(kv_copies)
    _finish(dkv_copies)
    _signal_cap(cfg, ring, cap_sem, last_send)

    @pl.when(ring.step == n - 1)
    def _():
        dkv_ref[...] = dkv_buf[n % 2 if n > 1 else 0]  # home after N sends (no send when N == 1)


def _bwd_call(cfg, sched, q_t, do_t, lse, delta, qmeta, kv, kmeta):
    """-> dq [b, h, sq, d] float32, dkv [2, b, hk, sk, d] float32, computed-tile count int32 [1] or None."""
    f32 = jnp.float32
    q_t, do_t, lse, delta, qmeta, kv, kmeta = same_vma(q_t, do_t, lse, delta, qmeta, kv, kmeta)
    count_shape, count_spec = _counter(cfg)
    out_shape = _structs(q_t, (q_t.shape, f32), (kv.shape, f32), count_shape)
    scratch = [pltpu.VMEM((2,) + kv.shape, kv.dtype), pltpu.VMEM((2,) + kmeta.shape, jnp.int32),
               pltpu.VMEM((2,) + kv.shape, f32),
               pltpu.SemaphoreType.DMA((3,)), pltpu.SemaphoreType.DMA((3, 2)), pltpu.SemaphoreType.REGULAR]
    call = _call(_bwd_kernel, cfg, out_shape, [_vmem()] * 7, (_vmem(), _vmem(), count_spec), scratch)
    return call(*sched, q_t, do_t, lse, delta, qmeta, kv, kmeta)


# ---------------------------------------------------------------- layout glue and custom_vjp

def _pack(qs, kv):
    """[b, s, h, d] -> head-major kernel layout; positions and segments packed per side."""
    meta = lambda pos, seg: jnp.stack([pos, jnp.zeros_like(pos) if seg is None else seg], 1).astype(jnp.int32)
    kv_t = jnp.stack([kv.k, kv.v]).transpose(0, 1, 3, 2, 4)  # (2, b, hk, sk, d)
    return qs.q.transpose(0, 2, 1, 3), meta(qs.pos, qs.seg)[..., None], kv_t, meta(kv.pos, kv.seg)


def _forward(cfg, qs, kv):
    """-> o [b, sq, h, d] (q dtype), lse [b, h, sq] float32, tiles computed on this device (int32 [1]
    with ``cfg.count``, else None)."""
    o, lse, cnt = _fwd_call(cfg, _schedule(cfg, qs, kv), *_pack(qs, kv))
    return o.transpose(0, 2, 1, 3), lse[..., 0], cnt


def _backward(cfg, qs, kv, *, o, lse, do, dlse):
    """-> (dq, dk, dv) in the input dtypes and the tiles computed; ``dlse`` is the lse cotangent.

    d lse / d s = P, so an lse cotangent only shifts FA-2's D: dS = P o (dP - (D - dlse)).
    """
    q_t, qmeta, kv_t, kmeta = _pack(qs, kv)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))  # (b, h, sq)
    delta = (delta - dlse.astype(jnp.float32))[..., None]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]  # a row that saw nothing: every p is 0 anyway
    dq, dkv, cnt = _bwd_call(cfg, _schedule(cfg, qs, kv), q_t, do.transpose(0, 2, 1, 3), lse, delta, qmeta,
                             kv_t, kmeta)
    dk, dv = dkv.transpose(0, 1, 3, 2, 4)                # (b, sk, hk, d) each
    return dq.transpose(0, 2, 1, 3).astype(qs.q.dtype), dk.astype(kv.k.dtype), dv.astype(kv.v.dtype), cnt


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


def make_config(qs, kv, cfg, *, axis_name, interpret=None, _handshake=True, count=False):
    """Validate the per-device shards and return the static ``_Cfg`` (call inside ``shard_map``)."""
    hop = check_kernel_call(IMPL, qs, kv, cfg)
    try:
        axis_size = int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(f"impl={IMPL!r}: axis_name {axis_name!r} is not a mesh axis of an enclosing "
                         f"jax.shard_map; call it on per-device shards inside shard_map") from None
    return _Cfg(axis_name=axis_name, axis_size=axis_size, hop=hop, has_seg=qs.seg is not None,
                interpret=interpret_mode(IMPL) if interpret is None else interpret, handshake=_handshake,
                count=count)


def fused_ring_attention_shard(qs, kv, cfg, *, axis_name, interpret=None, return_lse=False, _handshake=True):
    """Ring attention over mesh axis ``axis_name`` in one fused Pallas TPU kernel (call inside shard_map).

    Per-device shards: qs = QShard(q [b, sq, h, d], pos int32 [b, sq], seg int32 [b, sq] or None);
    kv = KVShard(k, v [b, sk, hk, d] (h % hk == 0, GQA), pos int32 [b, sk], seg or None, bias None)
    (this host's own K/V, marked by ``masks.mark_bad_keys``; any layout of true positions);
    cfg = HopConfig (scale, causal, window, block_q / block_kv clamped to the shard, dividing it).
    Returns o [b, sq, h, d] in q's dtype (and lse [b, h, sq] float32 with ``return_lse=True``). Differentiable (``jax.custom_vjp``; the backward
    is a second fused ring kernel in which dK/dV travel with K/V).

    ``interpret``: None -> `tiles.interpret_mode` (on CPU the TPU interpreter with race detection, on
    TPU compiled, elsewhere a ValueError); or a ``pltpu.InterpretParams`` / bool for ``pallas_call``.
    ``_handshake=False`` drops the per-hop handshake (tests only: it makes the kernel racy).
    """
    fcfg = make_config(qs, kv, cfg, axis_name=axis_name, interpret=interpret, _handshake=_handshake)
    o, lse = _ring(fcfg, qs, kv)
    return (o, lse) if return_lse else o
