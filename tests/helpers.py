"""What many test files need: error comparisons against the float64 oracle, random inputs, example counts.

- :func:`rel_err`: ``max |got - want| / max(1, max |want|)`` over the oracle's finite entries, after
  checking that NaN and -inf sit in the same places (a row that sees no key has lse -inf; a row that sees
  a bad key is NaN);
- :func:`max_abs_error`: the same, absolute (``ringattn_ref.testing``'s, re-exported);
- :func:`assert_close`: ``rel_err <= tol`` with a message naming what was compared;
- :func:`random_qkv`: standard-normal q, k, v (and do) of given shapes;
- :func:`examples`: a test's hypothesis example count, scaled by the loaded profile (``ci`` keeps the
  count written in the test; ``thorough`` multiplies it), so ``@settings(max_examples=...)`` never pins a
  long run to the CI count.
"""
import numpy as np
from hypothesis import settings

from ringattn_ref.testing import max_abs_error

__all__ = ["assert_close", "examples", "max_abs_error", "random_qkv", "rel_err"]

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
