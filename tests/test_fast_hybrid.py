"""The 2-D hybrid (``ringattn_fast.hybrid_attention``: Ulysses over one mesh axis, the ring over another)
against the float64 oracle (forward) and dense autodiff (gradients) on 2x2, 2x4 and 4x2 meshes, every mask,
layout and GQA case; the per-host function inside a user's shard_map; dropout with the ring's mask; bad
input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringattn_fast as rf
import ringattn_ref as ref
from ringattn_ref import variants

from helpers import assert_close, dense_attention, examples

AUTO = jax.sharding.AxisType.Auto


def mesh2(ring, ulysses):
    return jax.make_mesh((ring, ulysses), ("ring", "ulysses"), axis_types=(AUTO, AUTO))


MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(causal=True, window=(5, 0)),
         "segments": dict(causal=True, segment_ids=np.repeat([[0, 1, 1, 2]], 8, axis=1).repeat(2, 0)),
         "chunked_local": dict(mask_fn=variants.chunked_local(8)),
         "alibi": dict(causal=True, score_fn=variants.alibi(variants.alibi_slopes(8))),
         "bias": dict(causal=True, bias=np.random.default_rng(1).standard_normal((2, 8, 32, 32))),
         "key bias": dict(bias=np.random.default_rng(2).standard_normal((1, 8, 1, 32)))}


@pytest.mark.slow  # ~8 s an example: a forward and a backward compile on a 2-D mesh
@given(st.data())
@settings(max_examples=examples(4), deadline=None)
def test_hybrid_equals_the_oracle_and_its_gradients(data):
    ring, ulysses = data.draw(st.sampled_from([(2, 2), (2, 4), (4, 2)]), "ring x ulysses")
    h, hk = data.draw(st.sampled_from([(8, 8), (8, 2), (8, 1)]), "heads")
    kw = MASKS[data.draw(st.sampled_from(sorted(MASKS)), "mask")]
    layout = data.draw(st.sampled_from(["contiguous", "striped", "zigzag"]), "layout")
    rng = np.random.default_rng(data.draw(st.integers(0, 99), "seed"))
    q = rng.standard_normal((2, 32, h, 8))
    k, v = rng.standard_normal((2, 2, 32, hk, 8))
    do = rng.standard_normal(q.shape)
    with jax.enable_x64(True):
        run = lambda q, k, v: rf.hybrid_attention(q, k, v, mesh=mesh2(ring, ulysses), layout=layout, **kw)  # noqa: E731
        assert_close(run(q, k, v), ref.attention(q, k, v, **kw), "o", tol=1e-10)
        got = jax.grad(lambda *a: (run(*a) * do).sum(), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(lambda *a: (dense_attention(*a, **kw) * do).sum(), argnums=(0, 1, 2))(q, k, v)
    for what, g, wg in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, wg, what, tol=1e-9)


@pytest.mark.slow  # three 2-D compiles
def test_the_shard_function_and_dropout_as_the_ring():
    """``hybrid_attention_shard`` inside the caller's shard_map over (ring, ulysses), sequence split
    ring-major, equals the oracle; with dropout the hybrid's output is the ring's (one mask for every
    strategy: a function of global head and true positions)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 32, 4, 8)).astype(np.float32) for _ in range(3))
    mesh = mesh2(2, 2)
    seq = jax.P(None, ("ring", "ulysses"))
    perm = lambda x: rf.to_layout(jnp.asarray(x), "zigzag", 4)  # noqa: E731
    shard = jax.shard_map(lambda q, k, v: rf.hybrid_attention_shard(q, k, v, causal=True, layout="zigzag"),
                          mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    o = rf.from_layout(shard(perm(q), perm(k), perm(v)), "zigzag", 4)
    assert_close(o, ref.attention(q, k, v, causal=True), "o", tol=2e-5)
    kw = dict(causal=True, dropout_rate=0.25, dropout_key=7)
    np.testing.assert_allclose(rf.hybrid_attention(q, k, v, mesh=mesh, **kw),
                               rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), **kw), atol=2e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(ulysses_axis="ring"), "must be different mesh axes"),
    (dict(ulysses_axis="tp"), "ulysses_axis 'tp' is not an axis of the mesh"),
    (dict(ring_axis="sp"), "ring_axis 'sp' is not an axis of the mesh"),
    (dict(ring_axis=3), "ring_axis must be the name of a mesh axis"),
])
def test_bad_axes_are_value_errors(kw, match):
    q = np.zeros((1, 16, 4, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        rf.hybrid_attention(q, q, q, mesh=mesh2(2, 2), **kw)


def test_a_ulysses_axis_larger_than_the_heads_is_a_value_error():
    q = np.zeros((1, 16, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"ulysses_axis\).*heads \(2\) must be divisible by its size \(4\)"):
        rf.hybrid_attention(q, q, q, mesh=mesh2(2, 4))
    q = np.zeros((1, 16, 6, 8), np.float32)
    with pytest.raises(ValueError, match=r"ulysses_axis\).*heads \(6\) must be divisible by its size \(4\)"):
        rf.hybrid_attention(q, q, q, mesh=mesh2(2, 4))


@pytest.mark.parametrize("ring, ulysses, kv_heads", [(2, 4, 2), (4, 2, 4)])
def test_the_compiled_program_sends_what_the_model_says(ring, ulysses, kv_heads):
    """The forward's float bytes per device, by collective, counted in the compiled program
    (``benchmarks.strategies.collective_bytes``: all-to-alls over the Ulysses axis of size U, the ring's
    permutes R - 1 times) equal ``ringattn_ref.hybrid_bytes_sent``: q, k, v (kv heads repeated as
    needed) and o over the all-to-alls, K/V shards of S/R tokens and heads/U heads around the ring."""
    from benchmarks.strategies import collective_bytes
    b, s, h, d = 1, 256, 4, 16
    q, k = jnp.zeros((b, s, h, d), jnp.float32), jnp.zeros((b, s, kv_heads, d), jnp.float32)
    f = jax.jit(lambda q, k, v: rf.hybrid_attention(q, k, v, mesh=mesh2(ring, ulysses), causal=True))
    sent = collective_bytes(f.lower(q, k, k).compile().as_text(), ulysses, loop_trips=ring - 1, by_shape=True)
    measured = {kind: sum(x for (kd, dtype, _), x in sent.items() if kd == kind and dtype == "f32")
                for kind in ("all-to-all", "collective-permute")}
    assert measured == ref.hybrid_bytes_sent(seq=s, heads=h, kv_heads=kv_heads, dim=d, ulysses_size=ulysses,
                                             ring_size=ring, batch=b, dtype_bytes=4)


def test_gqa_that_does_not_split_sends_what_the_model_says_in_ulysses_and_the_hybrid_at_one_ring_step():
    """12 heads, 3 kv heads on 4 devices: each kv head goes out 4 times (3 copies per device). The compiled
    Ulysses and the compiled hybrid 4 x 1 send the same float bytes over their all-to-alls, and both are what
    ``strategy_costs`` says for ``"ulysses"`` and for the hybrid at ring size 1 (issue 31, item 7)."""
    from benchmarks.strategies import collective_bytes
    b, s, h, hk, d = 1, 64, 12, 3, 8
    q, k = jnp.zeros((b, s, h, d), jnp.float32), jnp.zeros((b, s, hk, d), jnp.float32)
    runs = {"ulysses": jax.jit(lambda q, k, v: rf.ulysses_attention(q, k, v, mesh=rf.make_mesh(4), causal=True)),
            "hybrid": jax.jit(lambda q, k, v: rf.hybrid_attention(q, k, v, mesh=mesh2(1, 4), causal=True))}
    measured = {}
    for name, f in runs.items():
        sent = collective_bytes(f.lower(q, k, k).compile().as_text(), 4, loop_trips=0, by_shape=True)
        measured[name] = sum(x for (kind, dtype, _), x in sent.items() if kind == "all-to-all" and dtype == "f32")
    costs = ref.strategy_costs(seq=s, heads=h, kv_heads=hk, dim=d, devices=4, hardware="A100 NVLink", batch=b,
                               dtype_bytes=4, ulysses_size=4)
    assert measured["ulysses"] == measured["hybrid"] == costs["ulysses"].bytes_sent == costs["hybrid"].bytes_sent
    assert costs["ulysses"].bytes_sent == 3 * 16 * d * (3 + 2 * 3 + 3) * 4  # q, k, v (3 copies), o; to 3 others
