"""Grader of lab 2: ``ring_step`` driven over a whole ring, checked after every step.

Parent: the problems (fixed: 3, 5 and 8 hosts, GQA, b and d > 1, striped/zigzag/contiguous, causal
hops that are empty and hops whose host is not the shard's, rows that see nothing, segment ids, a
window; plus hypothesis draws) and, per host and step, the oracle over the shards seen so far. Child:
builds the hosts with ``ringattn_ref.ring.setup_ring``, calls the student's ``ring_step`` for every
step and records, after each, the flags, which message object each host holds, its receive buffer and
its ``(m, l, o)``. The parent checks all of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_ref.blockwise.attend_kv_shard", "ringattn_ref.blockwise.bias_tile", "ringattn_ref.masks",
           "ringattn_ref.shards", "ringattn_ref.ring.Host", "ringattn_ref.ring.Message", "ringattn_ref.ring.RingProblem",
           "ringattn_ref.ring.RingTrace")
FUNCTIONS = {"ring_step": "ring_step(hosts, step, problem) -> list of bools"}
EXAMPLES = 16
TOL = 1e-12


@dataclass(frozen=True)
class Fixed:
    """A fixed problem, with the ``AttentionProblem`` fields the ring needs."""
    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    n_hosts: int
    causal: bool
    segment_ids: object
    bias: object
    window: object
    scale: object
    layout: object
    block_q: int
    block_kv: int

    def mask_kwargs(self):
        return dict(causal=self.causal, segment_ids=self.segment_ids, bias=self.bias, window=self.window,
                    scale=self.scale)

    def __repr__(self):
        return (f"{self.name}(q{self.q.shape}, k{self.k.shape}, n_hosts={self.n_hosts}, causal={self.causal}, "
                f"layout={self.layout}, window={self.window}, segment_ids={self.segment_ids is not None}, "
                f"bias={None if self.bias is None else self.bias.shape}, block_q={self.block_q}, "
                f"block_kv={self.block_kv})")


def fixed_problems():
    rng = np.random.default_rng(2402)

    def qkv(b, s, h, hk, d):
        return rng.standard_normal((b, s, h, d)), rng.standard_normal((b, s, hk, d)), rng.standard_normal((b, s, hk, d))

    bias = np.zeros((1, 1, 15, 1))
    bias[:, :, [2, 9]] = -np.inf  # rows 2 and 9 see nothing
    yield Fixed("causal contiguous, empty hops", *qkv(2, 15, 4, 2, 3), 5, True, None, bias, None, None, "contiguous",
                3, 1)
    yield Fixed("causal striped, 8 hosts", *qkv(1, 16, 3, 1, 2), 8, True, None, None, None, 0.7, "striped", 1, 2)
    seg = np.sort(rng.integers(0, 3, size=(2, 12)), axis=1)
    yield Fixed("zigzag, window and documents", *qkv(2, 12, 2, 2, 4), 3, True, seg, None, (3, 0), None, "zigzag", 2, 4)


def build(tasks):
    from ringattn_ref.testing import attention_problems

    problems = list(fixed_problems()) + draw(attention_problems(max_hosts=6, max_shard=4, max_dim=4), EXAMPLES)
    plan = []
    for p in problems:
        arrays = dict(q=p.q, k=p.k, v=p.v)
        for name in ("segment_ids", "bias"):
            if getattr(p, name) is not None:
                arrays[name] = getattr(p, name)
        layout = p.layout
        if not isinstance(layout, str):
            arrays["layout"], layout = np.asarray(layout), None
        plan.append((p, tasks.add("ring", arrays, n_hosts=p.n_hosts, causal=p.causal, scale=p.scale, layout=layout,
                                  window=None if p.window is None else list(p.window), block_q=p.block_q,
                                  block_kv=p.block_kv, example=repr(p))))

    def verify(results):
        for p, task in plan:
            _check_ring(p, results.arrays(task))
        ok("ring_step: who holds what, skipped hops, the state after every step (3 to 8 hosts, every layout)",
           len(plan))
        return f"ring_step runs the ring exactly (float64 oracle) on {len(plan)} problems, every layout"

    return verify


def _oracle_seen(p, perm, c, seen_blocks):
    """The oracle's (o, lse) over the keys of the layout shards ``seen_blocks``, all rows (true order)."""
    from ringattn_ref.attention import attention

    keys = np.zeros(p.q.shape[1], bool)
    for blk in seen_blocks:
        keys[perm[blk * c:(blk + 1) * c]] = True
    kw = p.mask_kwargs()
    hide = np.where(keys, 0.0, -np.inf)[None, None, None, :]
    kw["bias"] = hide if kw["bias"] is None else kw["bias"] + hide
    return attention(p.q, p.k, p.v, return_lse=True, **kw)


