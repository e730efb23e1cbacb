"""Pallas per-hop kernels (``pallas_gpu``, ``pallas_tpu``) against the float64 per-hop oracle.

The oracle is ``ringattn_ref.hop_attention`` / ``hop_attention_vjp`` (one hop, given the final lse
and delta). Both modules run interpreted on CPU (Triton: ``interpret=True``; TPU: ``InterpretParams``
with race detection). The interpreters are slow, so problems are small and examples few.
"""
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd, pallas_gpu, pallas_tpu, tiles, xla
from ringattn_fast.kernels.tiles import empty_tiles
from ringattn_fast.masks import mark_bad_keys
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_ref import hop_attention, hop_attention_vjp
from ringattn_ref.masks import allowed
from helpers import FUSED_INTERPRETER_OK, examples, rel_err

MODULES = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}
TOL = 2e-5  # float32, relative to the largest oracle magnitude (at least 1)
BF16_TOL = 1e-2  # bf16 inputs, fp32 accumulation (measured ~2e-3: P is rounded to bf16 before P @ V)


def hop_problem(q, k, v, do, q_pos, k_pos, q_seg=None, k_seg=None, **cfg):
    """A problem dict: float32 arrays, int32 positions [b, s] (segments or None), HopConfig kwargs."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    return dict(q=f32(q), k=f32(k), v=f32(v), do=f32(do), q_pos=as_int(q_pos), k_pos=as_int(k_pos),
                q_seg=as_int(q_seg), k_seg=as_int(k_seg), cfg=HopConfig(**cfg))


@st.composite
def problems(draw, batches=(1, 2), blocks=(8, 16), max_tiles=4, dims=(32, 48, 64, 128)):
    """A small hop: shapes, GQA, blocks, a layout of true positions, masks and a data seed."""
    b = draw(st.sampled_from(batches))
    hk, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from(dims))  # 48: the Triton wrapper pads it to 64
    block_q, block_kv = draw(st.sampled_from(blocks)), draw(st.sampled_from(blocks))
    sq, sk = block_q * draw(st.integers(1, max_tiles)), block_kv * draw(st.integers(1, max_tiles))
    layout = draw(st.sampled_from(["contiguous", "striped", "random"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if layout == "contiguous":  # this host's Q against a past, present or future K/V shard
        q_pos = np.broadcast_to(np.arange(sq) + draw(st.sampled_from([0, 16, 32])), (b, sq))
        k_pos = np.broadcast_to(np.arange(sk) + draw(st.sampled_from([0, 16, 32])), (b, sk))
    elif layout == "striped":  # host r of n owns r, r + n, r + 2n, ... (Brandon et al. 2023)
        n = draw(st.sampled_from([2, 4]))
        q_pos = np.broadcast_to(np.arange(sq) * n + draw(st.integers(0, n - 1)), (b, sq))
        k_pos = np.broadcast_to(np.arange(sk) * n + draw(st.integers(0, n - 1)), (b, sk))
    else:  # any permutation: positions need not be sorted nor contiguous
        q_pos = np.stack([rng.permutation(2 * (sq + sk))[:sq] for _ in range(b)])
        k_pos = np.stack([rng.permutation(2 * (sq + sk))[:sk] for _ in range(b)])
    causal = draw(st.booleans())
    window = draw(st.none() | st.tuples(st.sampled_from([-1, 0, 3, 16]), st.sampled_from([-1, 0, 5])))
    seg_len = draw(st.sampled_from([None, 6, 24]))  # documents packed along the true positions
    q_seg, k_seg = (None, None) if seg_len is None else (q_pos // seg_len, k_pos // seg_len)
    normal = lambda *shape: rng.standard_normal(shape)
    return hop_problem(normal(b, sq, hk * group, d), normal(b, sk, hk, d), normal(b, sk, hk, d),
                       normal(b, sq, hk * group, d), q_pos, k_pos, q_seg, k_seg, scale=float(d) ** -0.5,
                       causal=causal, window=window, block_q=block_q, block_kv=block_kv)


def shards(pb, dtype=jnp.float32, marked=True):
    """(QShard, KVShard) of a problem as the ring hands them to a kernel: q, k, v cast to ``dtype``,
    K/V marked by ``masks.mark_bad_keys`` (a key holding a nan/inf: V = 0, K all-NaN) unless not ``marked``
    (as the ring hands them to ``pallas_tpu``, which marks them itself)."""
    k, v = pb["k"].astype(dtype), pb["v"].astype(dtype)
    k, v = mark_bad_keys(k, v) if marked else (k, v)
    return QShard(pb["q"].astype(dtype), pb["q_pos"], pb["q_seg"]), KVShard(k, v, pb["k_pos"], pb["k_seg"])


def run_hop(mod, pb, dtype=jnp.float32, marked=True):
    """Forward and backward of one hop (its own lse is the final lse): o, lse, dq, dk, dv."""
    qs, kv = shards(pb, dtype, marked)
    do = pb["do"].astype(dtype)
    o, lse = mod.hop_fwd(qs, kv, pb["cfg"])
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o)  # FA-2 D = rowsum(dO * O)
    grads = mod.hop_bwd(qs, kv, pb["cfg"], do=do, lse=lse, delta=delta)
    assert grads.dbias is None
    return o, lse, grads.dq, grads.dk, grads.dv


def run_oracle(pb):
    """The float64 oracle on the raw K/V (it marks bad keys itself): o, lse of the hop and (dq, dk, dv)
    from its own lse and delta."""
    cfg = dataclasses.replace(pb["cfg"], block_q=None, block_kv=None)  # the oracle's own tiles: any give the same
    q, k, v = (np.asarray(pb[n]) for n in ("q", "k", "v"))
    q_pos, k_pos, q_seg, k_seg = (None if pb[n] is None else np.asarray(pb[n]) for n in ("q_pos", "k_pos", "q_seg", "k_seg"))
    qs, kv = QShard(q, q_pos, q_seg), KVShard(k, v, k_pos, k_seg)
    o, lse = hop_attention(qs, kv, cfg)
    do = np.asarray(pb["do"], np.float64)
    with np.errstate(invalid="ignore"):
        delta = np.einsum("bqhd,bqhd->bhq", do, o)
    return (o, lse) + tuple(hop_attention_vjp(qs, kv, cfg, do=do, lse=lse, delta=delta)[:3])


def assert_matches_oracle(got, want, tol):
    """float32 outputs; the same -inf (rows that see nothing) and NaN patterns; close elsewhere."""
    names = ("o", "lse", "dq", "dk", "dv")
    assert all(x.dtype == jnp.float32 for x in got), [x.dtype for x in got]
    got = [np.asarray(x, np.float64) for x in got]
    for name, x, ref in zip(names, got, want):
        np.testing.assert_array_equal(np.isnan(x), np.isnan(ref), err_msg=f"{name}: NaN pattern")
        np.testing.assert_array_equal(np.isneginf(x), np.isneginf(ref), err_msg=f"{name}: -inf pattern")
        finite = np.isfinite(ref)
        assert rel_err(x[finite], ref[finite]) <= tol, (name, rel_err(x[finite], ref[finite]))


@pytest.mark.slow
@settings(max_examples=examples(6))
@given(problems())
def test_gpu_kernel_matches_oracle_and_counts_tiles(pb):
    assert_matches_oracle(run_hop(pallas_gpu, pb), run_oracle(pb), TOL)
    counts = pallas_gpu.fwd_tile_counts(*shards(pb), pb["cfg"])
    empty = empty_tiles(pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"], causal=pb["cfg"].causal,
                        window=pb["cfg"].window, block_q=pb["cfg"].block_q, block_kv=pb["cfg"].block_kv)
    np.testing.assert_array_equal(counts, np.broadcast_to((~empty).sum(-1)[:, None], counts.shape))


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(problems(batches=(1,), max_tiles=3))
def test_tpu_kernel_matches_oracle(pb):
    assert_matches_oracle(run_hop(pallas_tpu, pb), run_oracle(pb), TOL)


def exact_mask(q_pos, k_pos, q_seg, k_seg, *, causal, window):
    """bool [b, sq, sk] from the shared vocabulary, in int64 (no overflow whatever the positions)."""
    i, j = np.asarray(q_pos, np.int64)[:, :, None], np.asarray(k_pos, np.int64)[:, None, :]
    seg = (None, None) if q_seg is None else (np.asarray(q_seg)[:, :, None], np.asarray(k_seg)[:, None, :])
    mask = allowed(i, j, *seg, causal=causal, window=window)
    return np.ones(np.broadcast_shapes(i.shape, j.shape), bool) if mask is None else mask


def tile_any(mask, block_q, block_kv):
    """bool [b, nq, nk]: does the tile hold a visible pair?"""
    b, sq, sk = mask.shape
    return np.asarray(mask).reshape(b, sq // block_q, block_q, sk // block_kv, block_kv).any(axis=(2, 4))


@pytest.mark.slow
@settings(max_examples=examples(30))
@given(problems(blocks=(4, 8)))
def test_empty_tiles_are_only_empty_tiles(pb):
    """Any layout (contiguous, striped, permuted), masks and segments: a tile called empty has an empty mask."""
    cfg, pos = pb["cfg"], (pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"])
    empty = np.asarray(empty_tiles(*pos, causal=cfg.causal, window=cfg.window, block_q=cfg.block_q,
                                   block_kv=cfg.block_kv))
    mask = exact_mask(*pos, causal=cfg.causal, window=cfg.window)
    assert not np.any(tile_any(mask, cfg.block_q, cfg.block_kv) & empty)


def test_empty_tiles_are_exact_for_contiguous_positions():
    """Each tile's positions form a full integer range, so causal/window skipping loses nothing:
    every offset between a Q shard and a K/V shard, every window edge, blocks of 4."""
    k_pos = jnp.arange(16)[None] + 20
    for q_off in range(41):  # queries 20 before .. 20 after the keys
        q_pos = jnp.arange(16)[None] + q_off
        for causal in (False, True):
            for window in (None, (0, 0), (3, -1), (-1, 2), (5, 7), (9, 0)):
                empty = empty_tiles(q_pos, k_pos, causal=causal, window=window, block_q=4, block_kv=4)
                mask = exact_mask(q_pos, k_pos, None, None, causal=causal, window=window)
                np.testing.assert_array_equal(~empty, tile_any(mask, 4, 4), err_msg=f"{q_off} {causal} {window}")


def test_empty_tiles_near_int32_max():
    """Positions up to 2**31 - 1 with a window: exact, no overflow (the old predicate computed
    ``q_hi + right``, which wraps to a negative int32 and skipped visible tiles)."""
    top = 2**31 - 1
    q_pos, k_pos = (jnp.arange(top - 31, top + 1, dtype=jnp.int32)[None],) * 2
    for window in ((3, 5), (0, 9), (-1, 7)):
        empty = empty_tiles(q_pos, k_pos, causal=False, window=window, block_q=8, block_kv=8)
        mask = exact_mask(q_pos, k_pos, None, None, causal=False, window=window)
        np.testing.assert_array_equal(~empty, tile_any(mask, 8, 8), err_msg=str(window))


def test_resident_blocks_hold_the_last_computed_tile():
    """The TPU index maps' table: a skipped step keeps the previous computed block (no new DMA)."""
    computed = jnp.asarray([[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]], bool)
    np.testing.assert_array_equal(tiles.resident_blocks(~computed),
                                  [[1, 1, 1, 1, 4, 4], [0] * 6, [0, 1, 2, 3, 4, 5], [3, 3, 3, 3, 3, 3]])


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_positions_near_int32_max(name):
    """The kernels' in-tile mask at positions up to 2**31 - 1 with a window matches the oracle (the
    old ``k_pos <= q_pos + right`` overflowed)."""
    rng = np.random.default_rng(5)
    pos = np.arange(2**31 - 16, 2**31, dtype=np.int64)[None]
    pb = hop_problem(*(rng.standard_normal(s) for s in [(1, 16, 1, 8)] * 4), pos, pos, scale=0.5,
                     window=(3, 5), block_q=8, block_kv=8)
    assert_matches_oracle(run_hop(MODULES[name], pb), run_oracle(pb), TOL)


