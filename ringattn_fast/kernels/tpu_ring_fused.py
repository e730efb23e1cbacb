"""Fused TPU ring attention: one ``pallas_call`` per layer and direction runs the whole ring.

Ring Attention (Liu, Zaharia, Abbeel 2023, Algorithm 1) overlaps the transfer of the next K/V block
with the attention over the current one. The other impls write that overlap as ``lax.ppermute`` plus
a per-hop kernel and hope that XLA schedules them concurrently. Here the kernel moves K/V itself with
remote DMA (``pltpu.make_async_remote_copy``), so the overlap is in the program text: a send starts,
the hop's tiles are computed, then the send is waited on.

Notation (FlashAttention-2, Dao 2023, Algorithms 1 and 2)
  Br, Bc           ``block_q``, ``block_kv``: one tile is ``q[Br rows] x k[Bc rows]``.
  m, l, o          running row max, running row sum of ``exp(s - m)`` and the unnormalised output,
                   float32 VMEM scratch ``m_scr``, ``l_scr``, ``acc_scr`` (FA-2 Alg. 1 lines 8-10);
                   they live across the ring steps (the grid axis), so the ring *is* the Bc loop.
  lse              ``m + log(l)`` saved by the forward (FA-2 Alg. 1 line 13); -inf for a row that
                   saw no key (then o = 0).
  D                ``delta = rowsum(dO * O)`` (FA-2 Alg. 2 line 4), computed outside the kernel.
  step, my_idx     ring step (the grid index) and this device's index on ``axis_name``; at step
                   ``step`` device ``my_idx`` holds K/V shard ``kv_idx = (my_idx - step) % axis_size``.

What travels
  Forward: ``kv`` = stack(K, V) ``[2, b, hk, sk, d]`` and ``kmeta`` = stack(k_pos, k_seg)
  ``[b, 2, sk]`` (positions travel with their K/V, so any layout - contiguous, striped, zigzag, an
  explicit permutation - gets exact masks). Backward: the same plus ``dkv`` = stack(dK, dV) float32,
  which makes one extra hop after the last step to arrive home; dQ stays (Ring Attention, Sec. 3).

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

Skipping (docs/design.md, "Skipping"): outside the kernel, `tiles.tile_schedule` marks which
``block_q x block_kv`` tiles of my Q shard against each K/V shard are provably empty (min/max of
positions and segment ids); the tables arrive by scalar prefetch in SMEM and the kernel skips a whole
hop (``hop[kv_idx] == 0``) or a tile (``vis[kv_idx, b, i, j] == 0``) with ``pl.when``. The counters
the kernels return (``_forward`` / ``_backward``) let tests check that.

Memory: the whole per-device shards (q, o, both K/V slots and, backward, dQ and both dK/dV slots)
sit in VMEM; fine for the shards a reference implementation is tested with and for a few thousand
tokens per device on TPU v5e/v5p, not for 32K+ tokens per device (that needs HBM slots and a tile
pipeline, ``pltpu.emit_pipeline``; not done here). Statistics use a trailing unit axis in the kernel
(``[b, h, sq, 1]``). On TPU use ``block_q`` a multiple of 8 and ``block_kv`` a multiple of 128 (or
the whole shard). Verified only in the CPU TPU interpreter: no TPU was available to compile it.

Failure modes (JAX "Distributed computing in Pallas for TPUs" style)
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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.tiles import check_hop_args, tile_mask, tile_schedule
from ringattn_ref.validation import check_scale, check_window

_COLLECTIVE_ID = 7
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one fused-ring call (hashable: a custom_vjp nondiff argument)."""
    axis_name: object
    axis_size: int
    scale: float
    causal: bool
    window: tuple | None
    has_seg: bool
    block_q: int
    block_kv: int
    interpret: object
    handshake: bool = True


def _resolve_interpret(interpret):
    """None -> race-detecting TPU interpreter on CPU, compile on TPU, clear error elsewhere."""
    if interpret is not None:
        return interpret
    backend = jax.default_backend()
    if backend == "cpu":
        return pltpu.InterpretParams(detect_races=True)
    if backend == "tpu":
        return False
    raise ValueError(f"impl 'pallas_tpu_fused' needs a TPU (or the CPU interpreter); got backend "
                     f"{backend!r}. Use impl='pallas_gpu' or 'xla' on this backend.")


