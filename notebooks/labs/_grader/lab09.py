"""Grader of lab 9: a packed prefix-LM document mask as a ``mask_fn``, and the block mask of a ring.

Parent: the problems (fixed: a document shorter than the prefix, prefix 0, one document, a prefix longer
than every document, on 2 to 4 hosts, contiguous, striped and zigzag; plus hypothesis draws of lengths
and prefixes), the truth of every mask by its definition (a loop over pairs, not a vectorised rewrite of
the reference), the float64 oracle over that truth, and the library's block mask
(``ringattn_ref.ring_block_mask``) of it. Child: evaluates the student's mask on the whole grid, runs the
library's ring with it (the ring calls it per tile and skips the hops its block mask calls empty), and
calls the student's ``block_mask`` on the student's mask and on masks of the grader's own (below), some
attending only inside a tile, never at its corners. The parent compares everything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_ref.layouts.layout_permutation",)
FUNCTIONS = {"prefix_lm_documents": "prefix_lm_documents(lengths, prefix) -> mask_fn",
             "block_mask": "block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv) -> (kinds, hops)"}
EXAMPLES = 6
TOL = 1e-12


def truth(lengths, prefix):
    """bool [T, T]: the lab's mask by its definition, pair by pair."""
    doc, first = [], []
    for i, n in enumerate(lengths):
        doc += [i] * n
        first += [sum(lengths[:i])] * n
    t = len(doc)
    out = np.zeros((t, t), bool)
    for q in range(t):
        for k in range(t):
            out[q, k] = doc[q] == doc[k] and (k <= q or k - first[k] < prefix)
    return out


# The grader's own masks for part 2, by name (defined here, so the child builds them without the library).
def _band(q_pos, k_pos, q_seg, k_seg, head):
    """|q - k| == 3 only: inside a 4 x 4 tile off the diagonal, never at a corner."""
    d = q_pos - k_pos
    return (d == 3) | (d == -3)


