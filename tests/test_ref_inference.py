"""ringattn_ref.inference: every output equals attention over the whole prefix so far (float64, 1e-12);
bad input is a ValueError naming the argument and leaves the cache as it was."""
import numpy as np
import pytest
from hypothesis import given, settings

from ringattn_ref import inference as inf
from ringattn_ref.testing import PrefixOracle, inference_problems
from helpers import examples


def run(problem, decode_schedule="tree"):
    """Prefill chunks then decode steps; returns the max error against the prefix oracle and the cache."""
    b = problem.prompts[0][0].shape[0]
    q0 = problem.prompts[0][0]
    cache = inf.init_cache(b, problem.max_seq, problem.kv_heads, q0.shape[3], n_hosts=problem.n_hosts)
    oracle, err = PrefixOracle(b, window=problem.window, scale=problem.scale), 0.0
    kw = dict(window=problem.window, scale=problem.scale)
    for q, k, v, lengths in problem.prompts:
        o, cache = inf.prefill(q, k, v, cache, lengths=lengths, **kw)
        err = max(err, np.abs(o - oracle(q, k, v, lengths)).max())
    for q, k, v in problem.steps:
        o, cache = inf.decode_step(q, k, v, cache, schedule=decode_schedule, **kw)
        err = max(err, np.abs(o - oracle(q, k, v)).max())
    return err, cache


@settings(max_examples=examples(60), deadline=None)
@given(inference_problems(max_hosts=8))
def test_prefill_then_decode_matches_attention_over_the_prefix(problem):
    err, cache = run(problem)
    assert err <= 1e-12
    want = sum(p[3] for p in problem.prompts) + len(problem.steps)
    np.testing.assert_array_equal(cache.lengths, want)


@settings(max_examples=examples(8), deadline=None)
@given(inference_problems(max_hosts=5, max_steps=2))
def test_ring_decode_gives_the_tree_result(problem):
    assert run(problem, "ring")[0] <= 1e-12


def test_round_robin_positions_and_the_two_traces():
    """Position p on host p % N, slot p // N; prefill sends N-1 shards per host, decode log2 N messages."""
    rng = np.random.default_rng(0)
    b, m, h, hk, d, n, s = 2, 10, 4, 2, 3, 8, 64
    cache = inf.init_cache(b, s, hk, d, n_hosts=n)
    q, k, v = rng.standard_normal((b, m, h, d)), *rng.standard_normal((2, b, m, hk, d))
    _, cache, ring = inf.prefill(q, k, v, cache, return_trace=True)
    for p in range(m):
        np.testing.assert_array_equal(cache.k[p % n, :, p // n], k[:, p])
    assert ring.n_steps == n - 1 and len(ring.sends) == n * (n - 1)
    assert ring.total_bytes == n * (n - 1) * 2 * b * (s // n) * hk * d * 8  # whole K/V shards
    _, cache, tree = inf.decode_step(q[:, :1], k[:, :1], v[:, :1], cache, return_trace=True)
    assert tree.n_steps == 3 and len(tree.sends) == n - 1  # 4 + 2 + 1 messages
    assert tree.total_bytes == (n - 1) * b * h * (d + 1) * 8  # one o row and one lse per head


def _cache_with_room(room):
    cache = inf.init_cache(2, 8, 1, 2, n_hosts=2)
    rng = np.random.default_rng(1)
    m = 8 - room
    _, cache = inf.prefill(*(rng.standard_normal((2, m, 1, 2)) for _ in range(3)), cache)
    return cache


BAD = [  # (function, q/k/v shapes, kwargs, the argument the message must name)
    ("prefill", (3, 1, 2), (3, 1, 2), {}, "q"),  # longer than the room left (2)
    ("prefill", (2, 1, 2), (2, 1, 2), {"lengths": np.array([3, 0])}, "lengths"),
    ("prefill", (2, 1, 2), (2, 1, 2), {"lengths": np.array([-1, 0])}, "lengths"),
    ("prefill", (2, 1, 2), (2, 1, 2), {"lengths": np.array([1])}, "lengths"),
    ("prefill", (2, 2, 2), (2, 2, 2), {}, "k/v"),  # kv heads disagree with the cache
    ("prefill", (2, 1, 3), (2, 1, 3), {}, "k/v"),  # dim disagrees
    ("decode_step", (2, 1, 2), (2, 1, 2), {}, "m = 1"),
]


@pytest.mark.parametrize("fn, q_shape, kv_shape, kwargs, name", BAD)
def test_bad_input_names_the_argument_and_keeps_the_cache(fn, q_shape, kv_shape, kwargs, name):
    cache = _cache_with_room(2)
    before = [x.copy() for x in (cache.k, cache.v, cache.lengths)]
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2,) + q_shape)
    k, v = rng.standard_normal((2, 2) + kv_shape)
    with pytest.raises(ValueError, match=name):
        getattr(inf, fn)(q, k, v, cache, **kwargs)
    for x, y in zip(before, (cache.k, cache.v, cache.lengths)):
        np.testing.assert_array_equal(x, y)


def test_batch_mismatch_and_full_row():
    cache = _cache_with_room(0)
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="batch"):
        inf.prefill(*(rng.standard_normal((3, 1, 1, 2)) for _ in range(3)), cache)
    with pytest.raises(ValueError, match="cache: row 0 is full"):
        inf.decode_step(*(rng.standard_normal((2, 1, 1, 2)) for _ in range(3)), cache)
    with pytest.raises(ValueError, match="max_seq"):
        inf.init_cache(1, 10, 1, 2, n_hosts=4)