def poisoned_problem(layout):
    """A hop where some K/V tiles are invisible to every query; their K and V are NaN.

    Any arithmetic on a skipped tile (even masked: 0 * NaN = NaN in P @ V) makes the output NaN,
    so a finite, correct result shows the kernel really skipped those tiles.
    """
    rng = np.random.default_rng(0)
    sq, sk, h, d = 32, 64, 2, 32
    if layout == "causal":  # queries 0..31 against keys 0..63: keys 32..63 are in their future
        q_pos, k_pos, causal, window = np.arange(sq), np.arange(sk), True, None
    else:  # striped queries (odd positions 65..127), keys 0..63 shuffled: a 16-token window back
        q_pos, k_pos, causal, window = 2 * np.arange(sq) + 65, rng.permutation(sk), False, (16, 0)
    pb = hop_problem(rng.standard_normal((1, sq, h, d)), rng.standard_normal((1, sk, 1, d)),
                     rng.standard_normal((1, sk, 1, d)), rng.standard_normal((1, sq, h, d)), q_pos[None],
                     k_pos[None], scale=d ** -0.5, causal=causal, window=window, block_q=8, block_kv=8)
    computed = ~np.asarray(empty_tiles(pb["q_pos"], pb["k_pos"], causal=causal, window=window,
                                       block_q=8, block_kv=8))
    dead_rows = np.repeat(~computed[0].any(axis=0), 8)  # K/V rows in tiles no Q tile computes
    assert 0 < dead_rows.sum() < sk
    return pb, dead_rows


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("pallas_gpu", "causal"), ("pallas_gpu", "striped_window"),
                                          ("pallas_tpu", "striped_window")])
