"""Fused TPU ring kernel (``ringattn_fast.kernels.pallas_tpu_fused``) on the CPU TPU interpreter.

Every kernel here runs under ``pltpu.InterpretParams(detect_races=True)`` (on_race="raise": a race
raises inside the call), and each test also asserts the interpreter's ``races.races_found`` flag.
The oracle is the float64 per-hop oracle of ``ringattn_ref`` applied to the whole sequence as one hop
(``hop_attention`` and ``hop_attention_vjp``): the fused ring must equal attention over all K/V shards.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels import pallas_tpu_fused as fused
from ringattn_fast.kernels.races import races_found
from ringattn_fast.masks import mark_bad_keys
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_ref import hop_attention, hop_attention_vjp
from ringattn_ref.layouts import layout_permutation
from ringattn_ref.testing import attention_problems
from ringattn_ref.validation import check_window
from helpers import examples, needs_fused_interpreter

# slow: the TPU interpreter with its race detector, minutes for the file
pytestmark = [pytest.mark.slow, needs_fused_interpreter]
P = jax.P
RACES = pltpu.InterpretParams(detect_races=True)


def oracle(q, k, v, do, dlse, q_pos, k_pos, q_seg, k_seg, *, scale, causal, window, **_):
    """The whole ring as one float64 hop: (o, lse, dq, dk, dv); ``dlse`` is the cotangent of lse.

    q, do [b, sq, h, d]; k, v [b, sk, hk, d]; positions int [b, s] in layout order (any layout).
    """
    qs, kv, cfg = QShard(q, q_pos, q_seg), KVShard(k, v, k_pos, k_seg), HopConfig(scale, causal, window)
    o, lse = hop_attention(qs, kv, cfg)
    with np.errstate(invalid="ignore"):
        delta = np.einsum("bqhd,bqhd->bhq", np.asarray(do, np.float64), o) - dlse  # FA-2 D, minus d lse
    return (o, lse) + tuple(hop_attention_vjp(qs, kv, cfg, do=do, lse=lse, delta=delta)[:3])


def run_fused(n, q, k, v, do, dlse, q_pos, k_pos, q_seg, k_seg, *, check_vma=False, **cfg):
    """Shard over n devices, run the fused ring forward and its VJP: (o, lse, dq, dk, dv) as numpy.

    K/V are marked (``masks.mark_bad_keys``) first, as ``ring_attention`` does, and the gradients are
    those of the marked K/V (as in the oracle). ``cfg``: HopConfig keywords (scale, causal, window,
    block_q, block_kv)."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    has_seg, hop = q_seg is not None, HopConfig(**cfg)

    def shard_fn(q, k, v, q_pos, k_pos, *seg):
        q_seg, k_seg = seg if has_seg else (None, None)
        return fused.fused_ring_attention_shard(QShard(q, q_pos, q_seg), KVShard(k, v, k_pos, k_seg), hop,
                                                axis_name="x", return_lse=True, interpret=RACES)

    seq = P(None, "x")
    ring = jax.shard_map(shard_fn, mesh=mesh, in_specs=(seq,) * (7 if has_seg else 5),
                         out_specs=(seq, P(None, None, "x")), check_vma=check_vma)
    ints = (q_pos, k_pos) + ((q_seg, k_seg) if has_seg else ())

    @jax.jit
    def fwd_bwd(q, k, v, do, dlse):
        (o, lse), vjp = jax.vjp(lambda q, k, v: ring(q, k, v, *ints), q, k, v)
        return (o, lse) + vjp((do, dlse))

    k, v = mark_bad_keys(jnp.asarray(k), jnp.asarray(v))  # as ring_attention hands K/V over
    out = [np.asarray(x) for x in fwd_bwd(q, k, v, do, dlse)]
    assert races_found() is False
    return out