# ---------------------------------------------------------------- ring plumbing (shared by fwd/bwd)

def _schedule(cfg, q_pos, k_pos, q_seg, k_seg):
    """The scalar-prefetched (SMEM) tables that steer the kernel, computed outside it:

    ring int32 [3]            (my_idx, right, left) = (my_idx, (my_idx + 1) % N, (my_idx - 1) % N);
    hop  int32 [N]            1 if hop ``kv_idx`` has any tile to compute, else 0 (the hop is skipped);
    vis  int32 [N, b, nq, nk] 1 if tile (i, j) of my Q shard against K/V shard ``kv_idx`` is not
                              provably empty (`tiles.tile_schedule`: min/max of positions, segments).
    Building ``vis`` needs every shard's k positions: an ``all_gather`` of int32 metadata only, the
    K/V themselves move inside the kernel. ``lax.axis_index`` is also kept out of the kernel: inside,
    its arithmetic trips the interpreter's ``check_vma`` bookkeeping.
    """
    n = cfg.axis_size
    my_idx = lax.axis_index(cfg.axis_name)
    ring = jnp.stack([my_idx, lax.rem(my_idx + 1, n), lax.rem(my_idx + n - 1, n)]).astype(jnp.int32)
    k_pos_all = lax.all_gather(k_pos, cfg.axis_name)                       # (N, b, sk)
    k_seg_all = None if k_seg is None else lax.all_gather(k_seg, cfg.axis_name)
    vis = jnp.stack([tile_schedule(q_pos, k_pos_all[r], q_seg, None if k_seg is None else k_seg_all[r],
                                   causal=cfg.causal, window=cfg.window, block_q=cfg.block_q,
                                   block_kv=cfg.block_kv) for r in range(n)]).astype(jnp.int32)
    return ring, jnp.max(vis.reshape(n, -1), axis=1), vis


