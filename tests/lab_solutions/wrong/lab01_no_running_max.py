"""Wrong (lab01): the online softmax without a running max: exp(s) of the raw logits.

Right while the logits are small (every drawn problem); exp(900) overflows to inf.
lab: lab01
expect: property 'after folding keys
"""
import numpy as np


def online_update(m, l, o, s, v):
    p = np.exp(s)  # no max subtracted
    m_new = np.zeros_like(m)  # finalize's lse = 0 + log l: right for small logits
    return m_new, l + p.sum(axis=-1), o + np.einsum("bhqk,bkhd->bqhd", p, v)


def merge(o1, lse1, o2, lse2):
    w1, w2 = np.exp(lse1), np.exp(lse2)  # no shift either
    total = w1 + w2
    with np.errstate(all="ignore"):
        lse = np.log(total)
        c1, c2 = (np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0) for w in (w1, w2))
    return np.transpose(c1, (0, 2, 1))[..., None] * o1 + np.transpose(c2, (0, 2, 1))[..., None] * o2, lse