def assert_matches(got, want, tol=2e-5):
    """Same NaN and -inf patterns, and max |got - want| <= tol * max(1, max |want|) for o, lse, dq, dk, dv."""
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(w)), f"{name}: NaN pattern differs"
        assert np.array_equal(np.isneginf(g), np.isneginf(w)), f"{name}: -inf pattern differs"
        finite = np.isfinite(w)
        if finite.any():
            err, size = np.abs(g[finite] - w[finite]).max(), max(1.0, np.abs(w[finite]).max())
            assert err <= tol * size, f"{name}: max error {err:.3g} > {tol} * {size:.3g}"


@settings(max_examples=examples(5))
@given(data=st.data())
def test_matches_oracle(data):
    """Outputs, lse and gradients agree with float64 attention on drawn problems (causal, window,
    segment ids, GQA, contiguous / striped / zigzag / permuted layouts) on 2 devices; no race is reported."""
    check_drawn_problem(2, data)


@settings(max_examples=examples(3))
@given(data=st.data())
def test_matches_oracle_on_4_devices(data):
    """As above on 4 devices, fewer examples (each costs the interpreter about 3x a 2-device one)."""
    check_drawn_problem(4, data)


@settings(max_examples=examples(2))
@given(data=st.data())
def test_matches_oracle_on_8_devices(data):
    """As above on 8 devices, fewer still: every tile moves by DMA, and the interpreter runs 8
    device threads on CI's 2 cores (the next test has everything at once on 8 devices)."""
    check_drawn_problem(8, data)


def check_drawn_problem(n, data):
    """One drawn problem on ``n`` devices against the oracle."""
    # The interpreter costs ~10 ms per tile and device thread: few heads, at most 2 x 2 tiles a hop, and
    # a batch of 2 only on 2 devices (the batch axis is the kernels' grid axis whatever the ring size).
    p = data.draw(attention_problems(min_hosts=n, max_hosts=n, max_batch=2 if n == 2 else 1,
                                     max_group=2, max_shard=8 if n < 8 else 4, bias=False,
                                     masked_rows=False, dtype=np.float32))
    b, s, h, _ = p.q.shape
    shard = s // n
    block_q, block_kv = (blk if shard // blk <= 2 else shard for blk in (p.block_q, p.block_kv))
    perm = layout_permutation(p.layout, s, n).astype(np.int32)
    pos = np.broadcast_to(perm, (b, s)).copy()                # true position of each layout slot
    q, k, v, do = (x[:, perm] for x in (p.q, p.k, p.v, p.do))
    seg = None if p.segment_ids is None else p.segment_ids[:, perm].astype(np.int32)
    dlse = np.random.default_rng(s).standard_normal((b, h, s)).astype(np.float32)
    kw = dict(scale=p.scale if p.scale is not None else q.shape[-1] ** -0.5, causal=p.causal,
              window=check_window(p.window))
    got = run_fused(n, q, k, v, do, dlse, pos, pos, seg, seg, block_q=block_q, block_kv=block_kv, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))


def test_eight_devices_everything_at_once():
    """8 devices, causal + window + segment ids + GQA on a random permutation, 2 x 2 tiles a hop."""
    n, b, s, h, hk, d = 8, 1, 64, 2, 1, 8
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    pos = rng.permutation(s).astype(np.int32)[None]
    seg = (pos >= 23).astype(np.int32) + (pos >= 50)
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    kw = dict(scale=0.4, causal=True, window=(20, -1))
    got = run_fused(n, q, k, v, do, dlse, pos, pos, seg, seg, block_q=4, block_kv=4, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))


def whole_shard_forms(monkeypatch, on):
    """The fused ring's kernels that hold a kv head's shard in VMEM (the forward's K/V, `fused_ring_fwd.WHOLE_KV`;
    the one-pass backward's K/V and dK/dV, `fused_ring_bwd.ONE_PASS`) on, or off: the forward streams K/V
    tiles and the backward runs in two passes, the forms for shards too long for VMEM (and, backward, for
    programs)."""
    from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd
    monkeypatch.setattr(fused_ring_bwd, "ONE_PASS", on)
    monkeypatch.setattr(fused_ring_fwd, "WHOLE_KV", on)