def test_kernels_skip_tiles_nan_poison(name, layout):
    pb, dead = poisoned_problem(layout)
    want = run_oracle(pb)
    nan = jnp.where(jnp.asarray(dead)[None, :, None, None], jnp.nan, 1.0)
    got = run_hop(MODULES[name], dict(pb, k=pb["k"] * nan, v=pb["v"] * nan))
    assert_matches_oracle(got, want, TOL)
    assert np.all(np.asarray(got[3])[:, dead] == 0) and np.all(np.asarray(got[4])[:, dead] == 0)


def nan_problem():
    """Causal, 32 tokens, tiles of 8, batch 2. Example 0: K and V NaN at key 29, which queries 24..28
    cannot see although their (diagonal) tile is computed. Example 1: V NaN at key 13, seen by
    queries 13..31, not by 8..12 in the same tile."""
    rng = np.random.default_rng(7)
    q, do = rng.standard_normal((2, 2, 32, 2, 16))
    k, v = rng.standard_normal((2, 2, 32, 1, 16))
    k[0, 29], v[0, 29], v[1, 13] = np.nan, np.nan, np.nan
    pos = np.broadcast_to(np.arange(32), (2, 32))
    return hop_problem(q, k, v, do, pos, pos, scale=0.25, causal=True, block_q=8, block_kv=8)


