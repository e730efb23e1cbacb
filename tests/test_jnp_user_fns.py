"""Issue 31, item 1: mask and score functions written in ``jax.numpy`` in decode (``prefill`` /
``decode_step``), the Flax adapter and the ``jax.nn`` twin, eager and under ``jit``, against the float64
oracle. (``tests/test_fast_programmable.py`` covers ring, all-gather, Ulysses and the hybrid.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
from ringattn_fast import inference as fi
from ringattn_ref import variants
from ringattn_ref.attention import attention
from test_ref_inference import HK, D, expected, variant_calls

TABLE = jnp.asarray(np.arange(64) % 3 != 1)  # a concrete jnp array the mask closes over, indexed by position
NP_TABLE = np.arange(64) % 2 == 0  # a numpy one, read through jnp.asarray (numpy cannot index a tracer)
MASKS = {
    "logical_or": lambda qp, kp, qs, ks, h: jnp.logical_or(kp <= qp - 2, kp < 3),
    "where_abs": lambda qp, kp, qs, ks, h: jnp.where(jnp.abs(qp - kp) <= 4, True, kp == 0),
    "jnp_closure": lambda qp, kp, qs, ks, h: jnp.logical_and(kp <= qp, TABLE[kp]) | (kp == qp),
    "np_closure": lambda qp, kp, qs, ks, h: jnp.logical_or(jnp.asarray(NP_TABLE)[kp], kp == qp),
}
SCORE = lambda s, qp, kp, h: jnp.where(kp < qp, s - 0.25 * jnp.abs(qp - kp), s)  # noqa: E731 - an ALiBi-like ramp
CASES = [(name, None) for name in MASKS] + [("logical_or", SCORE)]


def _ids(case):
    return case[0] + ("+score" if case[1] is not None else "")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decode_takes_jnp_functions(case, jit):
    """Chunked prefill then decode steps on 4 hosts, float32 vs the oracle over each row's prefix."""
    mask_fn, score_fn = MASKS[case[0]], case[1]
    kw = dict(mask_fn=mask_fn) | ({} if score_fn is None else dict(score_fn=score_fn))
    mesh = rf.make_mesh(4)
    prefill, decode = fi.prefill, fi.decode_step
    if jit:
        static = ("mesh", "mask_fn", "score_fn")
        prefill, decode = (jax.jit(f, static_argnames=static) for f in (fi.prefill, fi.decode_step))
    cache = fi.init_cache(2, 32, HK, D, mesh=mesh)
    prefix = [[np.zeros((1, 0, HK, D)), np.zeros((1, 0, HK, D))] for _ in range(2)]
    for q, k, v, lengths in variant_calls(3, D, steps=2):
        q32, k32, v32 = (np.asarray(x, np.float32) for x in (q, k, v))
        if lengths is None:
            o, cache = decode(q32, k32, v32, cache, mesh=mesh, **kw)
        else:
            o, cache = prefill(q32, k32, v32, cache, lengths=jnp.asarray(lengths, jnp.int32), mesh=mesh, **kw)
        want = expected(prefix, q, k, v, lengths, kw)
        np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_flax_adapter_takes_jnp_functions(case, jit):
    """``flax_attention_fn(mask_fn=..., score_fn=...)`` called as Flax calls it ([batch, T, heads, dim])."""
    mask_fn, score_fn = MASKS[case[0]], case[1]
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 32, 4, 8)) for _ in range(3))
    fn = rf.flax_attention_fn(mesh=rf.make_mesh(4), mask_fn=mask_fn, score_fn=score_fn)
    call = jax.jit(fn) if jit else fn
    got = call(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    want = attention(q, k, v, mask_fn=mask_fn, score_fn=score_fn)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_twin_builds_its_masks_as_jnp_functions(jit):
    """The twin has no ``mask_fn`` argument (``jax.nn`` has none): its top-left causal / window masks for
    T != S are jnp functions handed to the ring; they agree with ``jax.nn`` eager and under jit."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((1, 16, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 32, 4, 8)), jnp.float32) for _ in range(2))
    kw = dict(is_causal=True, local_window_size=(5, 0))
    twin = lambda q, k, v: rf.dot_product_attention(q, k, v, mesh=rf.make_mesh(4), **kw)  # noqa: E731
    got = (jax.jit(twin) if jit else twin)(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


def test_variants_builders_compose_with_jnp():
    """The ``variants`` builders return functions that jnp code can combine (``jnp.logical_and`` of two)."""
    stream, chunk = variants.streaming(2, 4), variants.chunked_local(8)
    both = lambda qp, kp, qs, ks, h: jnp.logical_and(stream(qp, kp, qs, ks, h), chunk(qp, kp, qs, ks, h))  # noqa: E731
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 32, 4, 8)) for _ in range(3))
    got = jax.jit(lambda q, k, v: rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), mask_fn=both))(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got, np.float64), attention(q, k, v, mask_fn=both), rtol=0, atol=2e-5)


def test_a_closure_over_a_numpy_table_indexed_by_traced_positions():
    """``table[k_pos]`` with ``table`` a numpy array the function closes over: numpy cannot index with a
    tracer, so the function the ring keeps holds the table as a ``jnp`` array (``fn_keys.traceable``):
    eager and under ``jit``, equal to the same mask written over a ``jnp`` table."""
    import jax
    import ringattn_fast as rf
    from ringattn_fast import fn_keys

    table = np.arange(64) % 3 != 1

    def build(t):
        return lambda qp, kp, qs, ks, h: (kp <= qp) & t[kp]

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    want = rf.ring_attention(q, k, v, mesh=mesh, mask_fn=build(jnp.asarray(table)))
    eager = rf.ring_attention(q, k, v, mesh=mesh, mask_fn=build(table))
    jitted = jax.jit(lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, mask_fn=build(table.copy())))(q, k, v)
    np.testing.assert_allclose(eager, want, atol=1e-6)
    np.testing.assert_allclose(jitted, want, atol=1e-6)
    kept = fn_keys.traceable(build(table))
    assert isinstance(kept.__closure__[0].cell_contents, jax.Array)
    assert fn_keys.traceable(MASKS["logical_or"]) is MASKS["logical_or"]  # nothing to change: itself