@settings(max_examples=examples(3))
@given(data=st.data())
def test_streaming_forms_match_oracle_on_drawn_problems(data):
    """The streaming forward and the two-pass backward (both whole-shard forms off) on drawn problems on 2
    devices, as `test_matches_oracle` (a hypothesis test cannot take pytest's function-scoped monkeypatch)."""
    from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd
    saved = fused_ring_bwd.ONE_PASS, fused_ring_fwd.WHOLE_KV
    fused_ring_bwd.ONE_PASS = fused_ring_fwd.WHOLE_KV = False
    try:
        check_drawn_problem(2, data)
    finally:
        fused_ring_bwd.ONE_PASS, fused_ring_fwd.WHOLE_KV = saved


def test_streaming_forms_match_oracle(monkeypatch):
    """The streaming forward and the two-pass backward on 4 devices: causal + window + segment ids + GQA on a
    random permutation, a NaN key, against the oracle (every other test here runs the whole-shard forms)."""
    whole_shard_forms(monkeypatch, False)
    n, b, s, h, hk, d = 4, 1, 32, 2, 1, 8
    rng = np.random.default_rng(6)
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    k[0, 5] = np.nan
    pos = rng.permutation(s).astype(np.int32)[None]
    seg = (pos >= 13).astype(np.int32)
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    kw = dict(scale=0.4, causal=True, window=(12, -1))
    got = run_fused(n, q, k, v, do, dlse, pos, pos, seg, seg, block_q=4, block_kv=4, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))


@pytest.mark.parametrize("layout", ["zigzag", "permuted"])
def test_partial_tiles_run_as_sub_tiles(layout):
    """16 x 16 tiles (interpreted, sub-tiles of 8): a partial tile runs as 2 x 2 sub-tiles in the forward and
    the one-pass backward (`fused_ring.by_kind`), each skipped, unmasked or masked by its own bounds;
    causal + window + segment ids + GQA on 2 devices against the oracle (every other test's tiles are too
    small to split)."""
    from ringattn_fast.kernels.fused_tiles import sub_split
    n, b, s, h, hk, d = 2, 1, 64, 2, 1, 8
    rng = np.random.default_rng(8)
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    pos = (layout_permutation("zigzag", s, n) if layout == "zigzag" else rng.permutation(s)).astype(np.int32)[None]
    seg = (pos >= 37).astype(np.int32)
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    kw = dict(scale=0.4, causal=True, window=(21, -1))
    hop = HopConfig(block_q=16, block_kv=16, **kw)
    assert sub_split(fused.fr.FusedConfig("x", n, hop, True, RACES), None) == 2
    got = run_fused(n, q, k, v, do, dlse, pos, pos, seg, seg, block_q=16, block_kv=16, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))


@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_chunked_tiles_match_oracle(layout, monkeypatch):
    """Full tiles of the one-pass backward in key chunks, as the per-hop kernel's (``pallas_tpu.BWD_KEY_CHUNK``;
    here 8 of 16), partial tiles by their sub-tiles; causal + window + segment ids + GQA and a NaN and an inf
    key on 2 devices against the oracle. The chunking is traced (`pallas_tpu._chunks` gives two slices)."""
    from ringattn_fast.kernels import pallas_tpu
    asked, real = [], pallas_tpu._chunks

    def chunks(size, chunk):
        got = real(size, chunk)
        asked.append((size, chunk, len(got)))
        return got
    monkeypatch.setattr(pallas_tpu, "_chunks", chunks)
    monkeypatch.setattr(pallas_tpu, "BWD_KEY_CHUNK", 8)
    jax.clear_caches()  # traces of the shipped chunks would be reused: the call's key does not hold them
    try:
        n, b, s, h, hk, d = 2, 1, 64, 2, 1, 8
        rng = np.random.default_rng(11)
        q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
        k[0, 40, 0, 3], v[0, 9, 0, 1] = np.inf, np.nan
        pos = (np.arange(s) if layout == "contiguous" else rng.permutation(s)).astype(np.int32)[None]
        seg = (pos >= 45).astype(np.int32)
        dlse = rng.standard_normal((b, h, s)).astype(np.float32)
        kw = dict(scale=0.4, causal=True, window=(40, -1))
        got = run_fused(n, q, k, v, do, dlse, pos, pos, seg, seg, block_q=16, block_kv=16, **kw)
        assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))
    finally:  # no later test may meet a trace of these chunks
        monkeypatch.undo()
        jax.clear_caches()
    assert (16, 8, 2) in asked, asked