def _check_ring(p, out):
    from ringattn_ref.masks import tile_is_empty
    from ringattn_ref.ring import setup_ring
    from ringattn_ref.softmax import finalize

    problem, hosts = setup_ring(p.q, p.k, p.v, n_hosts=p.n_hosts, causal=p.causal, segment_ids=p.segment_ids,
                                bias=p.bias, window=p.window, scale=p.scale, layout=p.layout, block_q=p.block_q,
                                block_kv=p.block_kv)
    n, c = problem.n_hosts, problem.shard
    b, _, h, d = hosts[0].qs.q.shape
    steps = int(out.get("steps", np.zeros(())).item()) if "steps" in out else 0
    if steps < n:
        raise Fail(f"ring_step: the child recorded {steps} of {n} steps on example {p!r}")
    flags = check_array("the flags ring_step returned", out["flags"], (n, n), bool, p)
    held, recv_empty = out["held"], out["recv_empty"]
    for step in range(n):
        after = step + 1 if step < n - 1 else step  # what each host holds once the step is over
        for host in hosts:
            i = host.my_idx
            want = (i - after) % n
            prop = (f"after step {step} of {n} host {i} holds shard {want} (sent one host on, "
                    f"{'no send after the last step' if step == n - 1 else 'buffers swapped'}) and its "
                    f"receive buffer is empty")
            if int(held[step, i]) != want or not bool(recv_empty[step, i]):
                got = int(held[step, i])
                what = ("a copy of it (send the message object itself)" if got == -2 - want else
                        "no message of the ring" if got < 0 else f"shard {got}")
                recv = "empty" if recv_empty[step, i] else "not empty"
                raise Fail(f"property '{prop}' failed on example {p!r}: it holds {what}, receive buffer {recv}")
            kv = hosts[(i - step) % n].held.kv  # shard (i - step) % n, as setup_ring made it (shard r on host r)
            empty = bool(tile_is_empty(host.qs.pos, kv.pos, host.qs.seg, kv.seg, causal=problem.hop.causal,
                                       window=problem.hop.window))
            if bool(flags[step, i]) == empty:
                raise Fail(f"property 'a hop is computed exactly when its mask is not provably empty' failed on "
                           f"example {p!r}: host {i} at step {step} (shard {(i - step) % n}) returned "
                           f"{bool(flags[step, i])} but the hop is {'empty' if empty else 'not empty'}")
            state = []
            for name, shape in (("m", (b, h, c)), ("l", (b, h, c)), ("o", (b, c, h, d))):
                state.append(check_array(f"host {i}'s {name} after step {step}", out.get(f"{name}_{step}_{i}"), shape,
                                         np.float64, p))
            want_o, want_lse = _oracle_seen(p, problem.perm, c, [(i - t) % n for t in range(step + 1)])
            rows = host.qs.pos[0]
            with np.errstate(all="ignore"):
                got_o, got_lse = finalize(*state)
            prop = f"after step {step} host {i}'s state is the oracle's over the shards it has seen"
            check_close("o", got_o, want_o[:, rows], TOL, prop, p)
            check_close("lse", got_lse, want_lse[:, :, rows], TOL, prop, p)


# ---- child side ----------------------------------------------------------------------------------------------

def _ring(sol, a, params):
    from ringattn_ref.ring import setup_ring

    fn = sol.function("ring_step", FUNCTIONS["ring_step"])
    window = None if params["window"] is None else tuple(params["window"])
    layout = params["layout"] if params["layout"] is not None else a["layout"]
    problem, hosts = setup_ring(a["q"], a["k"], a["v"], n_hosts=params["n_hosts"], causal=params["causal"],
                                segment_ids=a.get("segment_ids"), bias=a.get("bias"), window=window,
                                scale=params["scale"], layout=layout, block_q=params["block_q"],
                                block_kv=params["block_kv"])
    n, c = problem.n_hosts, problem.shard
    b, _, h, d = hosts[0].qs.q.shape
    blocks = [host.held for host in hosts]  # message r (shard r) starts on host r
    for host in hosts:
        host.m, host.l = np.full((b, h, c), -np.inf), np.zeros((b, h, c))
        host.o = np.zeros((b, c, h, d))
    out = dict(flags=np.zeros((n, n), bool), held=np.full((n, n), -1), recv_empty=np.zeros((n, n), bool))
    example = params["example"]
    for step in range(n):
        flags = sol.call("ring_step", fn, hosts, step, problem, example=example)
        if not isinstance(flags, (list, tuple, np.ndarray)) or len(flags) != n:
            raise Fail(f"ring_step returned {type(flags).__name__} {flags!r:.80}; expected a list of {n} bools "
                       f"(one per host) at step {step} on example {example}")
        if not all(isinstance(f, (bool, np.bool_)) for f in flags):
            raise Fail(f"ring_step returned {list(flags)!r:.80}; expected bools (True: the host computed its hop) "
                       f"at step {step} on example {example}")
        out["flags"][step] = [bool(f) for f in flags]
        for i, host in enumerate(hosts):
            idx = next((j for j, blk in enumerate(blocks) if host.held is blk), None)
            if idx is None:  # not one of the ring's messages: a copy of shard kv_idx, or something else
                kv = getattr(host.held, "kv_idx", None)
                idx = -2 - int(kv) if isinstance(kv, (int, np.integer)) and 0 <= kv < n else -1
            out["held"][step, i] = idx
            out["recv_empty"][step, i] = host.recv is None
            for name in ("m", "l", "o"):
                x = getattr(host, name, None)
                if hasattr(x, "shape") and hasattr(x, "dtype") and np.asarray(x).dtype != object:
                    out[f"{name}_{step}_{i}"] = np.array(x)  # a copy: the state is updated in place
    out["steps"] = np.array(n)
    return out


CHILD = {"ring": _ring}
