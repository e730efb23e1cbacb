"""Grader of lab 1: ``online_update`` and ``merge`` against the float64 oracle."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from ringattn_ref.attention import attention, repeat_kv
from ringattn_ref.blockwise import tile_logits
from ringattn_ref.softmax import finalize, init_state
from ringattn_ref.testing import attention_problems
from ringattn_ref.validation import check_scale

from .common import Fail, check_array, check_close, for_all, forbid, ok

EXAMPLES = 25
TOL = 1e-12


@dataclass(frozen=True)
class Case:
    """A drawn problem and a random split of its keys into two disjoint parts."""
    problem: object
    in_first: np.ndarray  # bool [seq]: the keys of part 1; part 2 has the rest

    def __repr__(self):
        return f"{self.problem!r} with keys {np.flatnonzero(self.in_first).tolist()} in part 1"


@st.composite
def cases(draw):
    problem = draw(attention_problems(max_hosts=4, max_shard=4, max_dim=4))
    seq = problem.q.shape[1]
    return Case(problem, np.array(draw(st.lists(st.booleans(), min_size=seq, max_size=seq))))


def _oracle(problem, keys=None):
    """The oracle's (o, lse) over all keys, or only over the keys where ``keys`` (bool [seq]) is True."""
    kw = problem.mask_kwargs()
    if keys is not None:
        hide = np.where(keys, 0.0, -np.inf)[None, None, None, :]  # (1, 1, 1, s): -inf hides a key
        kw["bias"] = hide if kw["bias"] is None else kw["bias"] + hide
    return attention(problem.q, problem.k, problem.v, return_lse=True, **kw)


def _check_update(sol, fn, case):
    p = case.problem
    b, s, h, d = p.q.shape
    pos = np.arange(s)[None]
    seg = p.segment_ids
    logits = tile_logits(p.q, p.k, pos, pos, seg, seg, p.bias, scale=check_scale(p.scale, d), causal=p.causal,
                         window=p.window)  # (b, h, s, s), -inf where masked
    v = repeat_kv(p.v, h)
    m, l, o = init_state(b, h, s, d)
    for j in range(s // p.block_kv):
        cols = slice(j * p.block_kv, (j + 1) * p.block_kv)
        out = sol.call("online_update", fn, m, l, o, logits[..., cols], v[:, cols], example=case)
        if not isinstance(out, tuple) or len(out) != 3:
            raise Fail(f"online_update returned {type(out).__name__}; expected a tuple (m, l, o)")
        m = check_array("online_update's m", out[0], (b, h, s), np.float64, case)
        l = check_array("online_update's l", out[1], (b, h, s), np.float64, case)
        o = check_array("online_update's o", out[2], (b, s, h, d), np.float64, case)
        seen = np.zeros(s, bool)
        seen[: (j + 1) * p.block_kv] = True
        want_o, want_lse = _oracle(p, seen)
        with np.errstate(all="ignore"):
            got_o, got_lse = finalize(m, l, o)
        prop = f"after folding key blocks 0..{j} (block_kv={p.block_kv}) the state is the oracle's over those keys"
        check_close("o / l", got_o, want_o, TOL, prop, case)
        check_close("m + log l", got_lse, want_lse, TOL, prop, case)


def _merge(sol, fn, o1, lse1, o2, lse2, case):
    out = sol.call("merge", fn, o1, lse1, o2, lse2, example=case)
    if not isinstance(out, tuple) or len(out) != 2:
        raise Fail(f"merge returned {type(out).__name__}; expected a tuple (o, lse)")
    return (check_array("merge's o", out[0], o1.shape, np.float64, case),
            check_array("merge's lse", out[1], lse1.shape, np.float64, case))


def _check_merge(sol, fn, case):
    p = case.problem
    o1, lse1 = _oracle(p, case.in_first)
    o2, lse2 = _oracle(p, ~case.in_first)
    want_o, want_lse = _oracle(p)
    o, lse = _merge(sol, fn, o1, lse1, o2, lse2, case)
    prop = "merging the oracle over two disjoint key sets gives the oracle over their union"
    check_close("o", o, want_o, TOL, prop, case)
    check_close("lse", lse, want_lse, TOL, prop, case)
    o_sw, lse_sw = _merge(sol, fn, o2, lse2, o1, lse1, case)
    check_close("merge(part 2, part 1)'s o", o_sw, o, TOL, "merge is commutative", case)
    shifted = _merge(sol, fn, o1, lse1 + 800.0, o2, lse2 + 800.0, case)
    prop = "adding 800 to both lse adds 800 to lse and leaves o unchanged (no overflow)"
    check_close("o", shifted[0], o, TOL, prop, case)
    check_close("lse - 800", shifted[1] - 800.0, lse, 1e-9, prop, case)


def check(sol):
    forbid(sol, "ringattn_ref.softmax", "ringattn_fast.softmax")
    update = sol.function("online_update", "online_update(m, l, o, s, v) -> (m, l, o)")
    merge = sol.function("merge", "merge(o1, lse1, o2, lse2) -> (o, lse)")
    for_all(cases(), lambda case: _check_update(sol, update, case), examples=EXAMPLES)
    ok("online_update: block by block, the state is the oracle's over the keys so far", EXAMPLES)
    for_all(cases(), lambda case: _check_merge(sol, merge, case), examples=EXAMPLES)
    ok("merge: exact over disjoint key sets, commutative, no overflow, no NaN", EXAMPLES)
    return f"online_update and merge match the float64 oracle on {2 * EXAMPLES} drawn problems"