@settings(max_examples=examples(3))
@given(data=st.data())
def test_chunked_tiles_on_drawn_problems(data):
    """Property: the one-pass backward's full tiles in chunks of 2 keys (``pallas_tpu.BWD_KEY_CHUNK``, wherever 2
    divides a drawn tile and is smaller) on drawn problems on 2 devices, as `test_matches_oracle` (a hypothesis
    test cannot take pytest's function-scoped monkeypatch)."""
    from ringattn_fast.kernels import pallas_tpu
    saved = pallas_tpu.BWD_KEY_CHUNK
    pallas_tpu.BWD_KEY_CHUNK = 2
    jax.clear_caches()  # traces of the shipped chunks would be reused: the call's key does not hold them
    try:
        check_drawn_problem(2, data)
    finally:
        pallas_tpu.BWD_KEY_CHUNK = saved
        jax.clear_caches()


def test_check_vma_and_rows_that_see_nothing():
    """Under shard_map(check_vma=True); keys placed after some queries (causal) leave those rows
    empty: o = 0, lse = -inf, zero finite gradients."""
    rng = np.random.default_rng(0)
    b, s, h, hk, d, n = 1, 32, 4, 1, 16, 4
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    q_pos = np.arange(s, dtype=np.int32)[None]
    k_pos = q_pos + 6  # queries 0..5 see no key at all
    kw = dict(scale=0.3, causal=True, window=(9, -1))
    got = run_fused(n, q, k, v, do, dlse, q_pos, k_pos, None, None, check_vma=True, block_q=4, block_kv=8, **kw)
    want = oracle(q, k, v, do, dlse, q_pos, k_pos, None, None, **kw)
    assert_matches(got, want)
    assert np.all(got[0][:, :6] == 0) and np.all(got[1][:, :, :6] == -np.inf)
    assert np.all(got[2][:, :6] == 0) and all(np.isfinite(g).all() for g in got[2:])


def test_single_device_ring():
    """axis_size 1: no DMA at all, dK/dV stay in slot 0; still matches the reference."""
    rng = np.random.default_rng(4)
    b, s, h, hk, d = 2, 16, 2, 1, 8
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    seg = (pos >= 5).astype(np.int32)
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    kw = dict(scale=0.5, causal=True, window=None)
    got = run_fused(1, q, k, v, do, dlse, pos, pos, seg, seg, block_q=8, block_kv=4, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, seg, seg, **kw))


def test_bfloat16_output_dtype_and_accuracy():
    """bf16 in, bf16 out (f32 accumulation inside): close to the float64 reference."""
    rng = np.random.default_rng(1)
    b, s, h, d, n = 1, 32, 2, 16, 2
    q, k, v, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))
    pos = np.arange(s, dtype=np.int32)[None]
    dlse = np.zeros((b, h, s), np.float32)
    kw = dict(scale=d ** -0.5, causal=True, window=None)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do)]
    got = run_fused(n, *bf, dlse, pos, pos, None, None, block_q=8, block_kv=8, **kw)
    assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.bfloat16
    want = oracle(*(np.asarray(x, np.float32) for x in bf), dlse, pos, pos, None, None, **kw)
    assert_matches([g.astype(np.float32) for g in got], want, tol=5e-2)


