"""Grader of lab 1: ``online_update`` and ``merge`` against the float64 oracle.

Parent: builds logits and values (drawn attention problems and fixed ones: large logits, rows that
see nothing, a state that already holds keys, b, h, d > 1), and the oracle over every prefix of
key blocks; the child folds the blocks with the student's ``online_update`` (feeding its own state
back) and calls ``merge`` on parent-made partial results; the parent compares.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ()  # numpy only: no function of the library
FUNCTIONS = {"online_update": "online_update(m, l, o, s, v) -> (m, l, o)",
             "merge": "merge(o1, lse1, o2, lse2) -> (o, lse)"}
EXAMPLES = 25
TOL = 1e-12


def _softmax_oracle(s, v):
    """``(o, lse)`` of logits s [b, h, q, k] (-inf masked) and values v [b, k, h, d], float64, stable."""
    m = s.max(axis=-1, initial=-np.inf)  # (b, h, q)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe[..., None])
    l = p.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
        o = np.einsum("bhqk,bkhd->bqhd", p, v) / np.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
    return o, lse


@dataclass(frozen=True)
class Fold:
    """Logits and values folded in blocks of ``block`` keys, from ``state`` (None: empty) on."""
    name: str
    s: np.ndarray  # (b, h, q, k)
    v: np.ndarray  # (b, k, h, d)
    block: int
    first: int = 0  # keys 0..first-1 are already in the starting state

    def __repr__(self):
        b, h, q, k = self.s.shape
        return (f"{self.name}(b={b}, h={h}, q={q}, keys={k}, d={self.v.shape[-1]}, block_kv={self.block}, "
                f"{f'state over keys 0..{self.first - 1}' if self.first else 'empty state'} at the start, max |logit| = "
                f"{np.abs(self.s[np.isfinite(self.s)]).max(initial=0):.3g})")


def _problem_fold(p):
    from ringattn_ref.attention import repeat_kv
    from ringattn_ref.blockwise import tile_logits
    from ringattn_ref.shards import HopConfig, KVShard, QShard
    from ringattn_ref.validation import check_scale, check_window

    b, s, h, d = p.q.shape
    pos = np.arange(s)[None]
    bias = None if p.bias is None else np.asarray(p.bias, np.float64)  # true order: the whole sequence's block
    cfg = HopConfig(scale=check_scale(p.scale, d), causal=p.causal, window=check_window(p.window, s))
    logits = tile_logits(QShard(p.q, pos, p.segment_ids), KVShard(p.k, p.v, pos, p.segment_ids, bias),
                         cfg)  # (b, h, s, s), -inf where masked
    return Fold(f"drawn {p!r}", logits, repeat_kv(p.v, h), p.block_kv)


def _fixed_folds():
    """Large logits (a max that rises and falls block to block), rows that see nothing at first and
    rows that never see anything, a state that already holds keys, b, h, d > 1."""
    rng = np.random.default_rng(2401)
    b, h, q, k, d = 2, 3, 5, 12, 4
    s = rng.standard_normal((b, h, q, k)) * 3.0
    s[..., 4:8] += 900.0  # the max jumps up by 900 in the second block ...
    s[..., 8:] -= 700.0  # ... and falls far below it in the third
    s[:, :, 0] = -np.inf  # row 0 sees nothing at all
    s[:, :, 1, :8] = -np.inf  # row 1 sees nothing until the third block
    s[1, 2, 2, :4] = 820.0  # one row starts high
    v = rng.standard_normal((b, k, h, d))
    yield Fold("large logits", s, v, 4)
    yield Fold("large logits, state over 3 keys given", s, v, 3, first=3)
    s2 = rng.standard_normal((1, 2, 3, 6)) * 40.0 + 650.0  # every logit large, each block its own max
    yield Fold("all logits near 650", s2, rng.standard_normal((1, 6, 2, 3)), 2)


@dataclass(frozen=True)
class Merge:
    name: str
    parts: tuple  # (o1, lse1, o2, lse2)
    want: tuple  # (o, lse) of the union

    def __repr__(self):
        lse = np.concatenate([self.parts[1].ravel(), self.parts[3].ravel()])
        fin = lse[np.isfinite(lse)]
        return (f"{self.name}(o {self.parts[0].shape}, lse range [{fin.min(initial=0):.3g}, "
                f"{fin.max(initial=0):.3g}], {int(np.isneginf(lse).sum())} -inf entries)")


def _merges(fold):
    """Split a fold's keys into two random disjoint sets: the oracle over each, and over the union."""
    rng = np.random.default_rng(fold.s.size)
    keys = rng.random(fold.s.shape[-1]) < 0.5
    hide = lambda keep: np.where(keep, fold.s, -np.inf)  # noqa: E731
    o1, lse1 = _softmax_oracle(hide(keys), fold.v)
    o2, lse2 = _softmax_oracle(hide(~keys), fold.v)
    want = _softmax_oracle(fold.s, fold.v)
    name = fold.name.split("(")[0]
    yield Merge(f"{name}: two disjoint key sets", (o1, lse1, o2, lse2), want)
    yield Merge(f"{name}: the same, swapped", (o2, lse2, o1, lse1), want)
    yield Merge(f"{name}: both lse + 800", (o1, lse1 + 800.0, o2, lse2 + 800.0), (want[0], want[1] + 800.0))


