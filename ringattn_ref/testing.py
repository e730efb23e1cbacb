"""Property-test your own attention kernel against the float64 oracle.

This module re-exports the oracle :func:`attention` and provides hypothesis strategies that draw
*consistent* attention problems: shapes that fit together, a GQA ratio, a host count with a sequence
it divides, tile sizes that divide the shard, and optional causal / window / segment-id / bias masks
and a layout (including a random permutation). Example::

    from hypothesis import given
    from ringattn_ref.testing import attention, attention_problems

    @given(attention_problems(max_hosts=8))
    def test_my_ring(problem):
        got = my_ring_attention(problem.q, problem.k, problem.v, **problem.ring_kwargs())
        want = attention(problem.q, problem.k, problem.v, **problem.mask_kwargs())
        assert abs(got - want).max() <= 1e-12

``problem.ring_kwargs()`` holds every keyword of ``ringattn_ref.ring_attention`` (n_hosts, mask
arguments, layout, block_q, block_kv); ``problem.mask_kwargs()`` only those of ``attention``. Drop the
keywords your kernel does not support, or switch them off in the strategy (``bias=False``, ...).

hypothesis is an optional dependency (the ``test`` extra); it is imported when a strategy is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention import attention

__all__ = ["AttentionProblem", "attention", "attention_problems", "max_abs_error", "LAYOUT_CHOICES",
           "InferenceProblem", "PrefixOracle", "inference_problems"]

LAYOUT_CHOICES = ("contiguous", "striped", "zigzag", "permutation")


def max_abs_error(a, b):
    """Max absolute difference of two arrays, where equal ``-inf`` (an ``lse`` row that saw no key)
    counts as 0; raises AssertionError if the ``-inf`` patterns differ. Compare your kernel's output
    with the oracle's this way: ``assert max_abs_error(mine, attention(q, k, v)) <= 1e-12``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), "the -inf entries differ"
    finite = np.isfinite(a)
    return float(np.abs(a[finite] - b[finite]).max(initial=0.0))


@dataclass(frozen=True)
class AttentionProblem:
    """One drawn problem. q, do: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].

    - segment_ids: int [batch, seq] or None;
    - bias: float [b|1, h|1, s|1, s|1] or None (may hold -inf, e.g. whole rows, which gives rows
      that see nothing);
    - window: (left, right) or None;
    - layout: a name or an int permutation array of length seq.
    """
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    n_hosts: int
    causal: bool
    segment_ids: np.ndarray | None
    bias: np.ndarray | None
    window: tuple | None
    scale: float | None
    layout: object
    block_q: int
    block_kv: int

    def mask_kwargs(self):
        """Keywords of ``attention``: causal, segment_ids, bias, window, scale."""
        return dict(causal=self.causal, segment_ids=self.segment_ids, bias=self.bias,
                    window=self.window, scale=self.scale)

    def ring_kwargs(self):
        """Keywords of ``ring_attention`` / ``ring_attention_vjp`` (without return_trace)."""
        return dict(n_hosts=self.n_hosts, layout=self.layout, block_q=self.block_q,
                    block_kv=self.block_kv, **self.mask_kwargs())

    def __repr__(self):  # short, so hypothesis failure reports stay readable
        lay = self.layout if isinstance(self.layout, str) else f"perm{[int(p) for p in self.layout]}"
        return (f"AttentionProblem(q{self.q.shape}, k{self.k.shape}, n_hosts={self.n_hosts}, "
                f"causal={self.causal}, segment_ids={self.segment_ids is not None}, "
                f"bias={None if self.bias is None else self.bias.shape}, window={self.window}, "
                f"scale={self.scale}, layout={lay}, block_q={self.block_q}, "
                f"block_kv={self.block_kv})")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_problems(*, max_hosts=8, min_hosts=1, max_batch=2, max_kv_heads=2, max_group=3,
                       max_dim=8, max_shard=8, layouts=LAYOUT_CHOICES, causal=None,
                       segment_ids=True, bias=True, window=True, masked_rows=True,
                       dtype=np.float64):
    """A hypothesis strategy of :class:`AttentionProblem`.

    max_hosts / min_hosts: range of ``n_hosts``; seq = n_hosts * shard with shard <= ``max_shard``
    (even for zigzag); block_q, block_kv: any divisors of the shard. heads = kv_heads * group
    (group 1 = MHA, kv_heads 1 = MQA). ``causal=None`` draws it; ``segment_ids`` / ``bias`` /
    ``window`` / ``masked_rows`` (-inf bias rows) switch those features on or off (each is then
    drawn present or absent). ``layouts``: names from ``LAYOUT_CHOICES``; ``"permutation"`` draws a
    random permutation array. Arrays are standard normal, drawn from a hypothesis-chosen seed.
    """
    from hypothesis import strategies as st

    @st.composite
    def problems(draw):
        n_hosts = draw(st.integers(min_hosts, max_hosts))
        layout = draw(st.sampled_from(layouts))
        shards = [c for c in range(1, max_shard + 1) if layout != "zigzag" or c % 2 == 0]
        c = draw(st.sampled_from(shards))
        s = n_hosts * c
        block_q = draw(st.sampled_from(_divisors(c)))
        block_kv = draw(st.sampled_from(_divisors(c)))
        b = draw(st.integers(1, max_batch))
        kv_heads = draw(st.integers(1, max_kv_heads))
        h = kv_heads * draw(st.integers(1, max_group))
        d = draw(st.integers(1, max_dim))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        q, do = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((b, s, kv_heads, d)).astype(dtype) for _ in range(2))
        if layout == "permutation":
            layout = rng.permutation(s)
        seg = None
        if segment_ids and draw(st.booleans()):
            seg = rng.integers(0, draw(st.integers(1, 3)), size=(b, s))
            if draw(st.booleans()):
                seg = np.sort(seg, axis=1)  # packed documents: contiguous runs
        bias_arr = None
        if bias and draw(st.booleans()):
            shape = tuple(n if draw(st.booleans()) else 1 for n in (b, h, s, s))
            bias_arr = rng.standard_normal(shape).astype(dtype)
        if masked_rows and draw(st.booleans()):
            if bias_arr is None or bias_arr.shape[2] == 1:
                bias_arr = np.zeros((1, 1, s, 1), dtype) + (0 if bias_arr is None else bias_arr)
            rows = rng.random(s) < 0.25  # these query rows see nothing
            bias_arr = bias_arr.copy()
            bias_arr[:, :, rows] = -np.inf
        win = None
        if window and draw(st.booleans()):
            win = (draw(st.integers(-1, s)), draw(st.integers(-1, s)))
        return AttentionProblem(
            q=q, k=k, v=v, do=do, n_hosts=n_hosts,
            causal=draw(st.booleans()) if causal is None else bool(causal),
            segment_ids=seg, bias=bias_arr, window=win,
            scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))), layout=layout,
            block_q=block_q, block_kv=block_kv)

    return problems()