def _chunked(q_pos, k_pos, q_seg, k_seg, head):
    """Causal inside chunks of 6 (which cut tiles of 4 in the middle)."""
    return (q_pos // 6 == k_pos // 6) & (k_pos <= q_pos)


def _sinks(q_pos, k_pos, q_seg, k_seg, head):
    """Causal; the first 2 positions and the 3 before each query."""
    return (k_pos <= q_pos) & ((k_pos < 2) | (q_pos - k_pos <= 3))


GRADER_MASKS = {"band |q - k| = 3": _band, "causal chunks of 6": _chunked, "2 sinks + window 3": _sinks}


@dataclass(frozen=True)
class Problem:
    name: str
    lengths: tuple
    prefix: int
    n_hosts: int
    layout: str
    block: int

    @property
    def seq(self):
        return sum(self.lengths)

    def __repr__(self):
        return (f"{self.name}(lengths={list(self.lengths)}, prefix={self.prefix}, n_hosts={self.n_hosts}, "
                f"layout={self.layout}, block_q=block_kv={self.block})")


def fixed_problems():
    yield Problem("a document shorter than the prefix", (10, 3, 11), 4, 4, "contiguous", 2)
    yield Problem("prefix 0: causal documents", (5, 9, 10), 0, 3, "zigzag", 2)
    yield Problem("one document: a plain prefix-LM", (24,), 7, 2, "striped", 4)
    yield Problem("a prefix longer than every document", (6, 6, 4, 8), 9, 4, "zigzag", 3)
    yield Problem("documents across host boundaries", (3, 7, 2, 12), 2, 2, "contiguous", 3)


def _drawn():
    from hypothesis import strategies as st

    @st.composite
    def problems(draw_):
        n_hosts = draw_(st.sampled_from([2, 3, 4]))
        layout = draw_(st.sampled_from(["contiguous", "striped", "zigzag"]))
        seq = 2 * n_hosts * draw_(st.integers(1, 4))
        cuts = sorted(draw_(st.sets(st.integers(1, seq - 1), max_size=4)))
        lengths = tuple(b - a for a, b in zip([0] + cuts, cuts + [seq]))
        block = draw_(st.sampled_from([b for b in (1, 2, 4) if (seq // n_hosts) % b == 0]))
        return Problem("drawn", lengths, draw_(st.integers(0, 6)), n_hosts, layout, block)

    return draw(problems(), EXAMPLES)


def build(tasks):
    from ringattn_ref.attention import attention
    from ringattn_ref.block_mask import ring_block_mask

    problems = list(fixed_problems()) + _drawn()
    plan = []
    for p in problems:
        rng = np.random.default_rng(p.seq * 31 + p.prefix)
        q, k, v = (rng.standard_normal((2, p.seq, 2, 3)) for _ in range(3))
        mask = truth(list(p.lengths), p.prefix)
        want = attention(q, k, v, bias=np.where(mask, 0.0, -np.inf)[None, None])
        table = mask.astype(np.int64)  # the truth as a table the parent's own mask function reads
        fn = (lambda tbl: lambda qp, kp, qs, ks, h: tbl[qp, kp] == 1)(table)
        blocks = ring_block_mask(fn, p.seq, p.n_hosts, layout=p.layout, block_q=p.block, block_kv=p.block)
        plan.append((p, mask, want, blocks, tasks.add(
            "mask", dict(q=q, k=k, v=v), lengths=list(p.lengths), prefix=p.prefix, n_hosts=p.n_hosts,
            layout=p.layout, block=p.block, example=repr(p))))
    own = []
    for name, fn in GRADER_MASKS.items():
        for seq, n_hosts, layout, block in ((16, 2, "contiguous", 4), (32, 4, "zigzag", 4), (24, 3, "striped", 2)):
            blocks = ring_block_mask(fn, seq, n_hosts, layout=layout, block_q=block, block_kv=block)
            ex = f"grader mask '{name}'(seq {seq}, n_hosts={n_hosts}, layout={layout}, block {block})"
            own.append((ex, blocks, tasks.add("kinds", {}, mask=name, seq=seq, n_hosts=n_hosts, layout=layout,
                                             block=block, example=ex)))

    def verify(results):
        for p, mask, want, blocks, task in plan:
            out = results.arrays(task)
            got = check_array("your mask on the whole grid", out.get("grid"), mask.shape, np.bool_, p)
            if not np.array_equal(got, mask):
                qi, ki = np.argwhere(got != mask)[0]
                raise Fail(f"property 'the mask is the packed prefix-LM documents' mask' failed on example {p!r}: "
                           f"query {qi}, key {ki} is {bool(got[qi, ki])}, should be {bool(mask[qi, ki])}")
            o = check_array("the ring's output with your mask", out.get("o"), want.shape, np.float64, p)
            check_close("o", o, want, TOL, "the library's ring with your mask_fn (called per tile) gives the "
                        "oracle's output", p)
            skipped = out.get("hop_skipped")
            if skipped is None or not np.array_equal(skipped, ~blocks.hops):
                raise Fail(f"property 'the ring skips exactly the hops the mask leaves empty' failed on example "
                           f"{p!r}: it skipped {None if skipped is None else int(skipped.sum())} hops, the mask "
                           f"leaves {int((~blocks.hops).sum())} empty")
            _check_kinds(out, blocks, p)
        ok("prefix_lm_documents: the definition on the whole grid; the ring with it gives the oracle's output and "
           "skips the empty hops", len(plan))
        for ex, blocks, task in own:
            _check_kinds(results.arrays(task), blocks, ex)
        ok("block_mask: tile kinds and hops equal the library's block mask (your mask and the grader's)",
           len(plan) + len(own))
        empty = sum(int((~b.hops).sum()) for _, _, _, b, _ in plan)
        return (f"the mask is the oracle's on {len(plan)} problems, the ring skips the {empty} empty hops, "
                f"block_mask counts every tile as the library does")

    return verify


def _check_kinds(out, blocks, example):
    kinds = check_array("block_mask's kinds", out.get("kinds"), blocks.tiles.shape, np.int8, example)
    hops = check_array("block_mask's hops", out.get("hops"), blocks.hops.shape, np.bool_, example)
    if not np.array_equal(kinds, blocks.tiles):
        bad = np.argwhere(kinds != blocks.tiles)[0]
        counts = lambda t: [int((t == x).sum()) for x in (0, 1, 2)]  # noqa: E731
        raise Fail(f"property 'block_mask's tile kinds are the library's block mask (0 empty, 1 full, 2 partial)' "
                   f"failed on example {example!r}: tile (host, shard, q tile, k tile) = {tuple(int(x) for x in bad)} "
                   f"is {int(kinds[tuple(bad)])}, should be {int(blocks.tiles[tuple(bad)])}; counts empty/full/partial "
                   f"{counts(kinds)} vs {counts(blocks.tiles)}")
    if not np.array_equal(hops, blocks.hops):
        i, t = np.argwhere(hops != blocks.hops)[0]
        raise Fail(f"property 'block_mask's hops are True exactly where the hop holds a visible pair' failed on "
                   f"example {example!r}: host {i} at step {t} is {bool(hops[i, t])}, should be {bool(blocks.hops[i, t])}")


# ---- child side ----------------------------------------------------------------------------------------------

def _kinds_of(sol, mask_fn, params):
    from .child import as_arrays

    fn = sol.function("block_mask", FUNCTIONS["block_mask"])
    res = sol.call("block_mask", fn, mask_fn, params["seq"], params["n_hosts"], layout=params["layout"],
                   block_q=params["block"], block_kv=params["block"], example=params["example"])
    return as_arrays("block_mask", res, ("kinds", "hops"))


def _mask(sol, a, params):
    from ringattn_ref.ring import ring_attention

    make = sol.function("prefix_lm_documents", FUNCTIONS["prefix_lm_documents"])
    example = params["example"]
    mask_fn = sol.call("prefix_lm_documents", make, list(params["lengths"]), params["prefix"], example=example)
    if not callable(mask_fn):
        raise Fail(f"prefix_lm_documents returned {type(mask_fn).__name__}, not a function, on example {example}")
    t = sum(params["lengths"])
    pos, zero = np.arange(t), np.zeros((1, 1, 1, 1), np.int64)
    grid = sol.call("the mask function", mask_fn, pos[None, None, :, None], pos[None, None, None, :], zero, zero, zero,
                    example=example)
    out = {"grid": np.broadcast_to(np.asarray(grid), (1, 1, t, t))[0, 0].copy() if np.ndim(grid) == 4 else
           np.asarray(grid)}
    try:
        o, trace = ring_attention(a["q"], a["k"], a["v"], n_hosts=params["n_hosts"], layout=params["layout"],
                                  block_q=params["block"], block_kv=params["block"], mask_fn=mask_fn,
                                  return_trace=True)
    except Exception as e:  # noqa: BLE001 - the ring calling the student's function per tile
        sol.check_guard()
        raise Fail(f"the ring with your mask_fn raised {type(e).__name__}: {str(e)[:300]} on example {example}") from None
    sol.check_guard()
    out.update(o=np.asarray(o), hop_skipped=np.asarray(trace.hop_skipped))
    out.update(_kinds_of(sol, mask_fn, dict(params, seq=t)))
    return out


def _kinds(sol, a, params):
    return _kinds_of(sol, GRADER_MASKS[params["mask"]], params)


CHILD = {"mask": _mask, "kinds": _kinds}
