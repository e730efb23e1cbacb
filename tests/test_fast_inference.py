"""ringattn_fast.inference against ringattn_ref.inference (float64 <= 1e-10, float32 <= 2e-5), the same greedy
tokens as a dense single-device cache, and bad input: a ValueError with the cache untouched, or (traced
facts under jit) the documented overflow flag with nothing written."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import ringattn_fast as rf
from ringattn_fast import inference as fi
from ringattn_ref import inference as ri
from ringattn_ref.testing import inference_problems
from helpers import examples

STATIC = ("window", "scale", "mesh")
PREFILL = jax.jit(fi.prefill, static_argnames=STATIC, donate_argnums=3)
DECODE = jax.jit(fi.decode_step, static_argnames=STATIC, donate_argnums=3)


def run_both(problem, mesh, dtype):
    """Every output of the fast path and of the ref on the same calls; max abs difference of outputs and caches."""
    b, d = problem.prompts[0][0].shape[0], problem.prompts[0][0].shape[3]
    rc = ri.init_cache(b, problem.max_seq, problem.kv_heads, d, n_hosts=problem.n_hosts)
    fc = fi.init_cache(b, problem.max_seq, problem.kv_heads, d, mesh=mesh, dtype=dtype)
    kw = dict(window=problem.window, scale=problem.scale, mesh=mesh)
    cast = lambda *xs: [jnp.asarray(x, dtype) for x in xs]  # noqa: E731
    err = 0.0
    for q, k, v, lengths in problem.prompts:
        want, rc = ri.prefill(q, k, v, rc, lengths=lengths, window=problem.window, scale=problem.scale)
        got, fc = PREFILL(*cast(q, k, v), fc, lengths=jnp.asarray(lengths, jnp.int32), **kw)
        err = max(err, np.abs(np.asarray(got, np.float64) - want).max())
    for q, k, v in problem.steps:
        want, rc = ri.decode_step(q, k, v, rc, window=problem.window, scale=problem.scale)
        got, fc = DECODE(*cast(q, k, v), fc, **kw)
        err = max(err, np.abs(np.asarray(got, np.float64) - want).max())
    np.testing.assert_array_equal(np.asarray(fc.lengths), rc.lengths)
    assert not np.asarray(fc.overflow).any()
    stored = np.concatenate(list(rc.k), axis=1)  # host r's slots, in host order = the striped global array
    return err, np.abs(np.asarray(fc.k, np.float64) - stored).max()


@pytest.mark.slow
@settings(max_examples=examples(4), deadline=None)
@given(inference_problems(max_hosts=8, max_batch=2, max_steps=2))
def test_float64_matches_the_reference(problem):
    with jax.enable_x64(True):
        err, cache_err = run_both(problem, rf.make_mesh(problem.n_hosts), jnp.float64)
    assert err <= 1e-10 and cache_err <= 1e-10


@pytest.mark.parametrize("data", [1, 2])
def test_float32_matches_the_reference_also_with_a_data_axis(data):
    rng = np.random.default_rng(data)
    b, h, hk, d = 2, 4, 2, 8
    prompts = tuple((rng.standard_normal((b, m, h, d)), *rng.standard_normal((2, b, m, hk, d)), np.array(lens))
                    for m, lens in ((7, [7, 2]), (5, [0, 5])))
    steps = tuple((rng.standard_normal((b, 1, h, d)), *rng.standard_normal((2, b, 1, hk, d))) for _ in range(3))
    problem = ri_problem = type("P", (), dict(n_hosts=8 // data, max_seq=32, kv_heads=hk, window=(6, -1), scale=None,
                                              prompts=prompts, steps=steps))
    err, cache_err = run_both(ri_problem, rf.make_mesh(8, data=data), jnp.float32)
    assert problem.n_hosts * data == 8
    assert err <= 2e-5 and cache_err <= 2e-5


# --- a tiny random-weight decoder: the same greedy tokens with the sharded cache as with a dense one ---

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_SEQ = 32, 32, 4, 2, 8, 64


def params(seed=0):
    rng = np.random.default_rng(seed)
    init = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    return dict(embed=init(VOCAB, HIDDEN) * np.sqrt(VOCAB), wq=init(HIDDEN, HEADS * HEAD_DIM),
                wk=init(HIDDEN, KV_HEADS * HEAD_DIM), wv=init(HIDDEN, KV_HEADS * HEAD_DIM),
                wo=init(HEADS * HEAD_DIM, HIDDEN), unembed=init(HIDDEN, VOCAB))


def logits_of(p, tokens, attend):
    """tokens int [b, m] -> logits [b, m, vocab]; attend(q, k, v) -> o does the cache work."""
    x = p["embed"][tokens]  # (b, m, hidden)
    b, m, _ = x.shape
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q = (h @ p["wq"]).reshape(b, m, HEADS, HEAD_DIM)
    k, v = ((h @ p[w]).reshape(b, m, KV_HEADS, HEAD_DIM) for w in ("wk", "wv"))
    x = x + attend(q, k, v).reshape(b, m, -1) @ p["wo"]
    return x @ p["unembed"]


def dense_attend(q, k, v, cache, lengths):
    """A dense single-device cache (ck, cv [b, S, hk, d], held [b]): write at held + j, attend causally."""
    ck, cv, held = cache
    b, m = q.shape[:2]
    j = jnp.arange(m)[None]
    pos = held[:, None] + j  # (b, m)
    slot = jnp.where(j < lengths[:, None], pos, MAX_SEQ)
    rows = jnp.arange(b)[:, None]
    ck, cv = ck.at[rows, slot].set(k, mode="drop"), cv.at[rows, slot].set(v, mode="drop")
    g = HEADS // KV_HEADS
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(ck, g, 2)) * HEAD_DIM ** -0.5
    kp = jnp.arange(MAX_SEQ)[None, None]
    mask = (kp <= pos[:, :, None]) & (kp < (held + lengths)[:, None, None])  # (b, m, S)
    w = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(mask[:, None], w, 0.0), jnp.repeat(cv, g, 2))
    return o, (ck, cv, held + lengths)


def generate(p, prompt, lengths, n_new, prefill_fn, decode_fn, cache):
    """Greedy decoding: prefill the prompts (per-row lengths), then n_new tokens per row."""
    out = {}
    lg = logits_of(p, prompt, lambda q, k, v: prefill_fn(q, k, v, cache, lengths, out))
    tok = jnp.argmax(lg[jnp.arange(prompt.shape[0]), lengths - 1], -1)  # last real prompt token
    tokens = [tok]
    for _ in range(n_new - 1):
        lg = logits_of(p, tok[:, None], lambda q, k, v: decode_fn(q, k, v, out))
        tok = jnp.argmax(lg[:, 0], -1)
        tokens.append(tok)
    return np.stack([np.asarray(t) for t in tokens], 1)


def test_greedy_tokens_are_those_of_a_dense_single_device_cache():
    p = params()
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, VOCAB, (2, 13)))
    lengths = jnp.array([13, 6], jnp.int32)
    mesh = rf.make_mesh(8)

    def sharded_prefill(q, k, v, cache, lengths, out):
        o, out["cache"] = PREFILL(q, k, v, cache, lengths=lengths, mesh=mesh)
        return o

    def sharded_decode(q, k, v, out):
        o, out["cache"] = DECODE(q, k, v, out["cache"], mesh=mesh)
        return o

    dense = jax.jit(dense_attend)

    def dense_prefill(q, k, v, cache, lengths, out):
        o, out["cache"] = dense(q, k, v, cache, lengths)
        return o

    def dense_decode(q, k, v, out):
        o, out["cache"] = dense(q, k, v, out["cache"], jnp.ones(2, jnp.int32))
        return o

    cache = fi.init_cache(2, MAX_SEQ, KV_HEADS, HEAD_DIM, mesh=mesh)
    ours = generate(p, prompt, lengths, 12, sharded_prefill, sharded_decode, cache)
    zeros = jnp.zeros((2, MAX_SEQ, KV_HEADS, HEAD_DIM))
    want = generate(p, prompt, lengths, 12, dense_prefill, dense_decode, (zeros, zeros, jnp.zeros(2, jnp.int32)))
    np.testing.assert_array_equal(ours, want)
    assert len(set(want.ravel().tolist())) > 2  # the decoder does not emit one token forever


# --- bad input ---

def _filled(mesh, held):
    """A float32 cache of 2 rows, max_seq 16, holding ``held`` tokens per row, and its numpy copy."""
    rng = np.random.default_rng(7)
    cache = fi.init_cache(2, 16, 1, 2, mesh=mesh)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 1, 2)), jnp.float32) for _ in range(3))  # one compile
    _, cache = PREFILL(q, k, v, cache, lengths=jnp.asarray(held, jnp.int32), mesh=mesh)
    return cache, [np.asarray(x) for x in (cache.k, cache.v, cache.lengths, cache.overflow)]


def _same(cache, copy):
    for x, y in zip((cache.k, cache.v, cache.lengths, cache.overflow), copy):
        np.testing.assert_array_equal(np.asarray(x), y)


@pytest.mark.parametrize("fn, m, hk, d, kwargs, name", [
    ("prefill", 3, 2, 2, {}, "k/v"), ("prefill", 3, 1, 4, {}, "k/v"),
    ("prefill", 3, 1, 2, {"lengths": jnp.array([1, 2, 3], jnp.int32)}, "lengths"),
    ("prefill", 3, 1, 2, {"lengths": jnp.array([4, 0], jnp.int32)}, "lengths"),  # concrete: outside [0, m]
    ("prefill", 5, 1, 2, {}, "q: the prompt"),  # concrete: row 0 holds 12 of 16
    ("decode_step", 2, 1, 2, {}, "m = 1"),
])
def test_trace_time_errors_leave_the_cache_untouched(fn, m, hk, d, kwargs, name):
    mesh = rf.make_mesh(4)
    cache, copy = _filled(mesh, [12, 3])
    q, k, v = jnp.zeros((2, m, 2, d)), jnp.zeros((2, m, hk, d)), jnp.zeros((2, m, hk, d))
    with pytest.raises(ValueError, match=name):  # not jitted: lengths and cache.lengths are concrete
        getattr(fi, fn)(q, k, v, cache, mesh=mesh, **kwargs)
    _same(cache, copy)
    with pytest.raises(ValueError, match="batch"):  # jitted with the cache donated: raised while tracing
        DECODE(jnp.zeros((3, 1, 2, 2)), jnp.zeros((3, 1, 1, 2)), jnp.zeros((3, 1, 1, 2)), cache, mesh=mesh)
    _same(cache, copy)


def test_traced_overflow_writes_nothing_and_sets_the_flag():
    """Under jit the lengths are traced: a row that does not fit is left as it was, flagged, its output NaN."""
    mesh = rf.make_mesh(4)
    cache, copy = _filled(mesh, [12, 3])
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 1, 2)), jnp.float32) for _ in range(3))
    for lengths, bad in (([5, 6], 0), ([2, 7], 1), ([-1, 2], 0)):  # room: 4 / 13; 7 > m = 6; -1 < 0
        cache, copy = _filled(mesh, [12, 3])
        o, new = PREFILL(q, k, v, cache, lengths=jnp.asarray(lengths, jnp.int32), mesh=mesh)
        good = 1 - bad
        assert np.isnan(np.asarray(o)[bad]).all() and not np.isnan(np.asarray(o)[good]).any()
        np.testing.assert_array_equal(np.asarray(new.overflow), [bad == 0, bad == 1])
        assert int(new.lengths[bad]) == copy[2][bad] and int(new.lengths[good]) == copy[2][good] + lengths[good]
        for got, before in zip((new.k, new.v), copy[:2]):  # the flagged row's slots: every one as it was
            np.testing.assert_array_equal(np.asarray(got)[bad], before[bad])
    full, copy = _filled(mesh, [16, 3])
    step = jax.jit(lambda q, k, v, c: fi.decode_step(q, k, v, c, mesh=mesh))  # traced lengths
    o, new = step(q[:, :1], k[:, :1], v[:, :1], full)
    assert np.isnan(np.asarray(o)[0]).all() and np.isfinite(np.asarray(o)[1]).all()
    np.testing.assert_array_equal(np.asarray(new.lengths), [16, 4])
    np.testing.assert_array_equal(np.asarray(new.overflow), [True, False])
    np.testing.assert_array_equal(np.asarray(new.k)[0], copy[0][0])
    with pytest.raises(ValueError, match="cache: the decode step"):  # the same call outside jit: concrete
        fi.decode_step(q[:, :1], k[:, :1], v[:, :1], full, mesh=mesh)


# --- programmable attention: soft-cap, sinks, a value width of its own, mask and score functions ---

from test_ref_inference import HK, D, VARIANTS, expected, variant_calls  # noqa: E402  (one table for both)

VARIANT_STATIC = STATIC + ("logit_softcap", "mask_fn", "score_fn")
PREFILL_V = jax.jit(fi.prefill, static_argnames=VARIANT_STATIC, donate_argnums=3)
DECODE_V = jax.jit(fi.decode_step, static_argnames=VARIANT_STATIC, donate_argnums=3)


@pytest.mark.parametrize("name, data", [(name, 2 if name == "all" else 1) for name in sorted(VARIANTS)])
def test_variants_in_prefill_and_decode_match_the_oracle(name, data):
    """float32 on 4 hosts (all at once: 4 x 2 with a data axis) vs the float64 oracle over each row's prefix."""
    kw, dv = VARIANTS[name]
    b, mesh = 2, rf.make_mesh(4 * data, data=data)
    cache = fi.init_cache(b, 32, HK, D, mesh=mesh, value_dim=dv)
    prefix = [[np.zeros((1, 0, HK, D)), np.zeros((1, 0, HK, dv))] for _ in range(b)]
    for q, k, v, lengths in variant_calls(sorted(VARIANTS).index(name), dv):
        q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
        if lengths is None:
            o, cache = DECODE_V(q, k, v, cache, mesh=mesh, **kw)
        else:
            o, cache = PREFILL_V(q, k, v, cache, lengths=jnp.asarray(lengths, jnp.int32), mesh=mesh, **kw)
        assert o.shape == q.shape[:3] + (dv,) and o.dtype == jnp.float32
        want = expected(prefix, *(np.asarray(x, np.float64) for x in (q, k, v)), lengths, kw)
        np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=0, atol=2e-5)
    assert np.asarray(cache.lengths).tolist() == [14, 13] and not np.asarray(cache.overflow).any()


