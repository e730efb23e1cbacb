"""The all-gather and Ulysses strategies, and K/V in bfloat16/float8 on the wire (issue 11).

``allgather_attention`` and ``ulysses_attention`` take ``ring_attention``'s arguments: here they meet
the float64 oracle (``ringattn_ref.attention``, ``ring_attention_vjp``; dbias by autodiff of a dense
jnp twin) on drawn problems of every mask, layout and GQA ratio, forward and gradients. Ulysses
draws a mesh size dividing the heads (``gcd``). ``comm_dtype``: what travels is what the compiled
program sends (collective operand dtypes and bytes), and the result is exactly attention on the K/V
rounded at home. Every distinct problem is a compilation (~2-5 s), so few examples.
"""
import dataclasses
import functools
from math import gcd

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_fast as rf
from benchmarks.strategies import collective_bytes
from ringattn_ref.testing import AttentionProblem, attention_problems
from test_fast_ring import max_err, reference_with_grads
from helpers import examples

STRATEGIES = {"allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention}


def strategy_with_grads(fn, problem, dtype=jnp.float64, **extra):
    """``fn``'s output and (dq, dk, dv, dbias) for the problem's cotangent, as float64 numpy."""
    mesh = rf.make_mesh(problem.n_hosts)
    kw = dict(problem.ring_kwargs(), **extra)
    for name in ("n_hosts", "bias", "segment_ids"):
        kw.pop(name)
    seg = None if problem.segment_ids is None else jnp.asarray(problem.segment_ids, jnp.int32)

    @jax.jit
    def run(q, k, v, bias, do):
        o, vjp = jax.vjp(lambda q, k, v, bias: fn(q, k, v, mesh=mesh, segment_ids=seg, bias=bias, **kw), q, k, v, bias)
        return o, vjp(do)

    cast = [None if x is None else jnp.asarray(x, dtype) for x in (problem.q, problem.k, problem.v, problem.bias,
                                                                  problem.do)]
    o, grads = run(*cast)
    return np.asarray(o, np.float64), [None if g is None else np.asarray(g, np.float64) for g in grads]


def assert_matches_oracle(fn, problem, tol=1e-10):
    with jax.enable_x64(True):
        o, grads = strategy_with_grads(fn, problem)
    want, want_grads = reference_with_grads(problem)
    assert max_err(o, want) <= tol
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        assert (got is None) == (ref is None), name
        if ref is not None:
            assert np.all(np.isfinite(got)), name
            assert max_err(got, ref) <= tol, name


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(attention_problems(min_hosts=2, max_hosts=8, max_shard=8, max_dim=8, max_group=2))
def test_allgather_float64_matches_reference(problem):
    assert_matches_oracle(rf.allgather_attention, problem)


@st.composite
def ulysses_problems(draw):
    """A drawn problem on ``gcd(heads, n_hosts)`` devices (it divides the sequence and the heads)."""
    p = draw(attention_problems(min_hosts=2, max_hosts=8, max_kv_heads=4, max_group=2, max_shard=8, max_dim=8))
    return dataclasses.replace(p, n_hosts=gcd(p.q.shape[2], p.n_hosts))


@pytest.mark.slow
@settings(max_examples=examples(3))
@given(ulysses_problems())
def test_ulysses_float64_matches_reference(problem):
    assert_matches_oracle(rf.ulysses_attention, problem)


@pytest.mark.parametrize("name,n,kv_heads", [("allgather", 4, 2), ("ulysses", 4, 2), ("ulysses", 2, 4)])
def test_every_feature_at_once(name, n, kv_heads):
    """GQA + causal + packed segments + a full bias with -inf rows + window, zigzag, uneven tiles; for
    Ulysses kv_heads < N (K/V repeated) and kv_heads a multiple of N (not)."""
    rng = np.random.default_rng(n + kv_heads)
    b, s, h, d = 2, 8 * n, 4, 8
    q, do = rng.standard_normal((2, b, s, h, d))
    k, v = rng.standard_normal((2, b, s, kv_heads, d))
    bias = rng.standard_normal((1, h, s, s))
    bias[:, :, rng.random(s) < 0.2] = -np.inf
    seg = np.sort(rng.integers(0, 3, (b, s)), axis=1)
    problem = AttentionProblem(q=q, k=k, v=v, do=do, n_hosts=n, causal=True, segment_ids=seg, bias=bias,
                               window=(s // 2, -1), scale=None, layout="zigzag", block_q=4, block_kv=8)
    assert_matches_oracle(STRATEGIES[name], problem)


def _qkv(shape=(1, 32, 4, 8), kv_heads=4, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    b, s, h, d = shape
    q, do = (jnp.asarray(rng.standard_normal((b, s, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv_heads, d)), dtype) for _ in range(2))
    return q, k, v, do


def test_ulysses_errors_and_unsupported_keywords():
    q, k, v, _ = _qkv((1, 32, 6, 8), kv_heads=2)
    with pytest.raises(ValueError, match=r"heads \(6\) must be divisible by its size \(4\)"):
        rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(4))
    with pytest.raises(ValueError, match="pallas_tpu_fused"):
        rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(2), impl="pallas_tpu_fused")
    with pytest.raises(ValueError, match="block_q"):
        rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(2), block_q=5)
    with pytest.raises(TypeError, match="comm_dtype"):  # the all-to-alls send q as well: not offered
        rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(2), comm_dtype="bfloat16")


