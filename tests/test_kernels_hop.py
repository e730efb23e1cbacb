"""Pallas per-hop kernels (issue 4, kernels 1 and 2) against a plain masked-attention reference.

Both modules run interpreted on CPU (Triton: ``interpret=True``; TPU: ``InterpretParams`` with race
detection). The interpreters are slow, so problems are small and examples few.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ringattn_fast.kernels import pallas_gpu, pallas_tpu
from ringattn_fast.kernels.tiles import tile_schedule

MODULES = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}
TOL = 2e-5  # float32, relative to the largest reference magnitude (at least 1)
BF16_TOL = 1e-2  # bf16 inputs, fp32 accumulation (measured ~2e-3: P is rounded to bf16 before P @ V)


def reference_mask(q_pos, k_pos, q_seg, k_seg, *, causal, window):
    """bool [b, 1, sq, sk] from true positions (docs/design.md "Mask")."""
    i, j = q_pos[:, None, :, None], k_pos[:, None, None, :]
    mask = jnp.ones(i.shape[:3] + j.shape[3:], dtype=bool)
    if causal:
        mask &= j <= i
    if window is not None:
        left, right = window
        mask = mask & (j >= i - left) if left >= 0 else mask
        mask = mask & (j <= i + right) if right >= 0 else mask
    if q_seg is not None:
        mask &= q_seg[:, None, :, None] == k_seg[:, None, None, :]
    return mask


def reference(q, k, v, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window):
    """Plain masked softmax attention in float32: o [b, sq, h, d] (0 for empty rows), lse [b, h, sq]."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # GQA, in the reference only
    mask = reference_mask(q_pos, k_pos, q_seg, k_seg, causal=causal, window=window)
    s = jnp.where(mask, scale * jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest"), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v, precision="highest")
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return o, lse


def max_rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / max(1.0, np.max(np.abs(ref)))


@st.composite
def problems(draw, batches=(1, 2), blocks=(8, 16), max_tiles=4):
    """A small hop: shapes, GQA, blocks, a layout of true positions, masks and a data seed."""
    b = draw(st.sampled_from(batches))
    hk, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([32, 48, 64, 128]))  # 48: the Triton wrapper pads it to 64
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
    shapes = dict(q=(b, sq, hk * group, d), k=(b, sk, hk, d), v=(b, sk, hk, d))
    data = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}
    data["do"] = jnp.asarray(rng.standard_normal(shapes["q"]), jnp.float32)
    as_int = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    return dict(**data, q_pos=as_int(q_pos), k_pos=as_int(k_pos), q_seg=as_int(q_seg), k_seg=as_int(k_seg),
                opts=dict(scale=float(d) ** -0.5, causal=causal, window=window, block_q=block_q, block_kv=block_kv))


def run_hop(mod, pb, dtype=jnp.float32):
    """Forward and backward of one hop (its own lse is the final lse): o, lse, dq, dk, dv."""
    q, k, v, do = (pb[n].astype(dtype) for n in ("q", "k", "v", "do"))
    pos = (pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"])
    o, lse = mod.hop_fwd(q, k, v, *pos, None, **pb["opts"])
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o)  # FA-2 D = rowsum(dO * O)
    dq, dk, dv, dbias = mod.hop_bwd(q, k, v, do, lse, delta, *pos, None, **pb["opts"])
    assert dbias is None
    return o, lse, dq, dk, dv


