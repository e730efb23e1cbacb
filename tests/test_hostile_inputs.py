"""Issue 21: values that used to wrap silently under ``jit``, and nonsense that used to be accepted.

Each test names what today's code did before the fix: traced reserved segment ids and a traced int64
prompt length were used wrapped (wrong outputs, no flag), ``scale=True`` ran with scale 1, the cost
model picked a strategy from a negative bandwidth, and a model batch of 0 ended in a ``scan`` error.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
from helpers import assert_close, rel_err
from ringattn_fast import inference
from ringattn_fast.model import ModelConfig, forward, sharded_forward
from ringattn_fast.padding import NO_KEY, PADDING
from ringattn_ref import attention, choose_strategy
from ringattn_ref.cost import Hardware
from ringattn_ref.strategy_cost import strategy_costs

B, S, H, D = 1, 14, 2, 8  # 14 tokens on 4 hosts: ring_attention pads to 16 with its padding segment


def qkv(seed=0, s=S):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, s, H, D)).astype(np.float32) for _ in range(3))


def oracle(q, k, v, seg, **kw):
    """The float64 oracle with the reserved ids renamed to an ordinary one (5): what they must mean."""
    seg = np.where(seg < -2**30, 5, seg)
    return attention(*(np.asarray(x, np.float64) for x in (q, k, v)), segment_ids=seg, **kw)


@pytest.mark.parametrize("reserved", [PADDING, NO_KEY])
def test_traced_reserved_segment_ids_mean_an_ordinary_segment(reserved):
    """Before: traced ids equal to -2**31 + 1 became the padding (error 1.06); ranked now, any int32 id
    is an ordinary segment under jit."""
    q, k, v = qkv()
    seg = np.array([[0] * 5 + [reserved] * 5 + [7] * 4])
    run = jax.jit(lambda q, k, v, ids: rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=ids))
    assert rel_err(run(q, k, v, jnp.asarray(seg, jnp.int32)), oracle(q, k, v, seg)) <= 1e-5


def test_traced_no_key_id_is_not_seen_by_the_padding_queries():
    """Before: with padding_segment=7, the padding queries (id NO_KEY inside) saw the keys whose traced
    id was NO_KEY: padding rows 1.36 instead of 0."""
    q, k, v = qkv()
    seg = np.array([[0] * 5 + [NO_KEY] * 5 + [7] * 4])
    run = jax.jit(lambda q, k, v, ids: rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=ids,
                                                          padding_segment=7))
    o = np.asarray(run(q, k, v, jnp.asarray(seg, jnp.int32)))
    assert np.all(o[:, 10:] == 0)  # the caller's padding sees nothing
    assert rel_err(o[:, :10], oracle(q, k, v, seg)[:, :10]) <= 1e-5


def test_padding_segment_no_key_is_rejected():
    """Before: accepted; its padding queries then saw its keys (padding rows 1.14 instead of 0)."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"padding_segment must not be -2147483648 \(padding.NO_KEY, reserved"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=np.zeros((B, S), np.int32),
                          padding_segment=NO_KEY)


def test_concrete_reserved_segment_ids_are_rejected_by_name():
    q, k, v = qkv()
    seg = np.full((B, S), PADDING, np.int32)
    with pytest.raises(ValueError, match=r"segment_ids must not hold the reserved ids -2\*\*31 and -2\*\*31 \+ 1"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), segment_ids=seg)


def _shard_call(mesh, **kw):
    spec = jax.P(None, "sp")
    fn = partial(rf.ring_attention_shard, **kw)
    return jax.jit(jax.shard_map(lambda q, k, v, ids, pos: fn(q, k, v, segment_ids=ids, positions=pos),
                                 mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))


def test_per_host_traced_no_key_id_makes_the_rows_that_see_it_nan():
    """A per-host call cannot rank the ids: a key with traced id NO_KEY is a bad key, so the padding rows
    (and the rows of that id) are NaN, never a silent number. Before: padding rows finite, nonzero."""
    q, k, v = qkv(s=16)
    seg = np.array([[0] * 6 + [NO_KEY] * 2 + [3] * 4 + [9] * 4], np.int32)  # 9: the padding segment
    pos = np.arange(16, dtype=np.int32)[None]
    o = np.asarray(_shard_call(rf.make_mesh(4), padding_segment=9)(q, k, v, seg, pos))
    assert np.isnan(o[:, 6:8]).all() and np.isnan(o[:, 12:]).all()
    want = oracle(q, k, v, seg)
    for rows in (slice(0, 6), slice(8, 12)):  # every other row is exact
        assert rel_err(o[:, rows], want[:, rows]) <= 1e-5