@pytest.mark.parametrize("fn", [rf.ring_attention, rf.allgather_attention])
def test_unsupported_comm_dtype_is_a_value_error_naming_it(fn):
    q, k, v, _ = _qkv()
    mesh = rf.make_mesh(4)
    for kw, bad in [({"comm_dtype": "int8"}, "'int8'"), ({"comm_dtype": "float64"}, "'float64'"),
                    ({"grad_comm_dtype": "float8_e4m3fn"}, "'float8_e4m3fn'"), ({"comm_dtype": 3}, "3")]:
        with pytest.raises(ValueError, match=f"{list(kw)[0]} must be None or one of .*; got {bad}"):
            fn(q, k, v, mesh=mesh, **kw)
    with pytest.raises(ValueError, match="pallas_tpu_fused"):
        fn(q, k, v, mesh=mesh, impl="pallas_tpu_fused", comm_dtype="bfloat16")


@functools.cache
def _fwd_bwd(fn, n, comm_dtype=None, grad_comm_dtype=None):
    """jit of (o, dq, dk, dv) for the cotangent ``do`` on ``n`` devices, shared by the tests below."""
    kw = dict(mesh=rf.make_mesh(n), causal=True, block_q=8, block_kv=8, comm_dtype=comm_dtype,
              grad_comm_dtype=grad_comm_dtype)
    return jax.jit(lambda q, k, v, do: (lambda o, vjp: (o,) + vjp(do))(*jax.vjp(
        lambda q, k, v: fn(q, k, v, **kw), q, k, v)))


@pytest.mark.parametrize("fn", [rf.ring_attention, rf.allgather_attention])
def test_bfloat16_on_the_wire_is_attention_on_rounded_kv_and_halves_the_bytes(fn):
    """comm_dtype=bfloat16: K/V rounded once at home; every hop reads that, accumulates in float32.
    The compiled program sends K/V as 2-byte elements: half the float32 program's K/V bytes."""
    mesh = rf.make_mesh(4)
    q, k, v, do = _qkv((1, 64, 4, 16), kv_heads=2)
    f32, bf16 = _fwd_bwd(fn, 4), _fwd_bwd(fn, 4, comm_dtype="bfloat16")
    rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in (k, v)]
    got, want, exact = bf16(q, k, v, do), f32(q, *rounded, do), f32(q, k, v, do)
    for g, w, e in zip(got, want, exact):
        assert max_err(np.asarray(g), np.asarray(w)) <= 1e-6  # the same K/V, the same float32 sums
        assert 1e-4 <= max_err(np.asarray(g), np.asarray(e)) <= 3e-2  # and bf16's rounding is visible
    kv_shape = (1, 16, 2, 16)  # one host's K (or V) shard; the forward sends nothing else of that shape
    if fn is rf.ring_attention:
        kv_shape = (2,) + kv_shape  # the ring sends K and V stacked, one transfer a step
    forward = {name: jax.jit(lambda q, k, v, kw=kw: fn(q, k, v, mesh=mesh, causal=True, block_q=8, block_kv=8, **kw))
               for name, kw in (("f32", {}), ("bf16", {"comm_dtype": "bfloat16"}))}
    sent = {name: collective_bytes(f.lower(q, k, v).compile().as_text(), 4, loop_trips=3, by_shape=True)
            for name, f in forward.items()}
    kinds = ("collective-permute",) if fn is rf.ring_attention else ("all-gather",)
    f32_kv = {key: b for key, b in sent["f32"].items() if key[0] in kinds and key[2] == kv_shape}
    bf16_kv = {key: b for key, b in sent["bf16"].items() if key[0] in kinds and key[2] == kv_shape}
    assert {key[1] for key in f32_kv} == {"f32"} and {key[1] for key in bf16_kv} == {"u16"}
    assert sum(bf16_kv.values()) * 2 == sum(f32_kv.values()) > 0