def run_reference(pb):
    """Reference o, lse and (dq, dk, dv) = jax.vjp of the reference's o at do."""
    opts = {n: pb["opts"][n] for n in ("scale", "causal", "window")}
    pos = (pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"])
    (o, lse), vjp = jax.vjp(lambda q, k, v: reference(q, k, v, *pos, **opts), pb["q"], pb["k"], pb["v"])
    return o, lse, *vjp((pb["do"], jnp.zeros_like(lse)))


def assert_matches_reference(got, want, tol):
    o, lse, dq, dk, dv = got
    o_r, lse_r, dq_r, dk_r, dv_r = want
    assert o.dtype == lse.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))  # rows that see nothing
    finite = np.isfinite(lse_r)
    assert max_rel_err(np.where(finite, lse, 0), np.where(finite, lse_r, 0)) <= tol
    for name, x, ref in [("o", o, o_r), ("dq", dq, dq_r), ("dk", dk, dk_r), ("dv", dv, dv_r)]:
        assert np.all(np.isfinite(x)), name
        assert max_rel_err(x, ref) <= tol, (name, max_rel_err(x, ref))


@pytest.mark.slow
@settings(max_examples=6)
@given(problems())
def test_gpu_kernel_matches_reference_and_counts_tiles(pb):
    assert_matches_reference(run_hop(pallas_gpu, pb), run_reference(pb), TOL)
    pos, opts = (pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"]), pb["opts"]
    counts = pallas_gpu.fwd_tile_counts(pb["q"], pb["k"], pb["v"], *pos, **opts)
    schedule = tile_schedule(*pos, **{n: opts[n] for n in ("causal", "window", "block_q", "block_kv")})
    np.testing.assert_array_equal(counts, np.broadcast_to(schedule.sum(-1)[:, None], counts.shape))


@pytest.mark.slow
@settings(max_examples=3)
@given(problems(batches=(1,), max_tiles=3))
def test_tpu_kernel_matches_reference(pb):
    assert_matches_reference(run_hop(pallas_tpu, pb), run_reference(pb), TOL)


@settings(max_examples=30)
@given(problems(blocks=(4, 8)))
def test_tile_schedule_skips_only_empty_tiles(pb):
    """Any layout (contiguous, striped, permuted), masks and segments: a skipped tile has an empty mask."""
    pos, opts = (pb["q_pos"], pb["k_pos"], pb["q_seg"], pb["k_seg"]), pb["opts"]
    schedule = np.asarray(tile_schedule(*pos, **{n: opts[n] for n in ("causal", "window", "block_q", "block_kv")}))
    mask = reference_mask(*pos, causal=opts["causal"], window=opts["window"])[:, 0]  # (b, sq, sk)
    assert not np.any(tile_any(mask, opts["block_q"], opts["block_kv"]) & ~schedule)


def tile_any(mask, block_q, block_kv):
    """bool [b, nq, nk]: does the tile hold a visible pair?"""
    b, sq, sk = mask.shape
    return np.asarray(mask).reshape(b, sq // block_q, block_q, sk // block_kv, block_kv).any(axis=(2, 4))


def test_tile_schedule_is_exact_for_contiguous_positions():
    """Each tile's positions form a full integer range, so causal/window skipping loses nothing:
    every offset between a Q shard and a K/V shard, every window edge, blocks of 4."""
    k_pos = jnp.arange(16)[None]
    for q_off in range(-20, 21):
        q_pos = k_pos + q_off
        for causal in (False, True):
            for window in (None, (0, 0), (3, -1), (-1, 2), (5, 7), (9, 0)):
                schedule = tile_schedule(q_pos, k_pos, causal=causal, window=window, block_q=4, block_kv=4)
                mask = reference_mask(q_pos, k_pos, None, None, causal=causal, window=window)[:, 0]
                np.testing.assert_array_equal(schedule, tile_any(mask, 4, 4), err_msg=f"{q_off} {causal} {window}")


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
    pb = dict(q=rng.standard_normal((1, sq, h, d)), k=rng.standard_normal((1, sk, 1, d)),
              v=rng.standard_normal((1, sk, 1, d)), do=rng.standard_normal((1, sq, h, d)))
    pb = {n: jnp.asarray(x, jnp.float32) for n, x in pb.items()}
    pb.update(q_pos=jnp.asarray(q_pos[None], jnp.int32), k_pos=jnp.asarray(k_pos[None], jnp.int32),
              q_seg=None, k_seg=None, opts=dict(scale=d ** -0.5, causal=causal, window=window, block_q=8, block_kv=8))
    schedule = np.asarray(tile_schedule(pb["q_pos"], pb["k_pos"], causal=causal, window=window, block_q=8, block_kv=8))
    dead_rows = np.repeat(~schedule[0].any(axis=0), 8)  # K/V rows in tiles no Q tile computes
    assert 0 < dead_rows.sum() < sk
    return pb, dead_rows


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("pallas_gpu", "causal"), ("pallas_gpu", "striped_window"),
                                          ("pallas_tpu", "striped_window")])