def build(tasks):
    from ringattn_ref.testing import attention_problems

    drawn = draw(attention_problems(max_hosts=4, max_shard=4, max_dim=4), EXAMPLES)
    folds = list(_fixed_folds()) + [_problem_fold(p) for p in drawn]
    plan = []
    for f in folds:
        b, h, q, k = f.s.shape
        d = f.v.shape[-1]
        if f.first:
            o0, lse0 = _softmax_oracle(f.s[..., :f.first], f.v[:, :f.first])
            m0 = f.s[..., :f.first].max(axis=-1, initial=-np.inf)
            m_safe = np.where(np.isfinite(m0), m0, 0.0)
            l0 = np.where(np.isfinite(lse0), np.exp(lse0 - m_safe), 0.0)
            o_un = o0 * l0.transpose(0, 2, 1)[..., None]  # unnormalised, as online_update keeps it
        else:
            m0, l0, o_un = np.full((b, h, q), -np.inf), np.zeros((b, h, q)), np.zeros((b, q, h, d))
        blocks = [(lo, min(lo + f.block, k)) for lo in range(f.first, k, f.block)]
        plan.append(("fold", f, blocks, tasks.add("fold", dict(s=f.s, v=f.v, m0=m0, l0=l0, o0=o_un),
                                                    blocks=blocks, example=repr(f))))
    merges = [m for f in folds[:3] for m in _merges(f)] + [m for f in folds[3:] for m in list(_merges(f))[:1]]
    for m in merges:
        o1, lse1, o2, lse2 = m.parts
        plan.append(("merge", m, None, tasks.add("merge", dict(o1=o1, lse1=lse1, o2=o2, lse2=lse2), example=repr(m))))

    def verify(results):
        from ringattn_ref.softmax import finalize

        for kind, ex, blocks, task in plan:
            out = results.arrays(task)
            if kind == "fold":
                b, h, q, _ = ex.s.shape
                d = ex.v.shape[-1]
                for j, (_, hi) in enumerate(blocks):
                    if f"m{j}" not in out:
                        raise Fail(f"online_update: no result for key block {j} on example {ex!r}")
                    m = check_array("online_update's m", out[f"m{j}"], (b, h, q), np.float64, ex)
                    l = check_array("online_update's l", out[f"l{j}"], (b, h, q), np.float64, ex)
                    o = check_array("online_update's o", out[f"o{j}"], (b, q, h, d), np.float64, ex)
                    want_o, want_lse = _softmax_oracle(ex.s[..., :hi], ex.v[:, :hi])
                    with np.errstate(all="ignore"):
                        got_o, got_lse = finalize(m, l, o)
                    prop = f"after folding keys up to {hi} the state is the oracle's over those keys"
                    check_close("o / l", got_o, want_o, TOL, prop, ex)
                    check_close("m + log l", got_lse, want_lse, 1e-9, prop, ex)
            else:
                o1, lse1 = ex.parts[:2]
                o = check_array("merge's o", out.get("o"), o1.shape, np.float64, ex)
                lse = check_array("merge's lse", out.get("lse"), lse1.shape, np.float64, ex)
                prop = "merging two partial results gives the oracle over the union (commutative, no overflow)"
                check_close("o", o, ex.want[0], TOL, prop, ex)
                check_close("lse", lse, ex.want[1], 1e-9, prop, ex)
        n_fold = sum(k == "fold" for k, *_ in plan)
        ok("online_update: block by block, the state is the oracle's over the keys so far "
           "(large logits, empty rows, a given state)", n_fold)
        ok("merge: exact over disjoint key sets, commutative, lse + 800, empty rows, no NaN", len(plan) - n_fold)
        return f"online_update and merge match the float64 oracle on {len(plan)} problems"

    return verify


# ---- child side ----------------------------------------------------------------------------------------------

def _fold(sol, a, params):
    from .child import as_arrays

    fn = sol.function("online_update", FUNCTIONS["online_update"])
    m, l, o = a["m0"], a["l0"], a["o0"]
    out = {}
    for j, (lo, hi) in enumerate(params["blocks"]):
        res = sol.call("online_update", fn, m, l, o, a["s"][..., lo:hi], a["v"][:, lo:hi], example=params["example"])
        res = as_arrays("online_update", res, ("m", "l", "o"))
        out.update({f"{k}{j}": x for k, x in res.items()})
        if (res["m"].shape, res["l"].shape, res["o"].shape) != (m.shape, l.shape, o.shape):
            break  # the parent reports the wrong shape
        m, l, o = res["m"], res["l"], res["o"]
    return out


def _merge(sol, a, params):
    from .child import as_arrays

    fn = sol.function("merge", FUNCTIONS["merge"])
    res = sol.call("merge", fn, a["o1"], a["lse1"], a["o2"], a["lse2"], example=params["example"])
    return as_arrays("merge", res, ("o", "lse"))


CHILD = {"fold": _fold, "merge": _merge}
