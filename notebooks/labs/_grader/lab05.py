"""Grader of lab 5: the Pallas hop kernel in the TPU interpreter, race detector on, vs the hop oracle."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from ringattn_fast.kernels.races import races_found  # the one home of the private race flag
from ringattn_ref.blockwise import hop_attention
from ringattn_ref.layouts import layout_permutation
from ringattn_ref.testing import attention_problems
from ringattn_ref.validation import check_scale

from .common import Fail, check_array, check_close, for_all, forbid, ok

EXAMPLES = 4
TOL = 2e-5  # float32 kernel vs float64 oracle, d <= 8


@dataclass(frozen=True)
class Hop:
    """Host ``host``'s queries against K/V shard ``block`` of a drawn problem."""
    problem: object
    host: int
    block: int

    def __repr__(self):
        return f"{self.problem!r}, host {self.host}'s queries against K/V shard {self.block}"


@st.composite
def hops(draw):
    p = draw(attention_problems(max_hosts=4, max_shard=8, max_dim=8, segment_ids=False, bias=False, window=False,
                                masked_rows=False, dtype=np.float32))
    return Hop(p, draw(st.integers(0, p.n_hosts - 1)), draw(st.integers(0, p.n_hosts - 1)))


def _check(sol, fn, hop):
    p = hop.problem
    b, s, h, d = p.q.shape
    c = s // p.n_hosts
    perm = layout_permutation(p.layout, s, p.n_hosts)
    rows, cols = perm[hop.host * c:(hop.host + 1) * c], perm[hop.block * c:(hop.block + 1) * c]  # true positions
    q, k, v = p.q[:, rows], p.k[:, cols], p.v[:, cols]
    scale = check_scale(p.scale, d)
    params = pltpu.InterpretParams(detect_races=True, on_race="warn")
    out = sol.call("hop_fwd (and your hop_kernel in it)", lambda: jax.block_until_ready(fn(
        q, k, v, rows.astype(np.int32), cols.astype(np.int32), scale=scale, causal=p.causal, block_q=p.block_q,
        block_kv=p.block_kv, interpret=params)), example=hop)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Fail(f"hop_fwd returned {type(out).__name__}; expected (o, lse)")
    o = check_array("hop_fwd's o", out[0], (b, c, h, d), np.float32, hop)
    lse = check_array("hop_fwd's lse", out[1], (b, h, c), np.float32, hop)
    if races_found():
        raise Fail(f"property 'the race detector reports nothing' failed on example {hop!r}: the TPU interpreter "
                   f"found a race (a buffer read or written while a DMA into or out of it was still in flight?)")
    want_o, want_lse = hop_attention(q, k, v, rows, cols, scale=scale, causal=p.causal)
    empty = np.isneginf(want_lse)  # (b, h, c): rows that see no key of this shard
    if np.isnan(o).any() or np.isnan(lse).any():
        raise Fail(f"property 'no NaN' failed on example {hop!r}: o has {int(np.isnan(o).sum())} NaN, lse "
                   f"{int(np.isnan(lse).sum())}")
    seen_nothing = np.transpose(empty, (0, 2, 1))  # (b, c, h)
    if empty.any() and (np.abs(o[seen_nothing]).max() != 0 or not np.isneginf(lse[empty]).all()):
        raise Fail(f"property 'a row that sees nothing gives o = 0, lse = -inf' failed on example {hop!r}: "
                   f"{int(empty.sum())} such rows")
    check_close("o", o, want_o, TOL, "o matches the float64 hop oracle", hop)
    check_close("lse", lse, want_lse, TOL, "lse matches the float64 hop oracle", hop)


def check(sol):
    forbid(sol, "ringattn_fast.kernels.pallas_tpu", "ringattn_fast.kernels.pallas_gpu", "ringattn_fast.hop")
    sol.function("hop_kernel", "hop_kernel(q_ref, ..., acc_ref, *, scale, causal) (inside hop_fwd)")
    fn = sol.function("hop_fwd", "hop_fwd(q, k, v, q_pos, k_pos, *, scale, causal, block_q, block_kv, interpret)")
    for causal, examples in ((True, EXAMPLES - 2), (False, 2)):
        strategy = hops().filter(lambda hop: hop.problem.causal == causal)
        for_all(strategy, lambda hop: _check(sol, fn, hop), examples=examples, shrink=False)
    ok("o, lse match the float64 oracle; empty rows 0 / -inf; no NaN; no race", EXAMPLES)
    return f"the hop kernel matches ringattn_ref.hop_attention on {EXAMPLES} drawn hops in the TPU interpreter"