@dataclass(frozen=True)
class InferenceProblem:
    """One drawn inference run: one or two prefill chunks, then decode steps.

    - prompts: tuple of ``(q [b, m, h, d], k, v [b, m, kv_heads, d], lengths int [b] in [0, m])``;
    - steps: tuple of ``(q [b, 1, h, d], k, v [b, 1, kv_heads, d])``;
    - max_seq: a multiple of n_hosts with room for every prompt and step.
    """
    n_hosts: int
    max_seq: int
    kv_heads: int
    window: tuple | None
    scale: float | None
    prompts: tuple
    steps: tuple

    def __repr__(self):
        q = self.prompts[0][0]
        return (f"InferenceProblem(batch={q.shape[0]}, heads={q.shape[2]}, kv_heads={self.kv_heads}, "
                f"dim={q.shape[3]}, n_hosts={self.n_hosts}, max_seq={self.max_seq}, window={self.window}, "
                f"prompts={[(p[0].shape[1], p[3].tolist()) for p in self.prompts]}, steps={len(self.steps)})")


class PrefixOracle:
    """The answer an inference path must give: ``attention`` over each row's whole prefix so far.

    Feed it what you feed ``prefill`` / ``decode_step``: ``oracle(q, k, v, counts)`` records the first
    ``counts[b]`` tokens of each row (default all) and returns the expected o [b, m, h, d] (0 past
    ``counts[b]``), each token attending causally (and within ``window``) to its row's prefix.
    """

    def __init__(self, batch, *, window=None, scale=None):
        self.rows = [None] * batch
        self.window, self.scale = window, scale

    def __call__(self, q, k, v, counts=None):
        b, m, h, d = q.shape
        counts = np.full(b, m) if counts is None else np.asarray(counts)
        out = np.zeros((b, m, h, d))
        for i in range(b):
            n = int(counts[i])
            new = [x[i:i + 1, :n] for x in (q, k, v)]
            old = self.rows[i]
            self.rows[i] = new if old is None else [np.concatenate(pair, axis=1) for pair in zip(old, new)]
            if n:
                o = attention(*self.rows[i], causal=True, window=self.window, scale=self.scale)
                out[i, :n] = o[0, -n:]
        return out


def inference_problems(*, max_hosts=8, max_batch=3, max_kv_heads=2, max_group=2, max_dim=4, max_prompt=6,
                       max_steps=3, dtype=np.float64):
    """A hypothesis strategy of :class:`InferenceProblem`: random per-row prompt lengths (a second
    prompt = chunked prefill), a window or none, GQA, 1..max_hosts hosts, spare room in the cache."""
    from hypothesis import strategies as st

    @st.composite
    def problems(draw):
        n = draw(st.integers(1, max_hosts))
        b, hk = draw(st.integers(1, max_batch)), draw(st.integers(1, max_kv_heads))
        h, d = hk * draw(st.integers(1, max_group)), draw(st.integers(1, max_dim))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        draw_qkv = lambda m: (rng.standard_normal((b, m, h, d)).astype(dtype),  # noqa: E731
                              *(rng.standard_normal((b, m, hk, d)).astype(dtype) for _ in range(2)))
        prompts = []
        for _ in range(draw(st.integers(1, 2))):
            m = draw(st.integers(1, max_prompt))
            lengths = np.array(draw(st.lists(st.integers(0, m), min_size=b, max_size=b)))
            prompts.append((*draw_qkv(m), lengths))
        steps = tuple(draw_qkv(1)[:3] for _ in range(draw(st.integers(0, max_steps))))
        need = sum(p[0].shape[1] for p in prompts) + len(steps) + draw(st.integers(0, n))
        window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, need), st.integers(-1, need))))
        return InferenceProblem(n_hosts=n, max_seq=n * -(-need // n), kv_heads=hk, window=window,
                                scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))), prompts=tuple(prompts),
                                steps=steps)

    return problems()