def test_per_host_traced_uint32_ids_are_rejected():
    """uint32 ids cast to int32 wrap (2**31 becomes NO_KEY); traced, they cannot be checked."""
    q, k, v = qkv(s=16)
    seg = np.zeros((B, 16), np.uint32)
    with pytest.raises(ValueError, match="segment_ids has dtype uint32 and values that cannot be read here"):
        _shard_call(rf.make_mesh(4))(q, k, v, seg, np.arange(16, dtype=np.int32)[None])


def test_traced_int64_positions_beyond_int32_are_nan_not_wrapped():
    """Before: positions 2**32 + i were cast to i (an exact-looking, wrong result); now every row is NaN,
    and in-range int64 positions stay exact."""
    q, k, v = qkv(s=16)
    seg = np.zeros((B, 16), np.int32)
    with jax.enable_x64(True):
        run = _shard_call(rf.make_mesh(4), causal=True)
        good = np.asarray(run(q, k, v, seg, np.arange(16, dtype=np.int64)[None] + 2**31 - 17))
        bad = np.asarray(run(q, k, v, seg, np.arange(16, dtype=np.int64)[None] + 2**32))
    assert rel_err(good, attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True)) <= 1e-5
    assert np.isnan(bad).all()


def test_traced_int64_prompt_length_beyond_int32_overflows_the_row():
    """Before: a traced int64 length 2**32 + 3 stored 3 tokens, no flag, finite output."""
    mesh = rf.make_mesh(4)
    cache = inference.init_cache(2, 16, 2, D, mesh=mesh)
    q, k, v = (jnp.asarray(x[:, :4].repeat(2, 0)) for x in qkv())
    with jax.enable_x64(True):
        o, cache = jax.jit(lambda q, k, v, c, n: inference.prefill(q, k, v, c, lengths=n))(
            q, k, v, cache, jnp.asarray([2**32 + 3, 4], jnp.int64))
    assert np.asarray(cache.lengths).tolist() == [0, 4] and np.asarray(cache.overflow).tolist() == [True, False]
    assert np.isnan(np.asarray(o[0])).all() and np.isfinite(np.asarray(o[1])).all()


def test_traced_int64_seq_lengths_of_the_twin_are_not_wrapped():
    """Before: under jit, key_value_seq_lengths = 2**32 + 3 was cast to 3 (output identical to length 3);
    now a length past the sequence means every key, as in jax.nn, and a negative one none."""
    q, k, v = qkv(s=16)
    twin = jax.jit(lambda q, k, v, kl, ql: rf.dot_product_attention(
        q, k, v, key_value_seq_lengths=kl, query_seq_lengths=ql, mesh=rf.make_mesh(4)))
    with jax.enable_x64(True):
        wide = np.asarray(twin(q, k, v, jnp.asarray([2**32 + 3] * B, jnp.int64), jnp.asarray([2**32 + 3] * B, jnp.int64)))
        full = np.asarray(twin(q, k, v, jnp.asarray([16] * B, jnp.int64), jnp.asarray([16] * B, jnp.int64)))
        none = np.asarray(twin(q, k, v, jnp.asarray([16] * B, jnp.int64), jnp.asarray([-2**32 + 3] * B, jnp.int64)))
    want = jax.nn.dot_product_attention(q, k, v)
    assert rel_err(wide, want) <= 1e-5 and rel_err(full, want) <= 1e-5
    assert (none == 0).all()  # query_seq_lengths < 0: every row is padding, zeroed (not 3 rows kept)


@pytest.mark.parametrize("scale", [True, np.bool_(False), "0.5"])
def test_scale_must_be_a_real_number(scale):
    """Before: scale=True ran with scale 1 (and "0.5" with 0.5)."""
    q, k, v = qkv(s=16)
    match = "scale must be a positive finite real number"
    with pytest.raises(ValueError, match=match):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), scale=scale)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, scale=scale)


def test_an_int_cache_is_rejected():
    """init_cache(dtype=int32) would truncate K/V (decode error 0.58); rejected (already before issue 21)."""
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype"):
        inference.init_cache(1, 8, 1, D, mesh=rf.make_mesh(4), dtype=jnp.int32)


SHAPE = dict(seq=1024, heads=8, kv_heads=8, dim=64, devices=4)


@pytest.mark.parametrize("hardware, what", [
    (Hardware("neg", 1e12, -1e9), "hardware.bandwidth_bytes_per_s"),  # before: picked a strategy
    (Hardware("nan", 1e12, float("nan")), "hardware.bandwidth_bytes_per_s"),  # before: picked a strategy
    (Hardware("zero", 1e12, 0.0), "hardware.bandwidth_bytes_per_s"),  # before: ZeroDivisionError
    (Hardware("negflops", -1e12, 1e9), "hardware.flops_per_s"),  # before: StopIteration
    (Hardware("bool", True, 1e9), "hardware.flops_per_s"),
])
def test_cost_model_rates_must_be_positive_finite_numbers(hardware, what):
    for fn in (choose_strategy, strategy_costs):
        with pytest.raises(ValueError, match=rf"{what} \(of '{hardware.name}'\) must be a positive finite number"):
            fn(**SHAPE, hardware=hardware)