def check_nan_semantics(got, pb):
    """The oracle's NaN pattern exactly; and rows that see no bad key equal the oracle on zeroed keys."""
    assert_matches_oracle(got, run_oracle(pb), TOL)
    clean = run_oracle(dict(pb, k=jnp.nan_to_num(pb["k"]), v=jnp.nan_to_num(pb["v"])))
    o = np.asarray(got[0])
    assert np.isnan(o[0, 29:]).all() and np.isnan(o[1, 13:]).all()
    for ex, rows in ((0, slice(0, 29)), (1, slice(0, 13))):  # the keys they cannot see contribute nothing
        assert np.isfinite(o[ex, rows]).all()
        assert rel_err(o[ex, rows], clean[0][ex, rows]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_masked_nan_keys_contribute_nothing(name):
    """NaN K/V at keys masked for some queries of a computed tile: those queries' outputs are finite
    and exactly the oracle's, and so are all gradients where the oracle's are (the old kernels made
    dQ NaN through ``0 * nan`` in ``dS K``, and hid a NaN row as o = 0, lse = -inf); a NaN V at a
    visible key makes NaN exactly the rows that see it, as in the oracle."""
    pb = nan_problem()
    check_nan_semantics(run_hop(MODULES[name], pb), pb)


@pytest.mark.slow
def test_tpu_kernel_counts_computed_tiles():
    """The TPU forward's SMEM debug counter counts the tiles that are not empty (striped, causal, segments)."""
    q_pos, k_pos = jnp.arange(32)[None] * 4 + 3, jnp.arange(32)[None] * 4 + 1  # striped, hosts 3 and 1
    seg = lambda pos: pos // 48
    x = jnp.ones((1, 32, 2, 32), jnp.float32)
    cfg = HopConfig(scale=0.2, causal=True, window=(40, -1), block_q=8, block_kv=8)
    qs, kv = QShard(x, q_pos, seg(q_pos)), KVShard(x[:, :, :1], x[:, :, :1], k_pos, seg(k_pos))
    counts = pallas_tpu.fwd_tile_counts(qs, kv, cfg)
    computed = ~empty_tiles(q_pos, k_pos, seg(q_pos), seg(k_pos), causal=True, window=(40, -1),
                            block_q=8, block_kv=8)
    assert 0 < computed.sum() < computed.size  # some tiles skipped, some computed
    np.testing.assert_array_equal(counts, np.broadcast_to(computed.sum(-1)[:, None], counts.shape))


def pallas_outputs(fn, *args):
    """The number of outputs of every pallas_call in ``fn(*args)``'s jaxpr (nested jaxprs included)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield len(eqn.outvars)
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("name", MODULES)
def test_forward_counts_tiles_only_when_asked(name):
    """``hop_fwd`` has two outputs (o, lse); only ``fwd_tile_counts`` adds the counter (the old
    pallas_gpu forward always wrote one)."""
    pb, _ = poisoned_problem("causal")
    qs, kv = shards(pb)
    mod = MODULES[name]
    assert pallas_outputs(lambda qs, kv: mod.hop_fwd(qs, kv, pb["cfg"]), qs, kv) == [2]
    assert pallas_outputs(lambda qs, kv: mod.fwd_tile_counts(qs, kv, pb["cfg"]), qs, kv) == [3]


def test_kernels_take_named_refs():
    """Every kernel names its refs (no ``*refs`` unpacked by position): absent inputs are None refs."""
    kernels = [f for mod in (pallas_gpu, pallas_tpu, fused_ring_fwd, fused_ring_bwd) for n, f in vars(mod).items()
               if n.endswith("_kernel") and callable(f)]
    assert len(kernels) == 11  # fwd, dq, dkv (x2); the TPU key-major dK/dV and fused backward; the fused ring's
    # fwd and its backward's one pass and two passes
    for f in kernels:
        kinds = {p.kind for p in inspect.signature(f).parameters.values()}
        assert inspect.Parameter.VAR_POSITIONAL not in kinds, f.__qualname__


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_two_hops_merge_with_final_lse(name):
    """Ring use: per-hop (o, lse) merged as (o, lse) pairs (``softmax.merge``); backward per hop from the final lse."""
    rng = np.random.default_rng(1)
    b, s, h, hk, d = 1, 32, 2, 1, 48  # d = 48: not a power of two (the Triton wrapper pads it)
    pos = np.arange(2 * s).reshape(s, 2).T.reshape(1, -1)  # striped over 2 hosts
    pb = hop_problem(rng.standard_normal((b, s, h, d)), rng.standard_normal((b, 2 * s, hk, d)),
                     rng.standard_normal((b, 2 * s, hk, d)), rng.standard_normal((b, s, h, d)), pos[:, s:], pos,
                     scale=0.2, causal=True, block_q=8, block_kv=16)
    mod, cfg = MODULES[name], pb["cfg"]
    qs = QShard(pb["q"], pb["q_pos"])
    hops = [KVShard(pb["k"][:, sl], pb["v"][:, sl], pb["k_pos"][:, sl]) for sl in (slice(0, s), slice(s, 2 * s))]
    outs = [mod.hop_fwd(qs, kv, cfg) for kv in hops]
    lse = jnp.logaddexp(outs[0][1], outs[1][1])
    o = sum(jnp.exp(l - lse).transpose(0, 2, 1)[..., None] * o_hop for o_hop, l in outs)
    delta = jnp.einsum("bqhd,bqhd->bhq", pb["do"], o)
    grads = [mod.hop_bwd(qs, kv, cfg, do=pb["do"], lse=lse, delta=delta) for kv in hops]
    dq = grads[0].dq + grads[1].dq
    dk, dv = (jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))
    assert_matches_oracle((o, lse, dq, dk, dv), run_oracle(pb), TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_kernels_inside_shard_map(name):
    """As in the ring: under shard_map(check_vma=True), Q sharded over 2 devices with positions from
    axis_index (varying), K/V and their positions replicated (not varying). Keys start at 16, so
    device 0's whole hop is empty (every tile skipped) while device 1 computes: the kernel runs on
    both (no ``lax.cond`` around it: the TPU interpreter's barrier needs every device)."""
    pb, _ = poisoned_problem("causal")  # q_pos 0..31, causal; no poison here
    pb = dict(pb, k_pos=pb["k_pos"] + 16)
    mod, cfg = MODULES[name], pb["cfg"]
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def per_device(q, do, k, v):
        sq = q.shape[1]
        q_pos, k_pos = (jax.lax.axis_index("sp") * sq + jnp.arange(sq))[None], 16 + jnp.arange(k.shape[1])[None]
        qs, kv = QShard(q, q_pos), KVShard(k, v, k_pos)
        o, lse = mod.hop_fwd(qs, kv, cfg)
        grads = mod.hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=jnp.einsum("bqhd,bqhd->bhq", do, o))
        return o, lse, grads.dq, jax.lax.psum(grads.dk, "sp"), jax.lax.psum(grads.dv, "sp")

    rows, P = jax.P(None, "sp"), jax.P()
    ring_like = jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, P, P),
                              out_specs=(rows, jax.P(None, None, "sp"), rows, P, P))
    got = jax.jit(ring_like)(pb["q"], pb["do"], pb["k"], pb["v"])
    assert np.all(np.isneginf(np.asarray(got[1])[:, :, :16]))  # device 0: nothing seen
    assert_matches_oracle(got, run_oracle(pb), TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_bf16_inputs(name):
    """bf16 in, fp32 accumulation, fp32 out: within BF16_TOL of the float64 oracle on the same values."""
    pb, _ = poisoned_problem("striped_window")
    pb = dict(pb, **{n: pb[n].astype(jnp.bfloat16).astype(jnp.float32) for n in ("q", "k", "v", "do")})
    got = run_hop(MODULES[name], pb, dtype=jnp.bfloat16)
    assert_matches_oracle(got, run_oracle(pb), BF16_TOL)


@pytest.mark.parametrize("name", MODULES)
def test_dtype_rules(name):
    """float16/bfloat16/float32 in, one dtype for q, k, v; float64 is rejected (it used to crash in
    pallas_gpu, ``cond branches must have equal output types``, and come back from pallas_tpu as
    float64 at float32 accuracy), and so is f32 q with bf16 k/v (pallas_gpu lost 1e-3 on it)."""
    pb, _ = poisoned_problem("causal")
    mod, cfg = MODULES[name], pb["cfg"]
    with jax.enable_x64(True):
        qs, kv = shards(pb, jnp.float64)
        with pytest.raises(ValueError, match=f"impl='{name}' computes in float32 .*got float64: use impl='xla'"):
            mod.hop_fwd(qs, kv, cfg)
        with pytest.raises(ValueError, match="got float64"):
            mod.hop_bwd(qs, kv, cfg, do=qs.q, lse=jnp.zeros((1, 2, 32)), delta=jnp.zeros((1, 2, 32)))
    qs, kv = shards(pb)
    mixed = kv._replace(k=kv.k.astype(jnp.bfloat16), v=kv.v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=f"impl='{name}' needs q, k, v of one dtype; got q float32, k bfloat16"):
        mod.hop_fwd(qs, mixed, cfg)
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        tiles.check_kernel_dtypes(name, *(jnp.zeros(2, dtype),) * 3)


@pytest.mark.parametrize("name", MODULES)
def test_bias_is_rejected(name):
    pb, _ = poisoned_problem("causal")
    qs, kv = shards(pb)
    kv = kv._replace(bias=jnp.zeros((1, 2, 32, 64)))
    with pytest.raises(ValueError, match=f"impl='{name}': the Pallas kernels take no bias; use impl='xla'"):
        MODULES[name].hop_fwd(qs, kv, pb["cfg"])
    lse = jnp.zeros((1, 2, 32))
    with pytest.raises(ValueError, match="take no bias"):
        MODULES[name].hop_bwd(qs, kv, pb["cfg"], do=pb["do"], lse=lse, delta=lse)


def device(platform, kind=None):
    kind = kind or {"cpu": "cpu", "tpu": "TPU v5 lite"}.get(platform, "NVIDIA H100 80GB HBM3")
    return jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=platform)


