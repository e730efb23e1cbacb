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