@pytest.mark.parametrize("kw, match", [
    (dict(tolerance=-0.1), r"tolerance must be a finite number >= 0; got -0.1"),  # before: StopIteration
    (dict(tolerance=float("nan")), r"tolerance must be a finite number >= 0; got nan"),
    (dict(tolerance=True), r"tolerance must be a finite number >= 0 \(not a bool or a string\); got True"),
    (dict(dtype_bytes=0), r"dtype_bytes must be a positive finite number; got 0"),
    (dict(dtype_bytes=True), r"dtype_bytes must be a positive finite number \(not a bool"),
    (dict(memory_limit_bytes=-1), r"memory_limit_bytes must be a positive finite number; got -1"),
    (dict(memory_limit_bytes=float("inf")), r"memory_limit_bytes must be a positive finite number; got inf"),
])
def test_cost_model_sizes_and_tolerance_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        choose_strategy(**SHAPE, hardware="TPU v4", **kw)
    assert choose_strategy(**SHAPE, hardware="TPU v4", tolerance=0).strategy  # 0: only the fastest


def test_model_batch_zero_is_a_value_error():
    """Before: a scan carry-type error from deep inside the forward."""
    cfg = ModelConfig(vocab=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, ffn_block=4)
    params = None  # the tokens are checked before the parameters are used
    tokens = np.zeros((0, 16), np.int32)
    with pytest.raises(ValueError, match=r"tokens must hold batch >= 1 and seq >= 1 tokens; got shape \(0, 16\)"):
        sharded_forward(params, tokens, tokens, cfg, rf.make_mesh(4))
    with pytest.raises(ValueError, match=r"positions must have the shape of tokens \(1, 16\); got \(1, 8\)"):
        forward(params, np.zeros((1, 16), np.int32), np.zeros((1, 8), np.int32), cfg)


@pytest.mark.parametrize("sinks", [np.zeros(4, np.int32), np.zeros(5, np.float32), np.zeros((1, 4), np.float32),
                                   np.zeros((), np.float32)])
def test_the_twins_sinks_are_float_per_head(sinks):
    """``rf.dot_product_attention(..., sinks=)``: float [N] only; an int dtype, [N + 1], [1, N] or a scalar is a
    ValueError naming sinks, what was given and what is needed (it was accepted, or a broadcasting error
    from inside jax.numpy)."""
    x = jnp.ones((1, 8, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point array of shape \[heads\] = \(4,\)"):
        rf.dot_product_attention(x, x, x, mesh=rf.make_mesh(2), sinks=sinks)


@pytest.mark.parametrize("spelling", ["list", "tuple", "numpy", "jnp"])
def test_sinks_as_a_list_or_tuple_of_floats(spelling):
    """sinks given as a Python list or tuple of floats work as the array does, in the ring, the twin and the
    reference (they passed the check and then failed inside with AttributeError: no .astype)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 16, 4, 8)), jnp.float32)
    values = [0.5, -1.0, 2.0, 0.0]
    sinks = {"list": values, "tuple": tuple(values), "numpy": np.asarray(values, np.float32),
             "jnp": jnp.asarray(values)}[spelling]
    want = rf.ring_attention(x, x, x, mesh=rf.make_mesh(2), sinks=jnp.asarray(values))
    assert_close(rf.ring_attention(x, x, x, mesh=rf.make_mesh(2), sinks=sinks), want, tol=0)
    assert_close(rf.dot_product_attention(x, x, x, mesh=rf.make_mesh(2), sinks=sinks), want, tol=1e-6)
    assert_close(attention(*(np.asarray(t, np.float64) for t in (x, x, x)), sinks=sinks), want, tol=1e-5)


SPELLINGS = {"bfloat16": ("bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16), jnp.dtype("bfloat16")),
             "float16": ("float16", np.float16, jnp.float16, np.dtype("float16"), jnp.dtype("float16"))}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_dtype_arguments_in_every_spelling(name):
    """comm_dtype, grad_comm_dtype (and init_cache: tests/test_fast_inference.py) take a dtype however it is
    spelled: a string, numpy's or jnp's scalar type, np.dtype, jnp.dtype; the ring's result is the same."""
    from ringattn_fast import comm
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 2, 8)), jnp.float32)
    mesh = rf.make_mesh(4)
    outs = []
    for spelling in SPELLINGS[name]:
        assert comm.check_comm_dtype(spelling) == name
        assert comm.check_comm_dtype(spelling, "grad_comm_dtype", comm.GRAD_COMM_DTYPES) == name
        outs.append(np.asarray(rf.ring_attention(x, x, x, mesh=mesh, causal=True, comm_dtype=spelling)))
    assert all(np.array_equal(o, outs[0]) for o in outs)