def on_mesh_of(platform):
    """A context in which the mesh's devices are ``platform``'s (an abstract mesh), on this CPU host."""
    mesh = jax.sharding.AbstractMesh((2,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=device("cuda" if platform == "gpu" else platform))
    return jax.sharding.use_abstract_mesh(mesh)


def test_interpret_mode_per_impl_and_platform():
    """One resolver, on the mesh's device (not jax.default_backend()): True / InterpretParams(detect_races
    =True) on CPU, compiled on the impl's own platform, a ValueError naming the impl and the platform
    elsewhere; with no device given it reads the mesh in context (here an abstract one). On a JAX too old
    for the fused ring's interpreter, the fused impl on CPU is a RuntimeError naming the version."""
    races = pltpu.InterpretParams(detect_races=True)
    fused_cpu = races if FUSED_INTERPRETER_OK else "old jax"
    want = {"cpu": (True, races, fused_cpu), "gpu": (False, "tpu", "tpu"), "tpu": ("gpu", False, False)}
    for platform, modes in want.items():
        for impl, mode in zip(("pallas_gpu", "pallas_tpu", "pallas_tpu_fused"), modes):
            if mode == "old jax":
                with pytest.raises(RuntimeError, match=r"impl='pallas_tpu_fused' interpreted on CPU needs jax >= "):
                    tiles.interpret_mode(impl, device(platform))
            elif mode in ("gpu", "tpu"):
                with pytest.raises(ValueError, match=f"impl='{impl}' needs a {mode.upper()} .*the mesh's platform "
                                                     f"is '{platform}'"):
                    tiles.interpret_mode(impl, device(platform))
            else:
                assert tiles.interpret_mode(impl, device(platform)) == mode, (platform, impl)
    assert tiles.interpret_mode("pallas_tpu") == races  # no mesh: this CPU host
    with on_mesh_of("tpu"):
        assert tiles.interpret_mode("pallas_tpu") is False and jax.default_backend() == "cpu"


@pytest.mark.parametrize("name, other", [("pallas_gpu", "tpu"), ("pallas_tpu", "gpu")])
def test_wrong_platform_is_rejected(name, other):
    pb, _ = poisoned_problem("causal")
    qs, kv = shards(pb)  # made on this host, before entering the abstract mesh
    with on_mesh_of(other), pytest.raises(ValueError, match=f"the mesh's platform is '{'cuda' if other == 'gpu' else other}'"):
        MODULES[name].hop_fwd(qs, kv, pb["cfg"])


@pytest.mark.parametrize("name", MODULES)
def test_block_must_divide_the_shard(name):
    pb, _ = poisoned_problem("causal")
    cfg = HopConfig(scale=0.1, causal=True, block_q=8, block_kv=24)
    with pytest.raises(ValueError, match="block_kv must divide sk"):
        MODULES[name].hop_fwd(*shards(pb), cfg)


def test_tpu_tiling_rule():
    """On a TPU block_kv must be a multiple of 128 (or the whole shard); interpreted, a multiple of 8."""
    pb, _ = poisoned_problem("causal")
    with pytest.raises(ValueError, match="block_q % 8"):
        pallas_tpu.hop_fwd(*shards(pb), HopConfig(scale=0.1, block_q=4, block_kv=8))
    qs, kv = shards(pb)
    with on_mesh_of("tpu"), pytest.raises(ValueError, match="block_kv % 128"):
        pallas_tpu.hop_fwd(qs, kv, HopConfig(scale=0.1, block_q=8, block_kv=32))


@pytest.mark.parametrize("backward", ["fused", "key_major", "query_major"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(200, 0)), dict(segments=True)])
def test_tpu_kernel_in_place_layout_and_stat_rows(mask, backward, monkeypatch):
    """d = 128 and 128-token tiles: the TPU kernel reads and writes [b, s, h * d] in place and keeps lse /
    delta as lane-dense rows (`pallas_tpu._direct`, `_stat_rows`); a causal / window / segmented hop has
    empty, full (no mask computed) and partial tiles. Forward and backward vs the float64 oracle; with
    ``out_dtype`` the outputs come back in that dtype: o and lse equal to the float32 ones (rounded), the
    gradients within bf16 rounding (their delta comes from the rounded o). The backward as one fused
    kernel (``FUSED_BWD``) or as dQ and dK/dV kernels, the latter in both orientations (``KEY_MAJOR_DKV``)."""
    monkeypatch.setattr(pallas_tpu, "FUSED_BWD", backward == "fused")
    monkeypatch.setattr(pallas_tpu, "KEY_MAJOR_DKV", backward == "key_major")
    rng = np.random.default_rng(3)
    b, sq, sk, hk, group, d = 1, 256, 384, 1, 2, 128
    q_pos, k_pos = np.arange(sq)[None] + 128, np.arange(sk)[None]
    seg = mask.pop("segments", False)
    q_seg, k_seg = (q_pos // 160, k_pos // 160) if seg else (None, None)
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    pb = hop_problem(normal(b, sq, hk * group, d), normal(b, sk, hk, d), normal(b, sk, hk, d),
                     normal(b, sq, hk * group, d), q_pos, k_pos, q_seg, k_seg, scale=d ** -0.5,
                     block_q=128, block_kv=128, **mask)
    assert pallas_tpu._direct(d, d) and pallas_tpu._stat_rows(pb["cfg"])
    got = run_hop(pallas_tpu, pb)
    assert_matches_oracle(got, run_oracle(pb), TOL)
    pb["cfg"] = dataclasses.replace(pb["cfg"], out_dtype="bfloat16")
    half = run_hop(pallas_tpu, pb)
    for name, x, ref in zip(("o", "lse", "dq", "dk", "dv"), half, got):
        assert x.dtype == (jnp.float32 if name == "lse" else jnp.bfloat16), (name, x.dtype)
        x, ref = np.asarray(x.astype(jnp.float32)), np.asarray(ref.astype(x.dtype).astype(jnp.float32))
        if name in ("o", "lse"):
            np.testing.assert_array_equal(x, ref, err_msg=name)
        else:
            assert rel_err(x, ref) <= BF16_TOL, (name, rel_err(x, ref))


@pytest.mark.parametrize("backward", ["fused", "key_major"])
def test_tpu_lane_dense_path_with_nan_keys(backward, monkeypatch):
    """A key holding NaN (and one holding inf) on the lane-dense path (d = 128, 128-token tiles: in-place
    layout, lse rows, the fused or key-major backward): exactly the rows that may see it turn NaN, forward
    and backward, as the oracle says; a masked bad key contributes nothing (causal: later queries only)."""
    monkeypatch.setattr(pallas_tpu, "FUSED_BWD", backward == "fused")
    rng = np.random.default_rng(5)
    b, s, hk, group, d = 1, 256, 1, 2, 128
    pos = np.arange(s)[None]
    k = rng.standard_normal((b, s, hk, d))
    k[0, 200, 0, 3], k[0, 60, 0, 7] = np.nan, np.inf
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    pb = hop_problem(normal(b, s, hk * group, d), k, normal(b, s, hk, d), normal(b, s, hk * group, d), pos, pos,
                     scale=d ** -0.5, causal=True, block_q=128, block_kv=128)
    assert_matches_oracle(run_hop(pallas_tpu, pb), run_oracle(pb), TOL)


@pytest.mark.parametrize("backward", ["fused", pytest.param("key_major", marks=pytest.mark.slow),
                                      pytest.param("query_major", marks=pytest.mark.slow)])
def test_tpu_kernels_mark_bad_keys_themselves(backward, monkeypatch):
    """``pallas_tpu`` marks the K/V tiles that hold a nan/inf in VMEM (``Impl.marks_keys``: the ring hands it
    K/V unmarked): on raw K/V with NaN and inf keys (in K, in V, in tiles that some Q tiles skip, two batch rows, GQA)
    every output equals the one on K/V marked in HBM, bit for bit, on each backward."""
    monkeypatch.setattr(pallas_tpu, "FUSED_BWD", backward == "fused")
    monkeypatch.setattr(pallas_tpu, "KEY_MAJOR_DKV", backward == "key_major")
    rng = np.random.default_rng(13)
    b, s, hk, group, d = 2, 384, 2, 2, 128
    pos = np.broadcast_to(np.arange(s), (b, s))
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    k, v = normal(b, s, hk, d), normal(b, s, hk, d)
    k[0, 200, 0, 3], k[0, 60, 1, 7], v[1, 130, 1, 0], v[1, 300, 0, 5] = np.nan, np.inf, -np.inf, np.nan
    pb = hop_problem(normal(b, s, hk * group, d), k, v, normal(b, s, hk * group, d), pos, pos, scale=d ** -0.5,
                     causal=True, block_q=128, block_kv=128)
    marked, raw = run_hop(pallas_tpu, pb), run_hop(pallas_tpu, pb, marked=False)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), raw, marked):
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert np.isnan(np.asarray(marked[0])[0, 200:]).all() and np.isfinite(np.asarray(marked[0])[0, :60]).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_bad_tile_flags_are_set_where_a_tile_holds_a_nan_or_inf(dtype):
    """`pallas_tpu._bad_tiles` (sums over runs of keys first): a tile is flagged iff it
    holds a nan/inf in K or V (any head, any batch row), at either kernel's tile side, and where a finite
    sum overflows (harmless: the next test); tiles of 128 keys, and a tile side that is not a multiple of 128."""
    rng = np.random.default_rng(3)
    b, s, hk, d = 2, 512, 2, 128
    k, v = rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))
    k[0, 130, 1, 5], v[1, 511, 0, 0], k[1, 0, 0, 127] = np.nan, -np.inf, np.inf
    kv = KVShard(jnp.asarray(k, dtype), jnp.asarray(v, dtype), None, None)
    assert pallas_tpu._bad_tiles(kv, 128).tolist() == [0, 1, 0, 0, 1, 0, 0, 1]
    assert pallas_tpu._bad_tiles(kv, 256).tolist() == [1, 0, 1, 1]
    assert pallas_tpu._bad_tiles(kv, 512).tolist() == [1, 1]
    odd = KVShard(kv.k[:, :96], kv.v[:, :96], None, None)  # one tile of 96 keys (block_kv == sk), runs of 32
    assert pallas_tpu._bad_tiles(odd, 96).tolist() == [0, 1]
    big = np.asarray(jnp.finfo(dtype).max, np.float64)
    huge = KVShard(jnp.full((1, 256, 1, d), big, dtype), jnp.zeros((1, 256, 1, d), dtype), None, None)
    assert pallas_tpu._bad_tiles(huge, 128).tolist() == [1, 1]  # an overflowed sum: flagged, never missed