# --- programmable attention: soft-cap, sinks, a value width of its own, mask and score functions ---

from ringattn_ref import variants  # noqa: E402
from ringattn_ref.attention import attention  # noqa: E402

H, HK, D = 4, 2, 3
VARIANTS = {  # name -> (keywords of prefill / decode_step and of the oracle, value width)
    "softcap": (dict(logit_softcap=1.5), D),
    "sinks": (dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])), D),
    "d_v": ({}, 5),
    "streaming": (dict(mask_fn=variants.streaming(2, 4)), D),
    "chunked_local": (dict(mask_fn=variants.chunked_local(4), window=(6, -1)), D),
    "alibi": (dict(score_fn=variants.alibi(variants.alibi_slopes(H))), D),
    "all": (dict(logit_softcap=2.0, sinks=np.array([0.0, 1.0, -0.5, 3.0]), mask_fn=variants.streaming(1, 5),
                 score_fn=variants.alibi(variants.alibi_slopes(H))), 2),
}


def variant_calls(seed, dv, *, b=2, m=6, steps=4):
    """Two prompt chunks with per-row lengths (chunked prefill), then decode steps: ``(q, k, v, lengths)``."""
    rng = np.random.default_rng(seed)
    draw = lambda t: (rng.standard_normal((b, t, H, D)), rng.standard_normal((b, t, HK, D)),  # noqa: E731
                      rng.standard_normal((b, t, HK, dv)))
    return [(*draw(m), np.array([6, 3])), (*draw(m), np.array([4, 6]))] + [(*draw(1), None) for _ in range(steps)]


def expected(prefix, q, k, v, lengths, kw):
    """The oracle over each row's prefix so far (``prefix[row] = [k, v]``, updated): its new queries sit at
    the last positions, o 0 past ``lengths[row]``."""
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for row in range(q.shape[0]):
        n = q.shape[1] if lengths is None else int(lengths[row])
        prefix[row] = [np.concatenate([old, new[row:row + 1, :n]], axis=1) for old, new in zip(prefix[row], (k, v))]
        if n:
            out[row, :n] = attention(q[row:row + 1, :n], *prefix[row], causal=True, **kw)[0]
    return out


@pytest.mark.parametrize("schedule", ["tree", "ring"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_in_prefill_and_decode_match_the_oracle(name, schedule):
    kw, dv = VARIANTS[name]
    b, n_hosts = 2, 4
    cache = inf.init_cache(b, 32, HK, D, n_hosts=n_hosts, value_dim=dv)
    prefix = [[np.zeros((1, 0, HK, D)), np.zeros((1, 0, HK, dv))] for _ in range(b)]
    for q, k, v, lengths in variant_calls(sorted(VARIANTS).index(name), dv):
        if lengths is None:
            o, cache = inf.decode_step(q, k, v, cache, schedule=schedule, **kw)
        else:
            o, cache = inf.prefill(q, k, v, cache, lengths=lengths, **kw)
        assert o.shape == q.shape[:3] + (dv,)
        np.testing.assert_allclose(o, expected(prefix, q, k, v, lengths, kw), rtol=0, atol=1e-12)
    assert cache.value_dim == dv and cache.lengths.tolist() == [14, 13]


@pytest.mark.parametrize("kwargs, name", [
    (dict(logit_softcap=0.0), "logit_softcap"), (dict(logit_softcap=True), "logit_softcap"),
    (dict(sinks=np.zeros(3)), "sinks"), (dict(sinks=np.zeros(4, np.int32)), "sinks"),
    (dict(mask_fn=3), "mask_fn"), (dict(mask_fn=lambda qp, kp, qs, ks, h: kp - qp), "mask_fn"),
    (dict(score_fn=lambda s, qp, kp, h: s[..., :1]), "score_fn"),
])
def test_bad_variants_name_the_argument_and_keep_the_cache(kwargs, name):
    cache = _cache_with_room(4)
    before = [x.copy() for x in (cache.k, cache.v, cache.lengths)]
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 1, 4, 2)), *rng.standard_normal((2, 2, 1, 1, 2))
    for fn in (inf.prefill, inf.decode_step):
        with pytest.raises(ValueError, match=name):
            fn(q, k, v, cache, **kwargs)
    with pytest.raises(ValueError, match="value_dim"):
        inf.prefill(q, k, rng.standard_normal((2, 1, 1, 3)), cache)
    for x, y in zip(before, (cache.k, cache.v, cache.lengths)):
        np.testing.assert_array_equal(x, y)