@pytest.mark.parametrize("fn", [rf.ring_attention, rf.allgather_attention])
def test_gradients_in_bfloat16_on_the_wire(fn):
    """grad_comm_dtype=bfloat16: dK/dV travel as 2-byte elements; the forward is untouched and the
    gradient error stays at bf16 rounding of the accumulators."""
    q, k, v, do = _qkv((1, 64, 4, 16), kv_heads=2, seed=1)
    f32, g16 = _fwd_bwd(fn, 4), _fwd_bwd(fn, 4, grad_comm_dtype="bfloat16")
    exact, got = f32(q, k, v, do), g16(q, k, v, do)
    for g, e in zip(got[:2], exact[:2]):  # o, dq: nothing of theirs travels
        assert max_err(np.asarray(g), np.asarray(e)) == 0.0
    for g, e in zip(got[2:], exact[2:]):  # dk, dv
        assert 0 < max_err(np.asarray(g), np.asarray(e)) <= 2**-7 * np.abs(np.asarray(e)).max()
    sent = collective_bytes(g16.lower(q, k, v, do).compile().as_text(), 4, loop_trips=(3, 2), by_shape=True)
    shard = 1 * 16 * 2 * 16  # elements of one host's dK (or K): b, s/N, kv_heads, d
    if fn is rf.ring_attention:  # dK, dV: N sends of 2 bytes; K, V: N - 1 sends forward and backward, float32
        # (each pair stacked: one transfer)
        assert sent[("collective-permute", "u16", (2, 1, 16, 2, 16))] == 4 * 2 * shard * 2
        assert sent[("collective-permute", "f32", (2, 1, 16, 2, 16))] == 2 * 3 * 2 * shard * 4
    else:  # the reduce-scatter as an all-to-all of 2-byte blocks: (N - 1) / N of dK, dV over all keys
        to_all = {key: b for key, b in sent.items() if key[0] == "all-to-all"}
        assert {key[1] for key in to_all} == {"u16"} and sum(to_all.values()) == 3 / 4 * 2 * 4 * shard * 2


def test_float8_scale_keeps_the_error_relative():
    """float8 with a per-shard scale: V scaled by 1e-4 gives 1e-4 times the output error (without a
    scale, e4m3's smallest subnormal 2**-9 would flush all of it to 0); the error is float8-sized."""
    q, k, v, do = _qkv((1, 64, 4, 16), kv_heads=2, seed=2)
    f32, fp8 = _fwd_bwd(rf.ring_attention, 4), _fwd_bwd(rf.ring_attention, 4, comm_dtype="float8_e4m3fn")
    errs = []
    for factor in (1.0, 1e-4):
        want, got = f32(q, k, v * factor, do)[0], fp8(q, k, v * factor, do)[0]
        errs.append(max_err(np.asarray(got), np.asarray(want)) / factor)
    assert 1e-3 <= errs[0] <= 0.2 * np.abs(np.asarray(v)).max()
    assert errs[1] == pytest.approx(errs[0], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["allgather", "ulysses", "hybrid"])
def test_strategies_run_the_pallas_hop(name):
    """The strategies' one hop through a Pallas kernel (Triton, in its interpreter on CPU): a query
    shard against all keys (sq != sk), as the ring's XLA hop computes it; the hybrid's ring of two
    groups (a 2 x 2 mesh) runs its hops through it too."""
    q, k, v, do = _qkv((1, 32, 4, 8), kv_heads=2, seed=3)
    want = _fwd_bwd(rf.ring_attention, 2)(q, k, v, do)
    mesh = rf.make_mesh(2)
    fn = STRATEGIES.get(name)
    if name == "hybrid":
        grid = jax.make_mesh((2, 2), ("ring", "ulysses"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        fn, mesh = rf.hybrid_attention, grid
    got = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o,) + vjp(do))(*jax.vjp(lambda q, k, v: fn(
        q, k, v, mesh=mesh, causal=True, block_q=8, block_kv=8, impl="pallas_gpu"), q, k, v)))(q, k, v, do)
    for g, w in zip(got, want):
        assert max_err(np.asarray(g), np.asarray(w)) <= 2e-5
