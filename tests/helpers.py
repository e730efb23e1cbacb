"""What many test files need: error comparisons against the float64 oracle, random inputs, example counts.

- :func:`rel_err`: ``max |got - want| / max(1, max |want|)`` over the oracle's finite entries, after
  checking that NaN and -inf sit in the same places (a row that sees no key has lse -inf; a row that sees
  a bad key is NaN);
- :func:`max_abs_error`: the same, absolute (``ringattn_ref.testing``'s, re-exported);
- :func:`assert_close`: ``rel_err <= tol`` with a message naming what was compared;
- :func:`random_qkv`: standard-normal q, k, v (and do) of given shapes;
- :func:`examples`: a test's hypothesis example count, scaled by the loaded profile (``ci`` keeps the
  count written in the test; ``thorough`` multiplies it), so ``@settings(max_examples=...)`` never pins a
  long run to the CI count;
- :data:`FUSED_INTERPRETER_OK` and :data:`needs_fused_interpreter`: what cannot run on the oldest supported
  JAX (``ringattn_fast._compat``): the fused ring interpreted on CPU, which raises there instead.
"""
import numpy as np
import pytest
from hypothesis import settings

from ringattn_fast._compat import FUSED_INTERPRETER_JAX, jax_version
from ringattn_ref.testing import max_abs_error

__all__ = ["FUSED_INTERPRETER_OK", "alibi_from_head", "assert_close", "dense_attention", "examples", "max_abs_error",
           "needs_fused_interpreter", "random_qkv", "rel_err"]

FUSED_INTERPRETER_OK = jax_version() >= FUSED_INTERPRETER_JAX
needs_fused_interpreter = pytest.mark.skipif(
    not FUSED_INTERPRETER_OK,
    reason=f"impl='pallas_tpu_fused' interpreted on CPU needs jax >= {'.'.join(map(str, FUSED_INTERPRETER_JAX))} "
           f"(older TPU interpreters can hang on it, so it raises: test_fast_errors checks that error)")

CI_EXAMPLES = 40  # tests/conftest.py's "ci" profile: the counts written in the tests are for it


def rel_err(got, want):
    """max |got - want| / max(1, max |want|) over want's finite entries (float64); NaN / -inf must match."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN patterns differ"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "-inf patterns differ"
    ok = np.isfinite(want)
    return float(np.abs(got[ok] - want[ok]).max(initial=0.0) / max(1.0, np.abs(want[ok]).max(initial=0.0)))


def assert_close(got, want, what="", *, tol):
    """``rel_err(got, want) <= tol``, naming ``what`` when it is not."""
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def random_qkv(b, s, h, hk, d, *, seed=0, dtype=np.float32, do=False):
    """q [b, s, h, d], k, v [b, s, hk, d] (and do like q) drawn from N(0, 1) with ``seed``."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(shape).astype(dtype) for shape in ((b, s, h, d), (b, s, hk, d),
                                                                         (b, s, hk, d), (b, s, h, d)))
    return (q, k, v, g) if do else (q, k, v)


def examples(n):
    """``n`` examples under the ``ci`` profile, proportionally more (or fewer) under another."""
    return max(1, round(n * settings.default.max_examples / CI_EXAMPLES))


def dense_attention(q, k, v, *, causal=False, segment_ids=None, kv_segment_ids=None, logit_softcap=None,
                    sinks=None, mask_fn=None, score_fn=None, scale=None, window=None, bias=None):
    """The oracle's attention written densely in ``jax.numpy`` (differentiable: gradients by autodiff).

    q [b, t, h, d], k [b, s, hk, d], v [b, s, hk, dv]; the oracle's positions (keys ``0..s-1``, queries the
    last t); softcap, score_fn, bias, mask (causal, window, segments, mask_fn), sinks as ``ringattn_ref.attention``.
    A row that sees no key gives 0 (its probabilities are set to 0, not NaN)."""
    import jax
    import jax.numpy as jnp

    b, t, h, d = q.shape
    s = k.shape[1]
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * (d ** -0.5 if scale is None else scale)
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    q_pos = (jnp.arange(t) + s - t)[None, None, :, None]
    k_pos = jnp.arange(s)[None, None, None, :]
    head = jnp.arange(h)[None, :, None, None]
    if score_fn is not None:
        logits = score_fn(logits, q_pos, k_pos, head)
    if bias is not None:
        logits = logits + jnp.asarray(bias)
    ok = jnp.ones((1, 1, t, s), bool)
    if causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None and window[0] >= 0:
        ok = ok & (q_pos - k_pos <= window[0])
    if window is not None and window[1] >= 0:
        ok = ok & (k_pos - q_pos <= window[1])
    zeros_q, zeros_k = jnp.zeros((1, 1, t, 1), jnp.int32), jnp.zeros((1, 1, 1, s), jnp.int32)
    q_seg, k_seg = zeros_q, zeros_k
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        q_seg, k_seg = jnp.asarray(segment_ids)[:, None, :, None], jnp.asarray(kv_ids)[:, None, None, :]
        ok = ok & (q_seg == k_seg)
    if mask_fn is not None:
        ok = ok & mask_fn(q_pos, k_pos, q_seg, k_seg, head)
    logits = jnp.where(ok, logits, -jnp.inf)
    if sinks is not None:
        logits = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], axis=-1)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    p = e / jnp.maximum(e.sum(-1, keepdims=True), jnp.finfo(e.dtype).tiny)
    return jnp.einsum("bhqk,bkhd->bqhd", p[..., :s], vv)


def alibi_from_head(heads):
    """ALiBi with each head's slope computed from ``head``, ``2 ** (-8 (head + 1) / heads)``: what a compiled
    kernel lowers (``variants.alibi`` reads it from a table, ``slopes[head]``: a gather)."""
    import jax.numpy as jnp

    def score_fn(s, q_pos, k_pos, head):
        slope = jnp.exp2(-8.0 * (head + 1).astype(s.dtype) / heads)
        return s - slope * jnp.abs(q_pos - k_pos).astype(s.dtype)
    return score_fn