@pytest.mark.parametrize("kwargs, name", [
    (dict(logit_softcap=-1.0), "logit_softcap"), (dict(sinks=jnp.zeros(3)), "sinks"),
    (dict(sinks=jnp.zeros(2, jnp.int32)), "sinks"), (dict(mask_fn="causal"), "mask_fn"),
    (dict(mask_fn=lambda qp, kp, qs, ks, h: kp - qp), "mask_fn"),
    (dict(score_fn=lambda s, qp, kp, h: s.sum(-1)), "score_fn"),
])
def test_bad_variants_name_the_argument_and_leave_the_cache_untouched(kwargs, name):
    mesh = rf.make_mesh(4)
    cache, copy = _filled(mesh, [12, 3])
    q, k, v = jnp.zeros((2, 1, 2, 2)), jnp.zeros((2, 1, 1, 2)), jnp.zeros((2, 1, 1, 2))
    for fn in (fi.prefill, fi.decode_step):
        with pytest.raises(ValueError, match=name):
            fn(q, k, v, cache, mesh=mesh, **kwargs)
    with pytest.raises(ValueError, match="value_dim"):
        fi.decode_step(q, k, jnp.zeros((2, 1, 1, 3)), cache, mesh=mesh)
    _same(cache, copy)


def test_init_cache_takes_every_dtype_spelling():
    """``dtype`` as numpy's scalar type (the commonest spelling; it raised a TypeError), jnp's, a string,
    ``np.dtype`` and ``jnp.dtype``: the cache holds that dtype; a non-float or a non-dtype is a ValueError."""
    mesh = rf.make_mesh(2)
    for spelling, want in ((np.float32, "float32"), (jnp.bfloat16, "bfloat16"), ("float16", "float16"),
                           (np.dtype("float32"), "float32"), (jnp.dtype("bfloat16"), "bfloat16")):
        cache = fi.init_cache(1, 8, 1, 4, mesh=mesh, dtype=spelling)
        assert cache.k.dtype == cache.v.dtype == jnp.dtype(want), spelling
    for bad in (np.int32, "int8", "not a dtype", object()):
        with pytest.raises(ValueError, match="dtype must be a floating-point dtype"):
            fi.init_cache(1, 8, 1, 4, mesh=mesh, dtype=bad)
