"""Grader of lab 6: the ring backward in ``shard_map``: dQ stays, dK/dV travel with K/V and come home.

Child: wraps the student's per-host ``ring_backward_shard`` in the grader's ``shard_map``
(contiguous layout) and exports it, traced on shapes only. Parent: the forward's ``o`` and ``lse``
from the float64 oracle, a random ``do``, runs the program and compares ``dq, dk, dv`` with
``ringattn_ref.ring_attention_vjp`` (fixed: 3, 5 and 8 hosts, GQA, b and d > 1, causal and not; plus
a draw); from the compiled program: every collective is a ppermute ``i -> i+1`` (K/V and their
gradients travel the forward's way; an autodiff of a forward ring sends them back the other way), in
all ``(N - 1)`` K/V shards and ``N`` dK/dV shards (the last send brings them home; nothing of dQ), and
the scratch memory per device is O(S / N).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_fast.kernels.xla.hop_bwd", "ringattn_fast.kernels.xla.hop_fwd", "ringattn_fast.softmax.merge",
           "ringattn_fast.schedule.QShard", "ringattn_fast.schedule.KVShard",
           "ringattn_fast.schedule.HopConfig", "ringattn_fast.schedule.HopGrads")
FUNCTIONS = {"ring_backward_shard": "ring_backward_shard(q, k, v, o, lse, do, *, axis_name, causal) -> (dq, dk, dv)"}
TOL = 1e-10
MEMORY_SHARDS = 6  # scratch per device in one host's q + k + v + o + do (+ 16 KiB); see check_traffic


@dataclass(frozen=True)
class Problem:
    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    n_hosts: int
    causal: bool

    def __repr__(self):
        return f"{self.name}(q{self.q.shape}, k{self.k.shape}, n_hosts={self.n_hosts}, causal={self.causal})"


def problems():
    from ringattn_ref.testing import attention_problems

    rng = np.random.default_rng(2406)
    for name, n, (b, s, h, hk, d), causal in (("GQA, 3 hosts", 3, (2, 12, 4, 2, 3), True),
                                               ("MQA, 5 hosts", 5, (1, 20, 3, 1, 2), False),
                                               ("8 hosts", 8, (2, 32, 2, 1, 4), True),
                                               ("8 hosts x 32 tokens (memory)", 8, (1, 256, 2, 2, 8), True)):
        q, do = rng.standard_normal((2, b, s, h, d))
        k, v = rng.standard_normal((2, b, s, hk, d))
        yield Problem(name, q, k, v, do, n, causal)
    strat = attention_problems(min_hosts=3, max_hosts=8, max_shard=4, layouts=("contiguous",), segment_ids=False,
                               bias=False, window=False, masked_rows=False)
    p = draw(strat.filter(lambda p: p.scale is None), 3)[-1]
    yield Problem("drawn", p.q, p.k, p.v, p.do, p.n_hosts, p.causal)


def check_traffic(prog, p):
    from .programs import require_memory, require_ring

    n, c = p.n_hosts, p.q.shape[1] // p.n_hosts
    kv = 2 * p.k[:, :c].nbytes  # one host's K and V (and so its dK and dV, accumulated in float64)
    pos = p.q.shape[0] * c * 8
    ways = require_ring(prog, n, "K/V and dK/dV travel i -> i+1 (the forward's way), by ppermute", p)
    moved = sum(c_op.total for c_op in ways["i -> i+1"])
    lo = (n - 1) * kv + n * kv
    if not lo <= moved <= lo + (n - 1) * pos:
        raise Fail(f"property 'K/V travel N - 1 times and dK/dV N times (home), dQ stays' failed on example {p!r}: "
                   f"the ppermutes move {moved} bytes in all; (N - 1) K/V shards + N dK/dV shards are {lo} bytes "
                   f"(+ up to {(n - 1) * pos} for positions); a K/V shard is {kv} bytes")
    shard = 3 * p.q[:, :c].nbytes + 2 * p.k[:, :c].nbytes  # q, o, do, k, v of one host
    require_memory(prog, MEMORY_SHARDS * shard + 2**14, "scratch memory per device is O(S / N)", p,
                   f"{MEMORY_SHARDS} x one host's q, o, do, k, v = {MEMORY_SHARDS * shard} bytes, + 16 KiB")


def build(tasks):
    plan = []
    for p in problems():
        shapes = [list(x.shape) for x in (p.q, p.k, p.v, p.q)] + [[p.q.shape[0], p.q.shape[2], p.q.shape[1]],
                                                                   list(p.q.shape)]
        plan.append((p, tasks.add("backward", shapes=shapes, n_hosts=p.n_hosts, causal=p.causal, example=repr(p))))

    def verify(results):
        from ringattn_ref import attention, ring_attention_vjp

        from .programs import Program

        for p, task in plan:
            prog = Program(results.blob(task), "ring_backward_shard", p.n_hosts, p)
            check_traffic(prog, p)
            o, lse = attention(p.q, p.k, p.v, causal=p.causal, return_lse=True)
            got = prog(p.q, p.k, p.v, o, lse, p.do)
            want = ring_attention_vjp(p.q, p.k, p.v, p.do, n_hosts=p.n_hosts, causal=p.causal)
            if len(got) != 3:
                raise Fail(f"ring_backward_shard returned {len(got)} arrays; expected (dq, dk, dv) on example {p!r}")
            for name, g, w, like in zip(("dq", "dk", "dv"), got, want, (p.q, p.k, p.v)):
                g = check_array(f"ring_backward_shard's {name}", g, like.shape, np.float64, p)
                check_close(name, g, w, TOL, f"{name} is the oracle's (ringattn_ref.ring_attention_vjp), home on "
                            f"its host", p)
        ok("dq, dk, dv are the float64 oracle's (3 to 8 hosts, GQA, causal and not); from the compiled program: "
           "ppermutes i -> i+1 only, N - 1 K/V and N dK/dV shards moved, O(S/N) memory", len(plan))
        return "the ring backward is exact; dK/dV travel with their K/V and come home, dQ stays"

    return verify


# ---- child side ----------------------------------------------------------------------------------------------

def _backward(sol, a, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    fn = sol.function("ring_backward_shard", FUNCTIONS["ring_backward_shard"])
    seq, stat = jax.P(None, "sp"), jax.P(None, None, "sp")
    prog = jax.jit(jax.shard_map(partial(fn, axis_name="sp", causal=params["causal"]),
                                 mesh=make_mesh(params["n_hosts"]), in_specs=(seq,) * 4 + (stat, seq),
                                 out_specs=(seq,) * 3, check_vma=False))
    return sol.call("ring_backward_shard", lambda: export(prog, [(s, np.float64) for s in params["shapes"]]),
                    example=params["example"])


CHILD = {"backward": _backward}