def _barrier(cfg, right, left):
    """Both ring neighbours have entered the kernel (their scratch exists) before any remote DMA."""
    sem = pltpu.get_barrier_semaphore()
    for nb in (left, right):
        pl.semaphore_signal(sem, 1, device_id={cfg.axis_name: nb})
    pl.semaphore_wait(sem, 2)


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
    j = lax.rem(t, nk)
    i = lax.rem(t // nk, nq)
    hi = lax.rem(t // (nk * nq), h)
    return t // (nk * nq * h), hi, i, j


def _tile_mask(cfg, qmeta_ref, kmeta_buf, slot, bi, rows, cols):
    """bool (bq, bk) from the true positions (and segments) of the tile's rows and columns."""
    q_pos, q_seg = qmeta_ref[bi, 0, rows, :], qmeta_ref[bi, 1, rows, :]                    # (bq, 1)
    k_pos, k_seg = kmeta_buf[slot, bi, pl.ds(0, 1), cols], kmeta_buf[slot, bi, pl.ds(1, 1), cols]  # (1, bk)
    return tile_mask(q_pos, k_pos, q_seg if cfg.has_seg else None, k_seg if cfg.has_seg else None,
                     causal=cfg.causal, window=cfg.window)


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _for_each_visible_tile(cfg, shape, hop_ref, vis_ref, kv_idx, qmeta_ref, kmeta_buf, cnt_ref, slot,
                           tile_fn):
    """Run ``tile_fn(bi, hi, g, rows, cols, mask)`` on every tile of hop ``kv_idx`` that the schedule
    marks visible (``g`` = kv head of query head ``hi``); count them in ``cnt_ref``."""
    b, h, sq, hk, sk = shape
    nq, nk = sq // cfg.block_q, sk // cfg.block_kv

    @pl.when(hop_ref[kv_idx] > 0)
    def _():
        def body(t, carry):
            bi, hi, i, j = _tile_index(t, h, nq, nk)

            @pl.when(vis_ref[kv_idx, bi, i, j] > 0)
            def _():
                cnt_ref[0] += 1
                rows, cols = pl.ds(i * cfg.block_q, cfg.block_q), pl.ds(j * cfg.block_kv, cfg.block_kv)
                tile_fn(bi, hi, hi // (h // hk), rows, cols,
                        _tile_mask(cfg, qmeta_ref, kmeta_buf, slot, bi, rows, cols))
            return carry
        lax.fori_loop(0, b * h * nq * nk, body, 0)


# ---------------------------------------------------------------- forward kernel

def _fwd_kernel(cfg, ring_ref, hop_ref, vis_ref,                                     # SMEM tables
                q_ref, qmeta_ref, kv_ref, kmeta_ref,                                 # inputs
                o_ref, lse_ref, cnt_ref,                                             # outputs
                kv_buf, kmeta_buf, m_scr, l_scr, acc_scr, send_sem, recv_sem, cap_sem):
    """Grid = (axis_size,): grid step ``step`` is ring step ``step`` (FA-2 Alg. 1 with the ring as Bc loop)."""
    step, n = pl.program_id(0), cfg.axis_size
    slot = lax.rem(step, 2)
    my_idx, right, left = ring_ref[0], ring_ref[1], ring_ref[2]
    kv_idx = lax.rem(my_idx - step + n, n)  # the K/V shard in my slot at this step
    b, h, sq, _ = q_ref.shape
    hk, sk = kv_ref.shape[2], kv_ref.shape[3]

    @pl.when(step == 0)
    def _():
        if n > 1:
            _barrier(cfg, right, left)
        kv_buf[0] = kv_ref[...]
        kmeta_buf[0] = kmeta_ref[...]
        m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        cnt_ref[0] = 0

    copies = _sends(cfg, ((0, kv_buf), (1, kmeta_buf)), send_sem, recv_sem, slot, right) if n > 1 else []

    @pl.when(step < n - 1)
    def _():
        if cfg.handshake:
            @pl.when(step > 0)
            def _():
                pl.semaphore_wait(cap_sem, 1)  # right neighbour is done with the slot I write
        for c in copies:
            c.start()

    def tile(bi, hi, g, rows, cols, mask):
        q = q_ref[bi, hi, rows, :]                      # (bq, d)
        k = kv_buf[slot, 0, bi, g, cols, :]             # (bk, d)
        v = kv_buf[slot, 1, bi, g, cols, :]             # (bk, d)
        s = jnp.where(mask, _dot(q, k, ((1,), (1,))) * cfg.scale, NEG_INF)  # (bq, bk)
        m_prev = m_scr[bi, hi, rows, :]                 # (bq, 1)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing seen yet: no NaN
        p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)   # (bq, bk)  FA-2 P~
        alpha = jnp.exp(m_prev - m_safe)                # (bq, 1)   e^{m_old - m}
        l_scr[bi, hi, rows, :] = alpha * l_scr[bi, hi, rows, :] + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[bi, hi, rows, :] = alpha * acc_scr[bi, hi, rows, :] + _dot(p.astype(v.dtype), v, ((1,), (0,)))
        m_scr[bi, hi, rows, :] = m_new

    _for_each_visible_tile(cfg, (b, h, sq, hk, sk), hop_ref, vis_ref, kv_idx, qmeta_ref, kmeta_buf,
                           cnt_ref, slot, tile)

    @pl.when(step < n - 1)
    def _():
        _finish(copies)
        if cfg.handshake:
            @pl.when(step < n - 2)  # the left neighbour sends again only at steps <= n-2
            def _():
                pl.semaphore_signal(cap_sem, 1, device_id={cfg.axis_name: left})

    @pl.when(step == n - 1)
    def _():
        l = l_scr[...]
        seen = l > 0.0
        o_ref[...] = jnp.where(seen, acc_scr[...] / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_scr[...] + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)


def _vmem():
    return pl.BlockSpec(memory_space=pltpu.VMEM)


def _smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _match_vma(xs):
    """Under ``shard_map(check_vma=True)``: make every input vary over the union of the inputs' axes."""
    union = frozenset().union(*(jax.typeof(x).mat.varying for x in xs))
    return [x if union <= jax.typeof(x).mat.varying
            else lax.pcast(x, tuple(union - jax.typeof(x).mat.varying), to="varying") for x in xs]


def _structs(like, *shapes_dtypes):
    """Output ShapeDtypeStructs that vary over the same mesh axes as input ``like``."""
    mat = jax.typeof(like).mat
    return tuple(jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat) for shape, dtype in shapes_dtypes)


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