def test_tpu_a_flagged_tile_without_a_bad_key_is_left_as_it_is(monkeypatch):
    """A tile flagged with no nan/inf in it (a finite sum that overflowed) is marked in VMEM for nothing:
    `_mark_tile` tests each key, so with every tile flagged every output equals the unflagged run's, bit for
    bit (fused backward)."""
    rng = np.random.default_rng(8)
    b, s, hk, group, d = 1, 256, 1, 2, 128
    pos = np.arange(s)[None]
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    pb = hop_problem(normal(b, s, hk * group, d), normal(b, s, hk, d), normal(b, s, hk, d),
                     normal(b, s, hk * group, d), pos, pos, scale=d ** -0.5, causal=True, block_q=128, block_kv=128)
    plain = run_hop(pallas_tpu, pb, marked=False)
    calls = []

    def every_tile(kv, block_kv):
        calls.append(block_kv)
        return jnp.ones(kv.k.shape[0] * (kv.k.shape[1] // block_kv), jnp.int32)
    monkeypatch.setattr(pallas_tpu, "_bad_tiles", every_tile)
    jax.clear_caches()  # the kernels' jitted wrappers traced `_bad_tiles` as it was
    try:
        flagged = run_hop(pallas_tpu, pb, marked=False)
    finally:  # no later test may meet a trace of these flags
        monkeypatch.undo()
        jax.clear_caches()
    assert calls, "the flags were not traced again"
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), flagged, plain):
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(problems(batches=(1,), blocks=(128, 256), max_tiles=2, dims=(128,)))
def test_tpu_lane_dense_tiles_take_sub_tiles_and_unmarked_keys(pb):
    """Property: at lane-dense tiles (d = 128, tiles of 128 or 256: lse rows, 2 x 2 sub-tiles of partial tiles,
    `pallas_tpu._sub_tiles`) and on K/V as the ring hands them over (unmarked: the kernels mark bad keys
    themselves), every layout, causal, window and segment mix equals the float64 oracle, forward and
    gradients, on whichever backward applies; with a NaN V and an inf K, at keys the mask hides from some
    queries, too (unmarked, either would leak into the rows that cannot see it, or hide from those that can)."""
    assert pallas_tpu._split(pb["cfg"], None, True) == pallas_tpu.SPLIT > 1
    k, v = np.array(pb["k"]), np.array(pb["v"])
    k[0, k.shape[1] // 2, 0, 5], v[0, k.shape[1] // 4, 0, 7] = np.inf, np.nan
    pb = dict(pb, k=jnp.asarray(k), v=jnp.asarray(v))
    assert_matches_oracle(run_hop(pallas_tpu, pb, marked=False), run_oracle(pb), TOL)


@pytest.mark.parametrize("block, backward, exp2, where", [
    (128, "fused", True, False), (128, "key_major", True, False), (128, "query_major", True, False),
    (16, "query_major", True, False), (128, "fused", False, True)])
def test_tpu_base2_logits_and_unmasked_full_tile_grads(backward, block, exp2, where, monkeypatch):
    """The opt-in base-2 logits (``pallas_tpu.EXP2``: P = exp2) with dS not zeroed where P is 0 on full tiles
    (``FULL_TILE_WHERE`` off, the default), and the opt-in where (the form shipped before the chip timed it)
    equal the float64 oracle, forward and gradients, on every backward, lane-dense tiles (key-major forms,
    2 x 2 sub-tiles) and small ones (query-major, lse columns), causal and windowed, GQA, with a NaN and an
    inf key the ring hands over unmarked."""
    monkeypatch.setattr(pallas_tpu, "EXP2", exp2)
    monkeypatch.setattr(pallas_tpu, "FULL_TILE_WHERE", where)
    monkeypatch.setattr(pallas_tpu, "FUSED_BWD", backward == "fused")
    monkeypatch.setattr(pallas_tpu, "KEY_MAJOR_DKV", backward == "key_major")
    rng = np.random.default_rng(17)
    b, s, hk, group, d = 1, 2 * block, 1, 2, 128
    pos = np.arange(s)[None]
    k, v = rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))
    k[0, s // 2 + 3, 0, 5], v[0, s // 4, 0, 7] = np.inf, np.nan
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    for mask in (dict(causal=True), dict(window=(block + 8, 0))):
        pb = hop_problem(normal(b, s, hk * group, d), k, v, normal(b, s, hk * group, d), pos, pos, scale=d ** -0.5,
                         block_q=block, block_kv=block, **mask)
        assert pallas_tpu._stat_rows(pb["cfg"]) == (block == 128)
        assert_matches_oracle(run_hop(pallas_tpu, pb, marked=False), run_oracle(pb), TOL)


def test_tpu_chunked_tiles_equal_the_oracle(monkeypatch):
    """The forward's row chunks and the fused backward's key chunks (``pallas_tpu.FWD_ROW_CHUNK``,
    ``BWD_KEY_CHUNK``; on a chip 512 of a 2048-query tile and 256 of a 1024-key one, here 32 of 128) equal
    the float64 oracle, forward and gradients: full tiles chunked, partial ones by their sub-tiles, or
    chunked and masked where tiles are not split (``SPLIT = 1``), causal and windowed, GQA, with a NaN and an
    inf key the ring hands over unmarked. The chunking is traced (each kernel asks `_chunks` for more than
    one slice)."""
    asked = []

    def chunks(size, chunk):
        got = real(size, chunk)
        asked.append((size, chunk, len(got)))
        return got
    real = pallas_tpu._chunks
    monkeypatch.setattr(pallas_tpu, "_chunks", chunks)
    monkeypatch.setattr(pallas_tpu, "FWD_ROW_CHUNK", 32)
    monkeypatch.setattr(pallas_tpu, "BWD_KEY_CHUNK", 32)
    jax.clear_caches()  # the kernels' jitted wrappers may hold traces of the shipped chunks
    try:
        rng = np.random.default_rng(29)
        b, block, hk, group, d = 1, 128, 1, 2, 128
        s = 3 * block
        pos = np.arange(s)[None]
        k, v = rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))
        k[0, s // 2 + 3, 0, 5], v[0, s // 4, 0, 7] = np.inf, np.nan
        normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
        for mask, block_kv, split in ((dict(causal=True), block, 2), (dict(window=(block + 8, 0)), block, 2),
                                      ({}, 3 * block, 2), (dict(causal=True), block, 1)):
            monkeypatch.setattr(pallas_tpu, "SPLIT", split)
            jax.clear_caches()  # a trace at the other SPLIT would be reused: the call's key does not hold it
            pb = hop_problem(normal(b, s, hk * group, d), k, v, normal(b, s, hk * group, d), pos, pos,
                             scale=d ** -0.5, block_q=block, block_kv=block_kv, **mask)
            assert_matches_oracle(run_hop(pallas_tpu, pb, marked=False), run_oracle(pb), TOL)
    finally:  # no later test may meet a trace of these chunks
        monkeypatch.undo()
        jax.clear_caches()
    assert (block, 32, 4) in asked and (3 * block, 32, 12) in asked, asked


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(problems(batches=(1, 2), blocks=(128, 256), max_tiles=2, dims=(128,)), st.sampled_from([1, 2]))
def test_tpu_chunked_tiles_on_drawn_problems(pb, split):
    """Property: with the tiles in chunks of 32 rows / keys (``FWD_ROW_CHUNK``, ``BWD_KEY_CHUNK``) and partial
    tiles sub-tiled or not (``SPLIT``), drawn lane-dense hops (any layout, causal, window and segment mix,
    GQA, batch 2; K/V unmarked, with a NaN V and an inf K) equal the float64 oracle, forward and gradients."""
    k, v = np.array(pb["k"]), np.array(pb["v"])
    k[0, k.shape[1] // 2, 0, 5], v[0, k.shape[1] // 4, 0, 7] = np.inf, np.nan
    pb = dict(pb, k=jnp.asarray(k), v=jnp.asarray(v))
    flags = dict(FWD_ROW_CHUNK=32, BWD_KEY_CHUNK=32, SPLIT=split)
    saved = {name: getattr(pallas_tpu, name) for name in flags}
    try:
        for name, value in flags.items():
            setattr(pallas_tpu, name, value)
        jax.clear_caches()  # the kernels' traces are keyed on the call, not on these settings
        assert_matches_oracle(run_hop(pallas_tpu, pb, marked=False), run_oracle(pb), TOL)
    finally:
        for name, value in saved.items():
            setattr(pallas_tpu, name, value)
        jax.clear_caches()


def test_chunks_are_whole_where_they_do_not_divide_the_tile():
    """`pallas_tpu._chunks`: runs of ``chunk`` rows where it divides the tile and is smaller, else the tile whole."""
    assert pallas_tpu._chunks(2048, 512) == [slice(0, 512), slice(512, 1024), slice(1024, 1536), slice(1536, 2048)]
    for size, chunk in ((256, 0), (256, 256), (256, 512), (384, 256)):
        assert pallas_tpu._chunks(size, chunk) == [slice(None)], (size, chunk)


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(problems(batches=(1,), blocks=(128, 256), max_tiles=2, dims=(128,)), st.sampled_from(["fused", "key_major"]))
def test_tpu_base2_and_unmasked_full_tile_forms_on_drawn_problems(pb, backward):
    """Property: with base-2 logits (``EXP2``, opt-in) and no dS where on full tiles (the default), drawn
    lane-dense hops (any layout, causal, window and segment mix, GQA; K/V unmarked) equal the float64
    oracle, forward and gradients, on the fused and the key-major backward."""
    flags = dict(EXP2=True, FULL_TILE_WHERE=False, FUSED_BWD=backward == "fused", KEY_MAJOR_DKV=True)
    saved = {name: getattr(pallas_tpu, name) for name in flags}
    try:
        for name, value in flags.items():
            setattr(pallas_tpu, name, value)
        assert_matches_oracle(run_hop(pallas_tpu, pb, marked=False), run_oracle(pb), TOL)
    finally:
        for name, value in saved.items():
            setattr(pallas_tpu, name, value)


def test_tpu_fused_backward_dk_is_as_accurate_as_dq():
    """bfloat16, the fused backward: dK = scale * dS^T Q takes Q as given. From the pre-scaled Q (rounded to
    bfloat16 after the multiply, as the logits use it) dK's error against the float64 oracle was 2.5x dQ's
    here, and 2.4x jax.nn's on a v5e (`tpu_checks --checks numerics`, plain, 2026-12-06)."""
    rng = np.random.default_rng(3)
    b, s, h, d = 1, 512, 2, 128
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731  (the oracle sees the same inputs)
    pos = np.broadcast_to(np.arange(s), (b, s))
    pb = hop_problem(*(bf16(rng.standard_normal((b, s, h, d))) for _ in range(4)), pos, pos, scale=d ** -0.5,
                     block_q=256, block_kv=256)
    got, want = run_hop(pallas_tpu, pb, jnp.bfloat16), run_oracle(pb)
    err = {name: float(np.max(np.abs(np.asarray(x, np.float64) - ref)))
           for name, x, ref in zip(("o", "lse", "dq", "dk", "dv"), got, want)}
    assert err["dk"] < 1.5 * max(err["dq"], err["dv"]), err


def test_only_the_per_hop_tpu_kernels_take_unmarked_keys():
    """The ring marks bad keys in HBM for every impl but ``pallas_tpu`` (which marks its tiles itself), and
    for that one too when K/V travel in a wire format (``comm_dtype``: a scaled cast maps inf to a finite value)."""
    from ringattn_fast.masks import marked_for_ring
    k = jnp.ones((1, 8, 1, 4)).at[0, 3, 0, 1].set(jnp.inf)
    kv = KVShard(k, jnp.ones_like(k), None, None)
    assert marked_for_ring(kv, "pallas_tpu", None) is kv
    for impl, comm in (("pallas_tpu", "bfloat16"), ("xla", None), ("pallas_gpu", None), ("pallas_tpu_fused", None)):
        got = marked_for_ring(kv, impl, comm)
        assert np.isnan(np.asarray(got.k)[0, 3]).all() and np.asarray(got.v)[0, 3].max() == 0, impl


@pytest.mark.parametrize("backward", ["fused", "two_kernels"])
def test_tpu_lane_dense_path_batch_and_kv_heads(backward, monkeypatch):
    """Batch 2 with rows of their own positions and segments, 2 kv heads of 2 query heads each, d = 128,
    128-token tiles: the fused backward's per-(batch, kv head) dK/dV scratch and the two-kernel backward
    alike equal the oracle."""
    monkeypatch.setattr(pallas_tpu, "FUSED_BWD", backward == "fused")
    rng = np.random.default_rng(11)
    b, s, hk, group, d = 2, 256, 2, 2, 128
    pos = np.stack([np.arange(s), np.arange(s) + 64])
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    pb = hop_problem(normal(b, s, hk * group, d), normal(b, s, hk, d), normal(b, s, hk, d),
                     normal(b, s, hk * group, d), pos, pos, pos // 100, pos // 100, scale=d ** -0.5, causal=True,
                     block_q=128, block_kv=128)
    assert_matches_oracle(run_hop(pallas_tpu, pb), run_oracle(pb), TOL)


@pytest.mark.slow
@settings(max_examples=examples(6))
@given(problems(batches=(1,), blocks=(128,), max_tiles=2, dims=(128,)))
def test_tpu_lane_dense_path_matches_oracle(pb):
    """Drawn hops on the lane-dense path the chip's defaults take (d = 128, 128-multiple tiles: the in-place
    [b, s, h * d] layout, lse / delta rows, the fused backward): any layout of positions, masks, GQA."""
    assert pallas_tpu._direct(128, 128) and pallas_tpu._stat_rows(pb["cfg"])
    assert_matches_oracle(run_hop(pallas_tpu, pb), run_oracle(pb), TOL)


@given(problems(blocks=(8, 16), max_tiles=4))
@settings(max_examples=examples(8))
def test_xla_hop_span_loop_matches_oracle(pb):
    """The XLA hop's span loop (``xla._span_loop``: large tiles, a TPU's defaults) on any layout and mask:
    tiles outside the span never run, a run of full tiles runs unmasked, the rest masked; here forced onto
    small tiles."""
    saved, xla.SPAN_MIN_TILE = xla.SPAN_MIN_TILE, 0
    try:
        assert_matches_oracle(run_hop(xla, pb), run_oracle(pb), TOL)
    finally:
        xla.SPAN_MIN_TILE = saved


@pytest.mark.parametrize("layout", ["causal", "striped_window"])
def test_xla_hop_span_loop_skips_dead_tiles(layout):
    """Tiles of NaN K/V that no query sees: the span loop leaves them out or masks them (finite, exact)."""
    pb, dead = poisoned_problem(layout)
    saved, xla.SPAN_MIN_TILE = xla.SPAN_MIN_TILE, 0
    try:
        nan = jnp.where(jnp.asarray(dead)[None, :, None, None], jnp.nan, 1.0)
        got = run_hop(xla, dict(pb, k=pb["k"] * nan, v=pb["v"] * nan))
    finally:
        xla.SPAN_MIN_TILE = saved
    assert_matches_oracle(got, run_oracle(pb), TOL)


@pytest.mark.parametrize("kinds, unmasked, masked", [
    ([0, 1, 1, 2, 0], [1, 2], [3]),  # a causal row: the full run alone unmasked
    ([2, 1, 1, 2, 0], [1, 2], [0, 3]),  # a window: partial tiles at both ends
    ([1, 2, 1, 0], [], [0, 1, 2]),  # two full runs (segments): all masked
    ([0, 0, 0], [], []),  # an empty row: nothing runs
    ([0, 2, 0, 2], [], [1, 2, 3]),  # an empty tile inside the span runs masked
])
def test_xla_hop_span_loop_visits(kinds, unmasked, masked):
    """Which tiles ``_span_loop`` runs, and with or without the mask."""
    def step(seen, j, is_masked):
        return seen.at[j].set(2 if is_masked else 1), None
    n = len(kinds)
    seen, _ = xla._span_loop(step, jnp.zeros(n, jnp.int32), jnp.arange(n), jnp.asarray(kinds))
    assert [j for j in range(n) if seen[j] == 1] == unmasked and [j for j in range(n) if seen[j] == 2] == masked


def test_xla_hop_spans_large_tiles_only():
    """The span loop is for tiles of at least 512 x 512 (a TPU's defaults); the CPU's 128 switch per tile."""
    assert xla._spans(HopConfig(block_q=1024, block_kv=1024)) and xla._spans(HopConfig(block_q=512, block_kv=512))
    assert not xla._spans(HopConfig(block_q=128, block_kv=128))


@given(problems(blocks=(8, 16), max_tiles=3))
@settings(max_examples=examples(4))
def test_xla_hop_backward_in_the_tpu_order_matches_oracle(pb):
    """On a TPU, and wherever a hop holds several key tiles, the XLA hop's backward computes ``S^T = K Q^T``
    directly (``xla._forward_order``: no barrier, no transposed tile); forced on every hop here, it is exact
    all the same. On a CPU a hop of one key tile takes the forward's own product."""
    assert xla._forward_order(1) and not xla._forward_order(8)
    saved, xla._forward_order = xla._forward_order, lambda n: False
    try:
        assert_matches_oracle(run_hop(xla, pb), run_oracle(pb), TOL)
    finally:
        xla._forward_order = saved
