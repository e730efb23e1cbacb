"""The fused TPU ring's tile math and ``pallas_call`` glue, shared by its forward (``fused_ring_fwd``) and its
backward kernels (``fused_ring_bwd``): the logits of one tile, flat loop counters, the kernel's view of the
shapes, and the one ``pallas_call`` form both directions use (grid = the ring's steps, everything that grows
with the shard in HBM). The ring's plumbing (tables, semaphores, tile streams) is ``fused_ring``.
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.fused_ring import I32
from ringattn_fast.kernels.tiles import NEG_INF, out_struct, program, programmed
from ringattn_fast.masks import allowed

LANES, SUBLANES = 128, 8
COLLECTIVE_ID = 7  # forward and backward talk only to ring neighbours on one axis: one id serves both
ANY = pl.BlockSpec(memory_space=pl.ANY)
N_TABLES = 7  # `fused_ring.schedule`'s scalar-prefetch tables: ring, q_live, k_live, q/k bounds, q/k sub-bounds


def dot(a, b, contract):
    """float32 ``lax.dot_general`` contracting axes ``contract`` = ((of a,), (of b,)), no batch axes."""
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def unflatten(t, sizes):
    """Flat loop counter -> indices of a row-major grid of ``sizes`` (int32)."""
    out = []
    for size in reversed(sizes[1:]):
        out.append(lax.rem(t, I32(size)))
        t = t // I32(size)
    return [t] + out[::-1]


def sub_split(cfg, prog):
    """2 where a partial tile runs as 2 x 2 sub-tiles (`fused_ring.by_kind`), else 1: no program (its tables
    are per tile), tile sides that halve into multiples of 128 (interpreted: of 8), as the per-hop kernels'
    ``pallas_tpu._split``. Measured on a v5e for the per-hop kernel: 2 x 2 beat whole tiles and 4 x 4."""
    side = SUBLANES if cfg.interpret else LANES
    ok = prog is None and all(block % 2 == 0 and (block // 2) % side == 0
                              for block in (cfg.hop.block_q, cfg.hop.block_kv))
    return 2 if ok else 1


def logits(cfg, fn, q, k, qm, km, *, grad=False, masked=True, part=(slice(None), slice(None))):
    """fp32 (bq, bk) ``scale * q k^T``, soft-capped, scored and masked by ``fn`` = (the `tiles.Program`,
    its consts' refs, the query head), -inf where the true positions (and segments) forbid the pair
    (only when ``masked``: a tile `fused_ring.by_kind` proves full needs no mask).
    qm: VMEM (2, bq, 128) lane-replicated query (pos, seg); km: VMEM (2, bk) key (pos, seg) rows. With
    ``grad``: ``(s, pullback)`` (`tiles.programmed`). ``part``: the (query rows, key rows) of a sub-tile
    whose q and k these are."""
    s = dot(q, k, ((1,), (1,))) * cfg.hop.scale
    prog, const_refs, head = fn
    pull = None
    if cfg.masked:
        (qp, kp) = part
        q_pos, k_pos = qm[0, qp, :1], km[0:1, kp]
        seg = (qm[1, qp, :1], km[1:2, kp]) if cfg.has_seg else (None, None)
        s, pull = programmed(prog, [r[...] for r in const_refs], s, q_pos=q_pos, k_pos=k_pos, q_seg=seg[0],
                             k_seg=seg[1], head=head, grad=grad)
        allow = allowed(q_pos, k_pos, *seg, causal=cfg.hop.causal, window=cfg.hop.window) if masked else None
        s = s if allow is None else jnp.where(allow, s, NEG_INF)
    elif prog is not None:  # a soft-cap only: no positions needed
        s, pull = programmed(prog, [], s, q_pos=None, k_pos=None, q_seg=None, k_seg=None, head=None, grad=grad)
    return (s, pull) if grad else s


def query_head(kv_head, t, group, nq):
    """(query head, Q tile index) of tile ``t`` of a kv head's group (``group`` query heads of ``nq`` Q tiles
    each, member-major), int32."""
    member, i = unflatten(t, (group, nq))
    return kv_head * I32(group) + member, i


def key_tiles(kmeta, block_kv):
    """Key (positions, segment ids) [b, 2, sk] -> [b, nk, 2, block_kv]: one (2, block_kv) tile per K/V tile, so
    a kernel holding a kv head's shard in VMEM indexes a tile's rows on the leading axis."""
    b, _, sk = kmeta.shape
    return kmeta.reshape(b, 2, sk // block_kv, block_kv).swapaxes(1, 2)


def lanes(x):
    """[..., s] -> [..., s, 128]: one value per row, replicated over the lanes (a (rows, 128) column tile)."""
    return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


def kernel_shape(cfg, q_shape, k_shape):
    """(b, h, hk, nq, nk) from the kernel layout's q [b, h, sq, d] and K/V [2, b, hk, sk, d] shapes."""
    b, h, sq, _ = q_shape
    hk, sk = k_shape[2], k_shape[3]
    return b, h, hk, sq // cfg.hop.block_q, sk // cfg.hop.block_kv


def ring_buffers(cfg, kv, kmeta):
    """``(shape, dtype)`` of the travelling K/V and key-metadata HBM buffers (two slots each, outputs of the
    kernel), or None for each on a ring of one, where nothing travels (`fused_ring.held`)."""
    if cfg.axis_size == 1:
        return None, None
    return ((2,) + kv.shape, kv.dtype), ((2,) + kmeta.shape, jnp.int32)


def fused_call(kernel, name, cfg, prog, *, out_shape, in_specs, out_specs, scratch, vmem_limit=None):
    """The ``pallas_call`` of one fused-ring kernel: grid = (axis_size,) ring steps in order, the
    `fused_ring.schedule` tables scalar-prefetched; ``vmem_limit`` (default ``cfg.vmem_limit``)."""
    return pl.pallas_call(
        functools.partial(kernel, cfg, prog),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=N_TABLES, grid=(cfg.axis_size,), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        # a ring of one has no barrier (`fused_ring.prologue`), and Mosaic refuses a collective id without one
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             collective_id=COLLECTIVE_ID if cfg.axis_size > 1 else None,
                                             has_side_effects=True,
                                             vmem_limit_bytes=cfg.vmem_limit if vmem_limit is None else vmem_limit),
        interpret=cfg.interpret, name=name,
    )


def vmem(tiles):
    """VMEM scratch from ``(shape, dtype)`` pairs."""
    return [pltpu.VMEM(shape, dt) for shape, dt in tiles]


def outputs(cfg, like, *shapes_dtypes):
    """Output types (`tiles.out_struct`) from ``(shape, dtype)`` pairs (None: no such output, the kernel's ref is
    None), then the computed-tile counter (int32 [1] in SMEM with ``cfg.count``, else None); every other
    output lives in HBM."""
    structs = [None if sd is None else out_struct(*sd, like) for sd in shapes_dtypes]
    structs.append(out_struct((1,), jnp.int32, like) if cfg.count else None)
    specs = [None if sd is None else ANY for sd in shapes_dtypes]
    specs.append(pl.BlockSpec(memory_space=pltpu.SMEM) if cfg.count else None)
    return structs, specs


def consts(cfg):
    """The `tiles.Program` of ``cfg.hop`` (or None), its consts (a tuple) and their in_specs (each whole, in VMEM)."""
    prog = program(cfg.hop, cfg.hop.block_q, cfg.hop.block_kv)
    values = () if prog is None else prog.consts
    return prog, values, tuple(pl.BlockSpec(memory_space=pltpu.VMEM) for _ in values)
