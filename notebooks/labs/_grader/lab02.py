"""Grader of lab 2: ``ring_step`` driven over a whole ring, checked after every step."""
from __future__ import annotations

import numpy as np

from ringattn_ref.attention import attention
from ringattn_ref.masks import tile_is_empty
from ringattn_ref.ring import setup_ring
from ringattn_ref.softmax import finalize, init_state
from ringattn_ref.testing import attention_problems

from .common import Fail, check_array, check_close, for_all, forbid, ok

EXAMPLES = 20
TOL = 1e-12


def _setup(p):
    return setup_ring(p.q, p.k, p.v, n_hosts=p.n_hosts, causal=p.causal, segment_ids=p.segment_ids, bias=p.bias,
                      window=p.window, scale=p.scale, layout=p.layout, block_q=p.block_q, block_kv=p.block_kv)


def _oracle_seen(p, perm, c, seen_blocks):
    """The oracle's (o, lse) over the keys of the layout blocks ``seen_blocks``, all rows (true order)."""
    keys = np.zeros(p.q.shape[1], bool)
    for blk in seen_blocks:
        keys[perm[blk * c:(blk + 1) * c]] = True
    kw = p.mask_kwargs()
    hide = np.where(keys, 0.0, -np.inf)[None, None, None, :]
    kw["bias"] = hide if kw["bias"] is None else kw["bias"] + hide
    return attention(p.q, p.k, p.v, return_lse=True, **kw)


def _check_flags(flags, n, step, p):
    if not isinstance(flags, (list, tuple, np.ndarray)) or len(flags) != n:
        raise Fail(f"ring_step returned {type(flags).__name__} {flags!r:.80}; expected a list of {n} bools "
                   f"(one per host) at step {step} on example {p!r}")
    if not all(isinstance(f, (bool, np.bool_)) for f in flags):
        raise Fail(f"ring_step returned {list(flags)!r:.80}; expected bools (True: the host computed its hop) "
                   f"at step {step} on example {p!r}")


def _check_ring(sol, fn, p):
    problem, hosts = _setup(p)
    n, c = problem.n_hosts, problem.shard
    b, _, h, d = hosts[0].q.shape
    blocks = [host.held for host in hosts]  # block r starts on host r
    for host in hosts:
        host.m, host.l, host.o = init_state(b, h, c, d)
    for step in range(n):
        flags = sol.call("ring_step", fn, hosts, step, problem, example=p)
        _check_flags(flags, n, step, p)
        after = step + 1 if step < n - 1 else step  # what each host holds once the step is over
        for host in hosts:
            i = host.my_idx
            want = (i - after) % n
            prop = (f"after step {step} of {n} host {i} holds block {want} (sent one host on, "
                    f"{'no send after the last step' if step == n - 1 else 'buffers swapped'}) and its "
                    f"receive buffer is empty")
            if host.held is not blocks[want] or host.recv is not None:
                held = getattr(host.held, "kv_idx", None)
                held = f"a copy of block {held} (send the block object itself)" if held == want and \
                    host.held is not blocks[want] else f"block {held}"
                recv = "empty" if host.recv is None else f"holds block {getattr(host.recv, 'kv_idx', None)}"
                raise Fail(f"property '{prop}' failed on example {p!r}: it holds {held}, receive buffer {recv}")
            blk = blocks[(i - step) % n]  # the block attended at this step
            empty = bool(tile_is_empty(host.q_pos, blk.k_pos, host.q_seg, blk.k_seg, causal=problem.causal,
                                       window=problem.window))
            if bool(flags[i]) == empty:
                raise Fail(f"property 'a hop is computed exactly when its mask is not provably empty' failed on "
                           f"example {p!r}: host {i} at step {step} (block {(i - step) % n}) returned {flags[i]} "
                           f"but the hop is {'empty' if empty else 'not empty'}")
            for name, x, shape in (("m", host.m, (b, h, c)), ("l", host.l, (b, h, c)), ("o", host.o, (b, c, h, d))):
                check_array(f"host {i}'s {name} after step {step}", x, shape, np.float64, p)
            want_o, want_lse = _oracle_seen(p, problem.perm, c, [(i - t) % n for t in range(step + 1)])
            rows = host.q_pos[0]
            with np.errstate(all="ignore"):
                got_o, got_lse = finalize(host.m, host.l, host.o)
            prop = f"after step {step} host {i}'s state is the oracle's over the blocks it has seen"
            check_close("o", got_o, want_o[:, rows], TOL, prop, p)
            check_close("lse", got_lse, want_lse[:, :, rows], TOL, prop, p)


def check(sol):
    forbid(sol, "ringattn_ref.ring", "ringattn_fast.ring", allow=("Host", "KVBlock", "RingProblem", "RingTrace"))
    fn = sol.function("ring_step", "ring_step(hosts, step, problem) -> list of bools")
    for_all(attention_problems(max_hosts=6, max_shard=4, max_dim=4), lambda p: _check_ring(sol, fn, p),
            examples=EXAMPLES)
    ok("ring_step: who holds what, skipped hops, the state after every step", EXAMPLES)
    return f"ring_step runs the ring exactly (float64 oracle) on {EXAMPLES} drawn problems, every layout"
