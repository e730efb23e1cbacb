"""The oracle, the online softmax, merge, masks and blockwise attention (ringattn_ref)."""
import os
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn_ref import attention, blockwise_attention, merge
from ringattn_ref.masks import allowed, tile_is_empty
from ringattn_ref.softmax import finalize, init_state, online_update
from ringattn_ref.testing import attention_problems, max_abs_error as max_err
from helpers import examples

TOL = 1e-12


def loop_attention(q, k, v, *, causal, segment_ids, bias, window, scale):
    """Row-by-row attention written independently of the oracle: the oracle's oracle."""
    b, s, h, d = q.shape
    group = h // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    bias = np.zeros((1, 1, 1, 1)) if bias is None else bias
    bias = np.broadcast_to(bias, (b, h, s, s))
    o = np.zeros_like(q)
    lse = np.full((b, h, s), -np.inf)
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                keys = []
                for j in range(s):
                    ok = not (causal and j > i)
                    if window is not None:
                        left, right = window
                        ok &= (left < 0 or j >= i - left) and (right < 0 or j <= i + right)
                    if segment_ids is not None:
                        ok &= segment_ids[bi, i] == segment_ids[bi, j]
                    logit = scale * q[bi, i, hi] @ k[bi, j, hi // group] + bias[bi, hi, i, j]
                    if ok and logit > -np.inf:
                        keys.append((j, logit))
                if keys:
                    logits = np.array([x for _, x in keys])
                    w = np.exp(logits - logits.max())
                    o[bi, i, hi] = (w / w.sum()) @ v[bi, [j for j, _ in keys], hi // group]
                    lse[bi, hi, i] = logits.max() + np.log(w.sum())
    return o, lse


@settings(max_examples=examples(30))
@given(attention_problems(max_hosts=3, max_shard=4))
def test_oracle_matches_row_loop(p):
    o, lse = attention(p.q, p.k, p.v, return_lse=True, **p.mask_kwargs())
    o_ref, lse_ref = loop_attention(p.q, p.k, p.v, **p.mask_kwargs())
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert max_err(o, o_ref) <= TOL
    assert max_err(lse, lse_ref) <= TOL


@given(attention_problems(max_hosts=8))
def test_blockwise_equals_attention(p):
    seq = p.q.shape[1]
    # any divisor of the shard also divides seq; use the drawn blocks on one device
    o, lse = blockwise_attention(p.q, p.k, p.v, block_q=p.block_q, block_kv=p.block_kv,
                                 return_lse=True, **p.mask_kwargs())
    o_ref, lse_ref = attention(p.q, p.k, p.v, return_lse=True, **p.mask_kwargs())
    assert seq % p.block_q == 0
    assert max_err(o, o_ref) <= TOL
    assert max_err(lse, lse_ref) <= TOL


def _partials(rng, n, b=2, h=3, q=5, d=4, dead=0.3):
    """n normalised partials (o, lse); some rows saw nothing (lse = -inf, o = 0)."""
    out = []
    for _ in range(n):
        lse = rng.normal(size=(b, h, q)) * 3
        lse[rng.random((b, h, q)) < dead] = -np.inf
        o = rng.normal(size=(b, q, h, d)) * np.isfinite(lse).transpose(0, 2, 1)[..., None]
        out.append((o, lse))
    return out


@given(st.integers(0, 2**32 - 1))
def test_merge_associative_commutative_and_safe(seed):
    (o1, l1), (o2, l2), (o3, l3) = _partials(np.random.default_rng(seed), 3)
    o12, l12 = merge(o1, l1, o2, l2)
    o21, l21 = merge(o2, l2, o1, l1)
    assert max_err(o12, o21) <= TOL and max_err(l12, l21) <= TOL
    left = merge(*merge(o1, l1, o2, l2), o3, l3)
    right = merge(o1, l1, *merge(o2, l2, o3, l3))
    assert max_err(left[0], right[0]) <= TOL and max_err(left[1], right[1]) <= TOL
    assert not np.isnan(left[0]).any() and not np.isnan(left[1]).any()
    both_dead = np.isneginf(l1) & np.isneginf(l2)
    assert np.all(np.isneginf(l12[both_dead]))
    assert np.all(o12.transpose(0, 2, 1, 3)[both_dead] == 0)


@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_merge_of_halves_equals_attention(seed, split):
    """Two partials over disjoint key sets merge into the full result (the (o, lse) merge)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, 6, 2, 3)) for _ in range(3))
    full = attention(q, k, v, return_lse=True)
    bias = np.zeros((1, 1, 6, 6))
    first, second = bias.copy(), bias.copy()
    first[..., split:] = -np.inf  # only keys < split
    second[..., :split] = -np.inf
    o, lse = merge(*attention(q, k, v, bias=first, return_lse=True),
                   *attention(q, k, v, bias=second, return_lse=True))
    assert max_err(o, full[0]) <= TOL and max_err(lse, full[1]) <= TOL


def test_online_update_equals_softmax_and_empty_state_finalizes_to_zero():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(1, 2, 3, 8))
    s[0, 0, 1] = -np.inf  # a row that sees nothing
    v = rng.normal(size=(1, 8, 2, 4))
    state = init_state(1, 2, 3, 4)
    for ks in (slice(0, 3), slice(3, 8)):
        state = online_update(*state, s[..., ks], v[:, ks])
    o, lse = finalize(*state)
    p = np.exp(s - s.max(-1, keepdims=True, initial=-1e300))
    want = np.einsum("bhqk,bkhd->bqhd", p / np.maximum(p.sum(-1, keepdims=True), 1e-300), v)
    assert max_err(o, want) <= TOL
    assert np.isneginf(lse[0, 0, 1]) and np.all(o[0, 1, 0] == 0)


def test_fully_masked_rows_give_zero_and_large_logits_stay_finite():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 8, 2, 4)), rng.normal(size=(1, 8, 1, 4)), rng.normal(size=(1, 8, 1, 4))
    bias = np.zeros((1, 1, 8, 8))
    bias[:, :, [2, 5]] = -np.inf
    o, lse = attention(q, k, v, bias=bias, causal=True, return_lse=True)
    assert np.all(o[:, [2, 5]] == 0) and np.all(np.isneginf(lse[:, :, [2, 5]]))
    o_big, lse_big = attention(q * 1e3, k, v, causal=True, return_lse=True)
    assert np.isfinite(o_big).all() and np.isfinite(lse_big).all()
    ob, lb = blockwise_attention(q * 1e3, k, v, block_q=2, block_kv=4, causal=True, return_lse=True)
    assert max_err(ob, o_big) <= TOL and np.abs(lb - lse_big).max() <= TOL * np.abs(lse_big).max()


@given(st.data())
def test_tile_is_empty_is_sound_and_exact_on_intervals(data):
    """Skipping never drops a visible pair; on contiguous position ranges it is exact."""
    draw = data.draw
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))))
    q_lo, k_lo = draw(st.integers(0, 30)), draw(st.integers(0, 30))
    q_pos = np.arange(q_lo, q_lo + draw(st.integers(1, 6)))
    k_pos = np.arange(k_lo, k_lo + draw(st.integers(1, 6)))
    any_visible = allowed(q_pos[:, None], k_pos[None, :], causal=causal, window=window).any()
    assert tile_is_empty(q_pos, k_pos, causal=causal, window=window) == (not any_visible)
    perm = np.random.default_rng(draw(st.integers(0, 99))).permutation(40)
    qs, ks = perm[:5], perm[5:11]  # scattered positions: must stay sound
    if tile_is_empty(qs, ks, causal=causal, window=window):
        assert not allowed(qs[:, None], ks[None, :], causal=causal, window=window).any()


def test_package_name_attention_is_the_function_even_after_submodule_imports():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {root!r})\n"
            "import ringattn_ref.testing, ringattn_ref.ring, ringattn_ref.attention\n"
            "from ringattn_ref import attention, ring_attention\n"
            "assert callable(attention) and attention.__name__ == 'attention', attention\n")
    subprocess.run([sys.executable, "-c", code], check=True)
