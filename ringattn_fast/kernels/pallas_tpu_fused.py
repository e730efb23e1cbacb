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
kernel holds one kv head's K/V of the shard whole in VMEM (the forward, `fused_ring_fwd`; the
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
- forward (`fused_ring_fwd`): m, l, O (Alg. 1 lines 8-10) per Q tile in VMEM (``stat_v`` = [m | l] as
  two lane-replicated (Br, 128) halves, ``acc_v`` the unnormalised O) while the tile runs through the
  hop's K/V tiles; between ring steps in HBM (``stat``, ``acc``): the ring *is* FA-2's outer Bc loop, so
  the running statistics of every Q tile live across the grid axis.
- S: ``scale * q @ k.T``, soft-capped, ``score_fn`` and ``mask_fn`` applied as in the per-hop kernels
  (`tiles.programmed`; their consts sit whole in VMEM), -inf where ``masks.allowed`` is False. K/V
  arrive marked by ``masks.mark_bad_keys``; dQ reads ``tiles.finite_keys(K)``, dS is zeroed where P is 0.
- lse = m + log l (-inf for a row that saw nothing; then o = 0); D = rowsum(dO * O) (outside).
- backward (`fused_ring_bwd`): per ring step one pass over the held shard where it fits (a kv head's K/V,
  dK and dV of the shard resident in VMEM, key-major tiles, 5 matmuls a tile, as the per-hop fused
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

from ringattn_fast.kernels import budgets
from ringattn_fast.kernels import fused_ring as fr
from ringattn_fast.kernels import fused_ring_bwd as bwd
from ringattn_fast.kernels import fused_ring_fwd as fwd
from ringattn_fast.kernels.fused_tiles import LANES, SUBLANES, consts, key_tiles, lanes, sub_split
from ringattn_fast.kernels.tiles import check_budget, check_kernel_call, interpret_mode, target_chip
from ringattn_fast.schedule import HopConfig, KVShard, QShard

IMPL = "pallas_tpu_fused"


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
        kmeta = key_tiles(kmeta, cfg.hop.block_kv)  # (b, nk, 2, bk)
    o, lse, cnt = fwd.forward_call(cfg, _schedule(cfg, qs, kv), q_t, lanes(qmeta), kv_t, kmeta)
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
    """VMEM / SMEM of the streaming forward and the two-pass backward kernel (`budgets`): their VMEM tiles
    (`fused_ring_fwd.fwd_scratch`, `fused_ring_bwd.two_pass_scratch`, all shard-length independent) plus the
    score-sized temporaries, and the SMEM tables (`fused_ring.schedule`). q [b, sq, h, d], k [b, sk, hk, d]
    per device; ``n`` devices. The tiles are chosen to fit these; the whole-shard forms run where they fit
    too (`_whole_kv`, `_one_pass`)."""
    cfg = fr.FusedConfig(None, n, hop, has_seg, False)
    smem = _smem(cfg, q_shape, k_shape)
    temps = [((hop.block_q, hop.block_kv), jnp.float32)]
    return [budgets.Footprint(budgets.tpu_vmem_bytes(scratch=fwd.fwd_scratch(cfg, q_shape[-1], dtype, k_shape[1]),
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
    """``(whole_kv, vmem_limit)`` of the forward: a kv head's K/V of the shard whole in VMEM
    (``fused_ring_fwd.WHOLE_KV``) where that fits ``chip`` (always when interpreted: ``chip`` None), with
    the ``vmem_limit_bytes`` it needs. Measured on a v5e (1024 x 1024 tiles, 8K and 16K tokens, bf16): at
    32 / 8 heads the forward alone was 1-7 % faster whole than streamed (a K/V tile read once per head
    group, not once per query head); at 8 / 8 heads the forward alone was 0-5 % slower whole, but the
    forward+backward bench 0-7 % faster (the sixth chip session; a wash within the runs' spread)."""
    if not fwd.WHOLE_KV:
        return False, None
    if chip is None:
        return True, None
    cfg = fr.FusedConfig(None, n, hop, has_seg, False, whole_kv=True)
    temps = [((hop.block_q, hop.block_kv), jnp.float32)] * 2
    need = budgets.Footprint(budgets.tpu_vmem_bytes(scratch=fwd.fwd_scratch(cfg, q_shape[-1], dtype, k_shape[1]),
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