def _fwd_call(cfg, sched, q_t, qmeta, kv, kmeta):
    """q_t [b, h, sq, d], qmeta [b, 2, sq, 1], kv [2, b, hk, sk, d], kmeta [b, 2, sk] ->
    o [b, h, sq, d] (q dtype), lse [b, h, sq, 1] float32, computed-tile count int32 [1]."""
    b, h, sq, d = q_t.shape
    f32 = jnp.float32
    q_t, qmeta, kv, kmeta = _match_vma((q_t, qmeta, kv, kmeta))
    out_shape = _structs(q_t, (q_t.shape, q_t.dtype), ((b, h, sq, 1), f32), ((1,), jnp.int32))
    scratch = [pltpu.VMEM((2,) + kv.shape, kv.dtype), pltpu.VMEM((2,) + kmeta.shape, jnp.int32),
               pltpu.VMEM((b, h, sq, 1), f32), pltpu.VMEM((b, h, sq, 1), f32), pltpu.VMEM(q_t.shape, f32),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.REGULAR]
    call = _call(_fwd_kernel, cfg, out_shape, [_vmem()] * 4, (_vmem(), _vmem(), _smem()), scratch)
    return call(*sched, q_t, qmeta, kv, kmeta)


# ---------------------------------------------------------------- backward kernel

def _bwd_kernel(cfg, ring_ref, hop_ref, vis_ref,                                     # SMEM tables
                q_ref, do_ref, lse_ref, delta_ref, qmeta_ref, kv_ref, kmeta_ref,     # inputs
                dq_ref, dkv_ref, cnt_ref,                                            # outputs
                kv_buf, kmeta_buf, dkv_buf, send_sem, recv_sem, cap_sem):
    """FA-2 Alg. 2 with the ring as the Bc loop: dQ accumulates here, dK/dV travel with K/V.

    dK/dV make N sends (K/V make N-1): after the last step the partial sums are one device short of
    home, so the last step sends only ``dkv`` and the device receives its own shard's finished
    dK/dV into slot ``N % 2``.
    """
    step, n = pl.program_id(0), cfg.axis_size
    slot = lax.rem(step, 2)
    my_idx, right, left = ring_ref[0], ring_ref[1], ring_ref[2]
    kv_idx = lax.rem(my_idx - step + n, n)  # the K/V shard in my slot at this step
    b, h, sq, _ = q_ref.shape
    hk, sk = kv_ref.shape[2], kv_ref.shape[3]

    @pl.when(step == 0)
    def _():
        if n > 1:
            _barrier(cfg, right, left)
        kv_buf[0] = kv_ref[...]
        kmeta_buf[0] = kmeta_ref[...]
        dkv_buf[0] = jnp.zeros(dkv_ref.shape, jnp.float32)
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)
        cnt_ref[0] = 0

    kv_copies, dkv_copies = [], []
    if n > 1:
        kv_copies = _sends(cfg, ((0, kv_buf), (1, kmeta_buf)), send_sem, recv_sem, slot, right)
        dkv_copies = _sends(cfg, ((2, dkv_buf),), send_sem, recv_sem, slot, right)

    if n > 1 and cfg.handshake:
        @pl.when(step > 0)
        def _():
            pl.semaphore_wait(cap_sem, 1)  # right neighbour is done with the K/V and dK/dV slot I write

    @pl.when(step < n - 1)
    def _():
        for c in kv_copies:
            c.start()

    def tile(bi, hi, g, rows, cols, mask):
        q = q_ref[bi, hi, rows, :]                      # (bq, d)
        do = do_ref[bi, hi, rows, :]                    # (bq, d)
        lse = lse_ref[bi, hi, rows, :]                  # (bq, 1)
        k = kv_buf[slot, 0, bi, g, cols, :]             # (bk, d)
        v = kv_buf[slot, 1, bi, g, cols, :]             # (bk, d)
        s = _dot(q, k, ((1,), (1,))) * cfg.scale        # (bq, bk)
        p = jnp.where(mask, jnp.exp(s - jnp.where(lse == NEG_INF, 0.0, lse)), 0.0)  # P = exp(S - lse)
        dp = _dot(do, v, ((1,), (1,)))                  # (bq, bk)  dP = dO V^T
        ds = p * (dp - delta_ref[bi, hi, rows, :])      # (bq, bk)  dS = P o (dP - D)
        dq_ref[bi, hi, rows, :] += _dot(ds.astype(k.dtype), k, ((1,), (0,))) * cfg.scale
        dkv_buf[slot, 0, bi, g, cols, :] += _dot(ds.astype(q.dtype), q, ((0,), (0,))) * cfg.scale
        dkv_buf[slot, 1, bi, g, cols, :] += _dot(p.astype(do.dtype), do, ((0,), (0,)))

    _for_each_visible_tile(cfg, (b, h, sq, hk, sk), hop_ref, vis_ref, kv_idx, qmeta_ref, kmeta_buf,
                           cnt_ref, slot, tile)

    for c in dkv_copies:
        c.start()  # every step, the last one included: it carries dK/dV home

    @pl.when(step < n - 1)
    def _():
        _finish(kv_copies)
    _finish(dkv_copies)

    if n > 1 and cfg.handshake:
        @pl.when(step < n - 1)  # the left neighbour's dK/dV send at its step + 1 <= n - 1 needs it
        def _():
            pl.semaphore_signal(cap_sem, 1, device_id={cfg.axis_name: left})

    @pl.when(step == n - 1)
    def _():
        dkv_ref[...] = dkv_buf[n % 2 if n > 1 else 0]  # home after N sends (no send when N == 1)


