"""What real models need from ring_attention (issue 9): the lse, any sequence length, packed data with
padding, and meshes where batch and heads are sharded too. Checked against the float64 oracle (and,
for gradients through lse, against jax.vjp of dense float64 attention)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
from helpers import rel_err
import ringattn_ref as ref
from ringattn_ref.masks import allowed

TOL = 2e-5


def arrays(b, s, h, hk, d, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((2, b, s, h, d)).astype(dtype)
    k, v = rng.standard_normal((2, b, s, hk, d)).astype(dtype)
    return q, k, v, do, rng


def dense(q, k, v, *, causal=False, segment_ids=None, window=None):
    """Dense float64 attention in jnp with its lse (the mask from ringattn_ref.masks): a jax.vjp oracle."""
    s = q.shape[1]
    pos = np.arange(s)[None]
    seg = (None, None) if segment_ids is None else (segment_ids[:, :, None], segment_ids[:, None, :])
    mask = jnp.asarray(allowed(pos[:, :, None], pos[:, None, :], *seg, causal=causal,
                               window=ref.validation.check_window(window, s)))[:, None]  # (b|1, 1, s, s)
    g = q.shape[2] // k.shape[2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, 2)) * q.shape[-1] ** -0.5
    lse = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, g, 2)), lse


def test_return_lse_and_its_gradient():
    """(o, lse) with lse [b, h, s] float64 for float64 (float32 for float32), -inf on empty rows, and
    gradients through the lse (d lse / d S = P) equal jax.vjp of dense attention."""
    q, k, v, do, rng = arrays(2, 32, 4, 2, 8)
    seg = np.repeat([[0, 1, 1, 2]], 8, axis=1).repeat(2, 0).astype(np.int32)
    kw = dict(causal=True, segment_ids=seg, window=(5, -1))
    mesh = rf.make_mesh(4)
    o, lse = rf.ring_attention(q, k, v, mesh=mesh, return_lse=True, **kw)
    want_o, want_lse = ref.attention(q, k, v, return_lse=True, **kw)
    assert lse.shape == (2, 4, 32) and lse.dtype == jnp.float32
    assert rel_err(o, want_o) <= TOL and rel_err(lse, want_lse) <= TOL
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        dlse = jnp.asarray(rng.standard_normal(want_lse.shape))
        f = lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, return_lse=True, **kw)  # noqa: E731
        (o64, lse64), vjp = jax.vjp(f, q64, k64, v64)
        assert lse64.dtype == jnp.float64 and rel_err(lse64, want_lse) <= 1e-12
        got = vjp((jnp.asarray(do, jnp.float64), dlse))
        want = jax.vjp(lambda q, k, v: dense(q, k, v, **kw), q64, k64, v64)[1]((jnp.asarray(do, jnp.float64), dlse))
        assert max(rel_err(g, w) for g, w in zip(got, want)) <= 1e-10


@pytest.mark.parametrize("seq, layout, causal", [(20, "contiguous", True), (20, "striped", False),
                                                 (36, "zigzag", True)])
def test_any_sequence_length(seq, layout, causal):
    """seq not a multiple of the ring (2x for zigzag): padded inside, real rows and gradients exact."""
    q, k, v, do, _ = arrays(1, seq, 2, 1, 8, seed=seq)
    mesh = rf.make_mesh(8)
    f = lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, causal=causal, layout=layout)  # noqa: E731
    o, vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v)))
    assert o.shape == q.shape
    assert rel_err(o, ref.attention(q, k, v, causal=causal)) <= TOL
    want = ref.ring_attention_vjp(q, k, v, do, n_hosts=1, causal=causal)
    assert max(rel_err(g, w) for g, w in zip(vjp(jnp.asarray(do)), want)) <= TOL


def test_pad_for_ring_inside_a_user_shard_map():
    """The helper for ring_attention_shard users: pad, lay out, shard_map, cut back."""
    q, k, v, _, _ = arrays(1, 21, 2, 2, 8, seed=1)
    mesh = rf.make_mesh(4)
    padded = rf.pad_for_ring(q, k, v, n_hosts=4, layout="zigzag")
    assert padded.q.shape[1] == 24 and padded.segment_ids.shape == (1, 24)
    lay = lambda x: rf.to_layout(x, "zigzag", 4)  # noqa: E731
    spec = jax.P(None, "sp")

    def per_host(q, k, v, seg):
        return rf.ring_attention_shard(q, k, v, causal=True, layout="zigzag", segment_ids=seg,
                                       padding_segment=padded.padding_segment)

    o = jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(
        lay(padded.q), lay(padded.k), lay(padded.v), lay(padded.segment_ids))
    o = padded.unpad(rf.from_layout(o, "zigzag", 4))
    assert rel_err(o, ref.attention(q, k, v, causal=True)) <= TOL


def test_packed_documents_from_cu_seqlens_with_padding():
    """cu_seqlens -> segment ids (0 = padding) and restarting positions; padding_segment=0 masks the
    padding keys and zeroes the padding queries, as MaxText-style data expects."""
    cu = np.array([[0, 5, 9, 13], [0, 16, 16, 16]])
    ids = ref.segment_ids_from_cu_seqlens(cu, 16)
    assert ids[0].tolist() == [1] * 5 + [2] * 4 + [3] * 4 + [0] * 3 and ids[1].tolist() == [1] * 16
    assert ref.positions_from_segment_ids(ids[0]).tolist() == list(range(5)) + list(range(4)) * 2 + list(range(3))
    np.testing.assert_array_equal(rf.segment_ids_from_cu_seqlens(cu, 16), ids)
    np.testing.assert_array_equal(jax.jit(rf.positions_from_segment_ids)(ids), ref.positions_from_segment_ids(ids))
    np.testing.assert_array_equal(jax.jit(rf.segment_ids_from_cu_seqlens, static_argnums=1)(cu, 16), ids)
    for bad in ([0, 5, 3], [-1, 4], [0, 17], [[0.0, 1.0]]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            ref.segment_ids_from_cu_seqlens(np.array(bad), 16)
        with pytest.raises(ValueError, match="cu_seqlens"):
            rf.segment_ids_from_cu_seqlens(np.array(bad), 16)
    q, k, v, _, _ = arrays(2, 16, 2, 2, 8, seed=2)
    k[0, 13:], v[0, 13:] = np.nan, np.nan  # padding keys may hold anything
    o = rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), causal=True, segment_ids=ids, padding_segment=0)
    want = ref.attention(q, k, v, causal=True, segment_ids=ids, padding_segment=0)
    assert np.all(np.asarray(o)[0, 13:] == 0) and rel_err(o, want) <= TOL
    with pytest.raises(ValueError, match="padding_segment must be an int"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=ids, padding_segment=True)


def test_one_dimensional_cu_seqlens_is_a_batch_of_one():
    """1-D cu_seqlens (one packed row) gives [1, seq] ids in both packages, which ring_attention takes as
    they come; positions keep the shape they are given ([seq] or [batch, seq])."""
    cu = np.array([0, 3, 5])
    want = np.array([[1, 1, 1, 2, 2, 0, 0]], np.int32)
    for ids in (ref.segment_ids_from_cu_seqlens(cu, 7), rf.segment_ids_from_cu_seqlens(cu, 7),
                jax.jit(rf.segment_ids_from_cu_seqlens, static_argnums=1)(cu, 7)):
        assert ids.shape == (1, 7) and ids.dtype == np.int32
        np.testing.assert_array_equal(ids, want)
    for positions in (ref.positions_from_segment_ids, rf.positions_from_segment_ids):
        assert np.asarray(positions(want)).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
        assert np.asarray(positions(want[0])).tolist() == [0, 1, 2, 0, 1, 0, 1]
    q, k, v, _, _ = arrays(1, 16, 2, 2, 8, seed=5)
    ids = rf.segment_ids_from_cu_seqlens(np.array([0, 6, 13]), 16)  # [1, 16]
    o = rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), causal=True, segment_ids=ids, padding_segment=0)
    assert rel_err(o, ref.attention(q, k, v, causal=True, segment_ids=np.asarray(ids), padding_segment=0)) <= TOL


@pytest.mark.parametrize("shape, names, batch_axes, head_axis", [
    ((2, 2, 2), ("data", "sp", "tp"), "data", "tp"),
    ((2, 2, 2), ("data", "fsdp", "sp"), ("data", "fsdp"), None),
])
def test_composed_mesh_without_gathering_qkv(shape, names, batch_axes, head_axis):
    """Batch over one or more axes and heads over a tensor-parallel axis, the ring on "sp": exact, and
    the compiled program holds no all-gather (q, k, v stay where they are)."""
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    q, k, v, do, _ = arrays(4, 16, 4, 2, 8, seed=3)
    spec = jax.P(batch_axes, "sp", head_axis, None)
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec))  # noqa: E731
    f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: rf.ring_attention(
        q, k, v, mesh=mesh, causal=True, batch_axes=batch_axes, head_axis=head_axis), q, k, v)[1](q))
    args = [put(x) for x in (q, k, v)]
    hlo = f.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    o = rf.ring_attention(*args, mesh=mesh, causal=True, batch_axes=batch_axes, head_axis=head_axis)
    assert o.sharding.spec == spec and rel_err(o, ref.attention(q, k, v, causal=True)) <= TOL
    want = ref.ring_attention_vjp(q, k, v, q, n_hosts=2, causal=True)
    assert max(rel_err(g, w) for g, w in zip(f(*args), want)) <= TOL


def test_a_repeated_eager_call_traces_nothing():
    """Called outside jit, ring_attention / allgather / Ulysses run one jitted shard_map cached per static
    configuration: the second identical call traces and compiles nothing (op-by-op eager shard_map
    compiled its whole body again on every call), and a permutation layout is keyed by value."""
    q, k, v, _, _ = arrays(1, 32, 4, 2, 8, seed=3)
    mesh = rf.make_mesh(4)
    perm = np.random.default_rng(12345).permutation(32)  # a layout no other test uses
    calls = [lambda: rf.ring_attention(q, k, v, mesh=mesh, causal=True, layout=perm.copy(), dropout_rate=0.1,
                                       dropout_key=7),
             lambda: rf.allgather_attention(q, k, v, mesh=mesh, causal=True),
             lambda: rf.ulysses_attention(q, k, v, mesh=mesh, causal=True)]
    traces = []
    listener = lambda event, secs, **kw: traces.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i, call in enumerate(calls):
            traces.clear()
            first = np.asarray(call())
            assert i > 0 or any("jaxpr_trace" in e for e in traces), traces  # the listener does hear traces
            traces.clear()
            again = np.asarray(call())
            assert not [e for e in traces if "jaxpr_trace" in e or "backend_compile" in e], traces
            np.testing.assert_array_equal(again, first)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_equal_but_differently_typed_arguments_do_not_share_a_compile():
    """``block_q=1`` and ``block_q=True`` hash alike in Python; the cache keys by type too, so the bool is
    still rejected after the int was used (and a 0-d array scale and a list of batch axes still work)."""
    q, k, v, _, _ = arrays(2, 16, 2, 2, 4, seed=4)
    mesh = rf.make_mesh(2)
    good = np.asarray(rf.ring_attention(q, k, v, mesh=mesh, block_q=1))
    with pytest.raises(ValueError, match="block_q"):
        rf.ring_attention(q, k, v, mesh=mesh, block_q=True)
    np.testing.assert_array_equal(np.asarray(rf.ring_attention(q, k, v, mesh=mesh, block_q=1)), good)
    scaled = rf.ring_attention(q, k, v, mesh=mesh, block_q=1, scale=np.array(0.5))
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(rf.ring_attention(q, k, v, mesh=mesh, block_q=1,
                                                                                scale=0.5)), rtol=1e-6)
    mesh2 = jax.make_mesh((2, 2), ("data", "sp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    np.testing.assert_allclose(np.asarray(rf.ring_attention(q, k, v, mesh=mesh2, batch_axes=["data"])), good,
                               rtol=1e-5, atol=1e-6)
