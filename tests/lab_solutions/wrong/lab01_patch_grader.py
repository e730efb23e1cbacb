"""Wrong (lab01): replaces the grader's comparison (and verdict) functions in its own process, then
returns a wrong merge. The comparison runs in the parent, so the patch changes nothing there; the
source check refuses the file before it runs.

lab: lab01
expect: uses _grader
"""
import numpy as np

import _grader.common as common

common.check_close = lambda *args, **kwargs: None
common.check_array = lambda name, got, *args, **kwargs: np.asarray(got)


def online_update(m, l, o, s, v):
    m_new = np.maximum(m, s.max(axis=-1))
    m_safe = np.where(np.isfinite(m_new), m_new, 0.0)
    alpha = np.exp(m - m_safe)
    p = np.exp(s - m_safe[..., None])
    return m_new, alpha * l + p.sum(-1), np.transpose(alpha, (0, 2, 1))[..., None] * o + np.einsum(
        "bhqk,bkhd->bqhd", p, v)


def merge(o1, lse1, o2, lse2):
    return o1, np.maximum(lse1, lse2)  # wrong