def _bwd_call(cfg, sched, q_t, do_t, lse, delta, qmeta, kv, kmeta):
    """-> dq [b, h, sq, d] float32, dkv [2, b, hk, sk, d] float32, computed-tile count int32 [1]."""
    f32 = jnp.float32
    q_t, do_t, lse, delta, qmeta, kv, kmeta = _match_vma((q_t, do_t, lse, delta, qmeta, kv, kmeta))
    out_shape = _structs(q_t, (q_t.shape, f32), (kv.shape, f32), ((1,), jnp.int32))
    scratch = [pltpu.VMEM((2,) + kv.shape, kv.dtype), pltpu.VMEM((2,) + kmeta.shape, jnp.int32),
               pltpu.VMEM((2,) + kv.shape, f32),
               pltpu.SemaphoreType.DMA((3,)), pltpu.SemaphoreType.DMA((3, 2)), pltpu.SemaphoreType.REGULAR]
    call = _call(_bwd_kernel, cfg, out_shape, [_vmem()] * 7, (_vmem(), _vmem(), _smem()), scratch)
    return call(*sched, q_t, do_t, lse, delta, qmeta, kv, kmeta)


# ---------------------------------------------------------------- layout glue and custom_vjp

def _pack(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """[b, s, h, d] -> head-major kernel layout; positions and segments packed per side."""
    zeros = jnp.zeros_like
    qmeta = jnp.stack([q_pos, zeros(q_pos) if q_seg is None else q_seg], 1).astype(jnp.int32)[..., None]
    kmeta = jnp.stack([k_pos, zeros(k_pos) if k_seg is None else k_seg], 1).astype(jnp.int32)
    kv = jnp.stack([k, v]).transpose(0, 1, 3, 2, 4)     # (2, b, hk, sk, d)
    return q.transpose(0, 2, 1, 3), qmeta, kv, kmeta     # (b, h, sq, d), (b, 2, sq, 1), kv, (b, 2, sk)


def _forward(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg):
    """-> o [b, sq, h, d] (q dtype), lse [b, h, sq] float32, tiles computed on this device int32 [1]."""
    sched = _schedule(cfg, q_pos, k_pos, q_seg, k_seg)
    o, lse, cnt = _fwd_call(cfg, sched, *_pack(q, k, v, q_pos, k_pos, q_seg, k_seg))
    return o.transpose(0, 2, 1, 3), lse[..., 0], cnt


def _backward(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse, do, dlse):
    """-> (dq, dk, dv) in the input dtypes and the tiles computed; ``dlse`` is the lse cotangent.

    d lse / d s = P, so an lse cotangent only shifts FA-2's D: dS = P o (dP - (D - dlse)).
    """
    q_t, qmeta, kv, kmeta = _pack(q, k, v, q_pos, k_pos, q_seg, k_seg)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # (b, h, sq)
    delta = (delta - dlse.astype(jnp.float32))[..., None]
    sched = _schedule(cfg, q_pos, k_pos, q_seg, k_seg)
    dq, dkv, cnt = _bwd_call(cfg, sched, q_t, do.transpose(0, 2, 1, 3), lse[..., None], delta, qmeta, kv, kmeta)
    dk, dv = dkv.transpose(0, 1, 3, 2, 4)                # (b, sk, hk, d) each
    return dq.transpose(0, 2, 1, 3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), cnt


def _int_zeros(x):
    return None if x is None else np.zeros(x.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _forward(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg)[:2]


def _ring_fwd(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg):
    o, lse, _ = _forward(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return (o, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse)


def _ring_bwd(cfg, res, cotangents):
    q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse = res
    do, dlse = cotangents
    dq, dk, dv, _ = _backward(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg, o, lse, do, dlse)
    return (dq, dk, dv, _int_zeros(q_pos), _int_zeros(k_pos), _int_zeros(q_seg), _int_zeros(k_seg))


_ring.defvjp(_ring_fwd, _ring_bwd)


def make_config(q, k, v, q_pos, k_pos, q_seg, k_seg, *, axis_name, scale, causal, window, block_q,
                block_kv, interpret=None, _handshake=True):
    """Validate the per-device shards and return the static ``_Cfg`` (call inside ``shard_map``)."""
    name = "fused_ring_attention_shard"
    block_q, block_kv, _ = check_hop_args(name, q, k, v, q_pos, k_pos, q_seg, k_seg, None, window,
                                          block_q, block_kv)
    try:
        axis_size = int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(f"{name}: axis_name {axis_name!r} is not a mesh axis of an enclosing "
                         f"jax.shard_map; call it on per-device shards inside shard_map") from None
    return _Cfg(axis_name=axis_name, axis_size=axis_size,
                scale=check_scale(scale, q.shape[-1]), causal=bool(causal), window=check_window(window),
                has_seg=q_seg is not None, block_q=block_q, block_kv=block_kv,
                interpret=_resolve_interpret(interpret), handshake=_handshake)


def fused_ring_attention_shard(q, k, v, q_pos, k_pos, q_seg, k_seg, *, axis_name, scale, causal, window,
                               block_q, block_kv, interpret=None, return_lse=False, _handshake=True):
    """Ring attention over mesh axis ``axis_name`` in one fused Pallas TPU kernel (call inside shard_map).

    Per-device shards: q [b, sq, h, d]; k, v [b, sk, hk, d] (h % hk == 0, GQA); q_pos [b, sq],
    k_pos [b, sk] int32 true positions (any layout); q_seg, k_seg int32 [b, s] or both None;
    window (left, right) with -1 = unbounded, or None; scale None -> d ** -0.5; block_q / block_kv
    (None -> 128) are clamped to the shard and must divide it. Returns o [b, sq, h, d] in q's dtype
    (and lse [b, h, sq] float32 with ``return_lse=True``). Differentiable (``jax.custom_vjp``; the
    backward is a second fused ring kernel in which dK/dV travel with K/V).

    ``interpret``: None -> on CPU the TPU interpreter with race detection, on TPU compiled, on any
    other backend a ValueError; or a ``pltpu.InterpretParams`` / bool passed to ``pallas_call``.
    ``_handshake=False`` drops the per-hop handshake (tests only: it makes the kernel racy).
    """
    cfg = make_config(q, k, v, q_pos, k_pos, q_seg, k_seg, axis_name=axis_name, scale=scale,
                      causal=causal, window=window, block_q=block_q, block_kv=block_kv,
                      interpret=interpret, _handshake=_handshake)
    o, lse = _ring(cfg, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return (o, lse) if return_lse else o