@pytest.mark.parametrize("whole", [True, False])
def test_skips_empty_tiles(whole, monkeypatch):
    """The kernels compute exactly the tiles `empty_tiles` does not mark empty, summed over the ring's
    hops and heads (forward and backward, whole-shard or streaming forms, count the same), and skip the rest."""
    whole_shard_forms(monkeypatch, whole)
    n, b, s, h, d, bq, bk = 4, 1, 64, 2, 8, 4, 8
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((b, s, heads, d)).astype(np.float32) for heads in (h, 1, 1, h))  # GQA
    pos = layout_permutation("zigzag", s, n).astype(np.int32)[None]
    seg = (pos >= 40).astype(np.int32)
    hop = HopConfig(scale=0.25, causal=True, window=(12, -1), block_q=bq, block_kv=bk)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def shard_fn(q, k, v, do, pos, seg):
        qs, kv = QShard(q, pos, seg), KVShard(k, v, pos, seg)
        cfg = fused.make_config(qs, kv, hop, axis_name="x", interpret=RACES, count=True)
        o, lse, fwd_count = fused._forward(cfg, qs, kv)
        *_, bwd_count = fused._backward(cfg, qs, kv, o=o, lse=lse, do=do, dlse=jnp.zeros_like(lse))
        return fwd_count, bwd_count

    counts = jax.jit(jax.shard_map(shard_fn, mesh=mesh, in_specs=(P(None, "x"),) * 6,
                                   out_specs=(P("x"), P("x")), check_vma=False))(q, k, v, do, pos, seg)
    assert races_found() is False
    # Expected count, written out: a tile is empty iff every key is in the future (causal), every key
    # is more than 12 before every query (window) or the segment ranges do not meet.
    qt, kt = pos[0].reshape(-1, bq), pos[0].reshape(-1, bk)   # (s / bq, bq), (s / bk, bk) tiles
    qs, ks = seg[0].reshape(-1, bq), seg[0].reshape(-1, bk)
    visible = ((kt.min(1)[None] <= qt.max(1)[:, None]) & (kt.max(1)[None] >= qt.min(1)[:, None] - 12)
               & (ks.min(1)[None] <= qs.max(1)[:, None]) & (qs.min(1)[:, None] <= ks.max(1)[None]))
    nq, nk = s // n // bq, s // n // bk   # tiles per shard
    want = [h * int(visible[d * nq:(d + 1) * nq].sum()) for d in range(n)]  # all hops = all K/V tiles
    np.testing.assert_array_equal(np.asarray(counts[0]), want)
    np.testing.assert_array_equal(np.asarray(counts[1]), want)
    assert sum(want) < h * visible.size // 2  # most tiles are skipped here


def test_removing_the_handshake_is_caught_by_the_race_detector():
    """In a subprocess (a race leaves the interpreter's global state broken): with the handshake no
    race; without it the detector reports one (on_race='warn') and raises (on_race='raise')."""
    probe = os.path.join(os.path.dirname(__file__), "_fused_race_probe.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(probe)),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, probe], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["handshake"] == {"races_found": False, "raised": None}
    assert result["no_handshake_warn"]["races_found"] is True
    assert result["no_handshake_raise"]["raised"] == "RACE DETECTED"


def test_interpret_default_and_errors():
    """interpret=None is `tiles.interpret_mode`: the race-detecting interpreter on CPU; bad blocks, a
    bias, and a call outside shard_map are ValueErrors naming the impl."""
    x = jnp.zeros((1, 8, 2, 4))
    pos = jnp.zeros((1, 8), jnp.int32)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def config(x, pos):
        seen["cfg"] = fused.make_config(QShard(x, pos), KVShard(x, x, pos), HopConfig(scale=0.5),
                                        axis_name="x")
        return x

    jax.shard_map(config, mesh=mesh, in_specs=(P(None, "x"),) * 2, out_specs=P(None, "x"))(x, pos)
    assert seen["cfg"].interpret == RACES and seen["cfg"].axis_size == 2 and seen["cfg"].count is False

    def call(hop, bias=None):
        return jax.shard_map(lambda x, pos: fused.fused_ring_attention_shard(
            QShard(x, pos), KVShard(x, x, pos, None, bias), hop, axis_name="x"),
            mesh=mesh, in_specs=(P(None, "x"), P(None, "x")), out_specs=P(None, "x"))(x, pos)

    with pytest.raises(ValueError, match="impl='pallas_tpu_fused': block_q must divide"):
        call(HopConfig(scale=0.5, causal=True, block_q=3, block_kv=4))
    with pytest.raises(ValueError, match="take no bias"):
        call(HopConfig(scale=0.5), bias=jnp.zeros((1, 1, 1, 4)))
    with pytest.raises(ValueError, match="axis_name 'x'"):
        fused.fused_ring_attention_shard(QShard(x, pos), KVShard(x, x, pos), HopConfig(scale=0.5), axis_name="x")


def small_problem(seed, b=1, s=32, h=2, hk=1, d=8):
    """float32 q, k, v, do, dlse and contiguous int32 positions [b, s]."""
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    dlse = rng.standard_normal((b, h, s)).astype(np.float32)
    return q, k, v, do, dlse, np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))