def test_kernels_skip_tiles_nan_poison(name, layout):
    pb, dead = poisoned_problem(layout)
    want = run_reference(pb)
    nan = jnp.where(jnp.asarray(dead)[None, :, None, None], jnp.nan, 1.0)
    got = run_hop(MODULES[name], dict(pb, k=pb["k"] * nan, v=pb["v"] * nan))
    assert_matches_reference(got, want, TOL)
    assert np.all(np.asarray(got[3])[:, dead] == 0) and np.all(np.asarray(got[4])[:, dead] == 0)


@pytest.mark.slow
def test_tpu_kernel_counts_computed_tiles():
    """The TPU forward's SMEM debug counter equals the tile schedule (striped, causal, segments)."""
    q_pos, k_pos = jnp.arange(32)[None] * 4 + 3, jnp.arange(32)[None] * 4 + 1  # striped, hosts 3 and 1
    seg = lambda pos: pos // 48
    x = jnp.ones((1, 32, 2, 32), jnp.float32)
    opts = dict(causal=True, window=(40, -1), block_q=8, block_kv=8)
    counts = pallas_tpu.fwd_tile_counts(x, x[:, :, :1], x[:, :, :1], q_pos, k_pos, seg(q_pos), seg(k_pos), **opts)
    schedule = tile_schedule(q_pos, k_pos, seg(q_pos), seg(k_pos), **opts)
    assert 0 < schedule.sum() < schedule.size  # some tiles skipped, some computed
    np.testing.assert_array_equal(counts, np.broadcast_to(schedule.sum(-1)[:, None], counts.shape))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_two_hops_merge_with_final_lse(name):
    """Ring use: per-hop (o, lse) merged with FA-2's combine; backward per hop from the final lse."""
    rng = np.random.default_rng(1)
    b, s, h, hk, d = 1, 32, 2, 1, 48  # d = 48: not a power of two (the Triton wrapper pads it)
    pos = jnp.asarray((np.arange(2 * s).reshape(s, 2).T.reshape(-1))[None], jnp.int32)  # striped over 2 hosts
    q, do = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, 2 * s, hk, d)), jnp.float32) for _ in range(2))
    q_pos, opts = pos[:, s:], dict(scale=0.2, causal=True, window=None, block_q=8, block_kv=16)
    mod, hops = MODULES[name], [slice(0, s), slice(s, 2 * s)]
    outs = [mod.hop_fwd(q, k[:, sl], v[:, sl], q_pos, pos[:, sl], None, None, None, **opts) for sl in hops]
    lse = jnp.logaddexp(outs[0][1], outs[1][1])
    o = sum(jnp.exp(l - lse).transpose(0, 2, 1)[..., None] * o_hop for o_hop, l in outs)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
    grads = [mod.hop_bwd(q, k[:, sl], v[:, sl], do, lse, delta, q_pos, pos[:, sl], None, None, None, **opts)
             for sl in hops]
    dq = grads[0][0] + grads[1][0]
    dk, dv = (jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))
    ref = dict(q=q, k=k, v=v, do=do, q_pos=q_pos, k_pos=pos, q_seg=None, k_seg=None, opts=opts)
    assert_matches_reference((o, lse, dq, dk, dv), run_reference(ref), TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_kernels_inside_shard_map(name):
    """As in the ring: under shard_map(check_vma=True), Q sharded over 2 devices with positions from
    axis_index (varying), K/V and their positions replicated (not varying)."""
    pb, _ = poisoned_problem("causal")  # q_pos 0..31, k_pos 0..63, causal; no poison here
    mod, opts = MODULES[name], pb["opts"]
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def per_device(q, do, k, v):
        sq = q.shape[1]
        q_pos, k_pos = (jax.lax.axis_index("sp") * sq + jnp.arange(sq))[None], jnp.arange(k.shape[1])[None]
        o, lse = mod.hop_fwd(q, k, v, q_pos, k_pos, None, None, None, **opts)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
        dq, dk, dv, _ = mod.hop_bwd(q, k, v, do, lse, delta, q_pos, k_pos, None, None, None, **opts)
        return o, lse, dq, jax.lax.psum(dk, "sp"), jax.lax.psum(dv, "sp")

    rows, P = jax.P(None, "sp"), jax.P()
    ring_like = jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, P, P),
                              out_specs=(rows, jax.P(None, None, "sp"), rows, P, P))
    got = jax.jit(ring_like)(pb["q"], pb["do"], pb["k"], pb["v"])
    assert_matches_reference(got, run_reference(pb), TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_bf16_inputs(name):
    """bf16 in, fp32 accumulation, fp32 out: within BF16_TOL of the fp32 reference on the same values."""
    pb, _ = poisoned_problem("striped_window")
    pb = dict(pb, **{n: pb[n].astype(jnp.bfloat16).astype(jnp.float32) for n in ("q", "k", "v", "do")})
    got = run_hop(MODULES[name], pb, dtype=jnp.bfloat16)
    assert_matches_reference(got, run_reference(pb), BF16_TOL)


@pytest.mark.parametrize("name", MODULES)
def test_bias_is_rejected(name):
    pb, _ = poisoned_problem("causal")
    pos = (pb["q_pos"], pb["k_pos"], None, None)
    bias = jnp.zeros((1, 2, 32, 64))
    with pytest.raises(ValueError, match="bias"):
        MODULES[name].hop_fwd(pb["q"], pb["k"], pb["v"], *pos, bias, **pb["opts"])
    lse = jnp.zeros((1, 2, 32))
    with pytest.raises(ValueError, match="bias"):
        MODULES[name].hop_bwd(pb["q"], pb["k"], pb["v"], pb["do"], lse, lse, *pos, bias, **pb["opts"])


@pytest.mark.parametrize("name, other", [("pallas_gpu", "tpu"), ("pallas_tpu", "gpu")])
def test_wrong_backend_is_rejected(name, other, monkeypatch):
    pb, _ = poisoned_problem("causal")
    monkeypatch.setattr(jax, "default_backend", lambda: other)
    with pytest.raises(ValueError, match=f"default backend is '{other}'"):
        MODULES[name].hop_fwd(pb["q"], pb["k"], pb["v"], pb["q_pos"], pb["k_pos"], None, None, None, **pb["opts"])


@pytest.mark.parametrize("name", MODULES)
def test_block_must_divide_the_shard(name):
    pb, _ = poisoned_problem("causal")
    opts = dict(pb["opts"], block_kv=24)
    with pytest.raises(ValueError, match="block_kv must divide sk"):
        MODULES[name].hop_fwd(pb["q"], pb["k"], pb["v"], pb["q_pos"], pb["k_pos"], None, None, None, **opts)


def test_tpu_tiling_rule(monkeypatch):
    """On a TPU block_kv must be a multiple of 128 (or the whole shard); interpreted, a multiple of 8."""
    pb, _ = poisoned_problem("causal")
    args = (pb["q"], pb["k"], pb["v"], pb["q_pos"], pb["k_pos"], None, None, None)
    with pytest.raises(ValueError, match="block_q % 8"):
        pallas_tpu.hop_fwd(*args, **dict(pb["opts"], block_q=4))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="block_kv % 128"):
        pallas_tpu.hop_fwd(*args, **dict(pb["opts"], block_kv=32))