def test_runs_with_x64_enabled():
    """float32 inputs with jax_enable_x64 on: the kernels' index arithmetic stays int32 (the old one
    crashed in ``lax.rem``, int32 vs int64) and the result matches the oracle."""
    q, k, v, do, dlse, pos = small_problem(5)
    kw = dict(scale=0.35, causal=True, window=(11, -1), block_q=8, block_kv=8)
    with jax.enable_x64(True):
        got = run_fused(2, q, k, v, do, dlse, pos, pos, pos // 20, pos // 20, **kw)
    assert got[0].dtype == np.float32 and got[1].dtype == np.float32
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, pos // 20, pos // 20, **kw))


def test_dtype_rules():
    """float64 (under x64) and q float32 with k, v bfloat16 are ValueErrors naming the impl."""
    q, k, v, _, _, pos = small_problem(6)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def call(q, k, v):
        fn = lambda q, k, v, pos: fused.fused_ring_attention_shard(
            QShard(q, pos), KVShard(k, v, pos), HopConfig(scale=0.5, block_q=8, block_kv=8), axis_name="x")
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "x"),) * 4, out_specs=P(None, "x"))(q, k, v, pos)

    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="impl='pallas_tpu_fused' computes in float32 .*got float64"):
            call(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    with pytest.raises(ValueError, match="one dtype; got q float32, k bfloat16, v bfloat16"):
        call(q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))


def test_masked_nan_keys_contribute_nothing():
    """2 devices, causal, batch 2. Example 0: K and V NaN at key 29, invisible to queries 24..28 of its
    computed tile; example 1: V NaN at key 13. Outputs and gradients equal the oracle's, NaN exactly
    where it is NaN, and rows that see no bad key equal the oracle on zeroed keys (the old kernel's
    ``0 * nan`` in ``dS K`` made dQ NaN, and its ``l > 0`` test hid NaN rows as o = 0, lse = -inf)."""
    q, k, v, do, dlse, pos = small_problem(7, b=2, d=16)
    k[0, 29], v[0, 29], v[1, 13] = np.nan, np.nan, np.nan
    kw = dict(scale=0.25, causal=True, window=None, block_q=8, block_kv=8)
    got = run_fused(2, q, k, v, do, dlse, pos, pos, None, None, **kw)
    assert_matches(got, oracle(q, k, v, do, dlse, pos, pos, None, None, **kw))
    clean = oracle(q, np.nan_to_num(k), np.nan_to_num(v), do, dlse, pos, pos, None, None, **kw)
    assert np.isnan(got[0][0, 29:]).all() and np.isnan(got[0][1, 13:]).all()
    for ex, rows in ((0, slice(0, 29)), (1, slice(0, 13))):
        assert np.isfinite(got[0][ex, rows]).all()
        np.testing.assert_allclose(got[0][ex, rows], clean[0][ex, rows], atol=2e-5)
