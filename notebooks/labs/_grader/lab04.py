"""Grader of lab 4: the bidirectional ring's output, and what its compiled program sends.

Child: wraps the student's per-host function in the grader's ``shard_map`` (contiguous layout) and
exports it, traced on shapes only. Parent: compiles and runs that program on its own inputs (fixed: 3,
5 and 8 hosts, GQA, b and d > 1, causal and not, logits past exp's float64 range; plus draws) against
the float64 oracle, and reads from the compiled program: every collective is a ppermute to a neighbour
(no all-gather or all-to-all), each ppermute moves at most half a shard (K and V halves, and their
positions), each direction moves (N - 1) halves in all (bytes from the operands, times the loop's trip
count), and the per-device scratch memory stays O(S / N).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_fast.kernels.xla.hop_fwd", "ringattn_fast.softmax.merge", "ringattn_fast.schedule.QShard",
           "ringattn_fast.schedule.KVShard", "ringattn_fast.schedule.HopConfig")
FUNCTIONS = {"bidirectional_ring_attention_shard":
             "bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal) -> o"}
TOL = 1e-10
MEMORY_SHARDS = 5  # scratch budget per device in one host's q + k + v + o, + 16 KiB (measured: the reference
# needs 3.0 on the memory example, a ring that keeps every half it receives 8.3)


@dataclass(frozen=True)
class Ring:
    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    n_hosts: int
    causal: bool

    def __repr__(self):
        return f"{self.name}(q{self.q.shape}, k{self.k.shape}, n_hosts={self.n_hosts}, causal={self.causal})"


def fixed_rings():
    rng = np.random.default_rng(2404)
    # (name, hosts, (b, s, h, hk, d), causal, logit size): "large logits" reach ~2000, where exp overflows
    # float64 (past ~709): a merge without a running max gives NaN there
    for name, n, (b, s, h, hk, d), causal, size in (("GQA, 3 hosts", 3, (2, 12, 4, 2, 3), True, 1),
                                                     ("MQA, 5 hosts", 5, (1, 20, 3, 1, 2), False, 1),
                                                     ("large logits, 3 hosts", 3, (1, 12, 2, 1, 4), False, 30),
                                                     ("8 hosts, long shards", 8, (2, 64, 2, 1, 4), True, 1),
                                                     ("8 hosts x 32 tokens (memory)", 8, (1, 256, 2, 2, 8), False, 1)):
        q = size * rng.standard_normal((b, s, h, d))
        k, v = rng.standard_normal((2, b, s, hk, d))
        k = size * k
        yield Ring(name, q, k, v, n, causal)


def drawn_rings():
    from ringattn_ref.testing import attention_problems

    for causal in (True, False):
        strat = attention_problems(min_hosts=3, max_hosts=8, max_shard=4, layouts=("zigzag",), causal=causal,
                                   segment_ids=False, bias=False, window=False, masked_rows=False)
        p = draw(strat.filter(lambda p: p.scale is None), 3)[-1]
        yield Ring("drawn", p.q, p.k, p.v, p.n_hosts, p.causal)


def check_traffic(prog, r, prop_prefix=""):
    """The bidirectional ring's collectives: see the module docstring."""
    from . import hlo
    from .programs import require_memory, require_ring

    n = r.n_hosts
    b, s, _, d = r.q.shape
    c, hk, item = s // n, r.k.shape[2], r.q.dtype.itemsize
    half_kv = b * (c // 2) * hk * d * item * 2  # K and V halves
    half_pos = b * (c // 2) * 8  # their positions (int64 at most)
    ways = require_ring(prog, n, "K/V travel only to the neighbours, by ppermute", r,
                        directions=("i -> i+1", "i -> i-1"))
    half_k = half_kv // 2  # half a shard of K (or of V)
    for way, ops in ways.items():
        for c_op in ops:
            for dt, shape in c_op.arrays:
                nbytes = int(np.prod(shape)) * hlo.ITEMSIZE[dt]
                if nbytes > half_k:
                    raise Fail(f"property 'no ppermute moves more than half a shard' failed on example {r!r}: a "
                               f"{way} ppermute moves a {dt}{list(shape)} array ({nbytes} bytes); half a shard "
                               f"of K (or V) is {half_k} bytes")
    total = {way: sum(c_op.total for c_op in ops) for way, ops in ways.items()}
    lo, hi = (n - 1) * half_kv, (n - 1) * (half_kv + half_pos)
    for way, moved in total.items():
        if not lo <= moved <= hi:
            raise Fail(f"property 'each direction moves N - 1 half shards of K/V' failed on example {r!r}: {way} "
                       f"moves {moved} bytes in all; (N - 1) x half a shard of K and V is {lo} bytes (+ up to "
                       f"{hi - lo} for positions); bytes per direction: {total}")
    shard = (2 * r.q[:, :c].nbytes + 2 * r.k[:, :c].nbytes)  # q, o, k, v of one host
    require_memory(prog, MEMORY_SHARDS * shard + 2**14, "scratch memory per device is O(S / N)", r,
                   f"{MEMORY_SHARDS} x one host's q, k, v, o = {MEMORY_SHARDS * shard} bytes, + 16 KiB")


def build(tasks):
    rings = list(fixed_rings()) + list(drawn_rings())
    plan = [(r, tasks.add("ring", shapes=[list(x.shape) for x in (r.q, r.k, r.v)], n_hosts=r.n_hosts,
                          causal=r.causal, example=repr(r))) for r in rings]

    def verify(results):
        from ringattn_ref.attention import attention

        from .programs import Program

        for r, task in plan:
            prog = Program(results.blob(task), "bidirectional_ring_attention_shard", r.n_hosts, r)
            check_traffic(prog, r)
            got = check_array("the output", prog(r.q, r.k, r.v)[0], r.q.shape, np.float64, r)
            check_close("o", got, attention(r.q, r.k, r.v, causal=r.causal), TOL, "the output is the float64 oracle's",
                        r)
        ok("exact vs the float64 oracle (3 to 8 hosts, GQA, causal and not); from the compiled program: only "
           "neighbour ppermutes, half a shard each, N - 1 halves each way, O(S/N) memory", len(plan))
        return "the bidirectional ring is exact and sends half of each K/V shard each way"

    return verify


# ---- child side ----------------------------------------------------------------------------------------------

def _ring(sol, a, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    fn = sol.function("bidirectional_ring_attention_shard", FUNCTIONS["bidirectional_ring_attention_shard"])
    spec = jax.P(None, "sp")
    prog = jax.jit(jax.shard_map(partial(fn, axis_name="sp", causal=params["causal"]), mesh=make_mesh(params["n_hosts"]),
                                 in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
    return sol.call("bidirectional_ring_attention_shard",
                    lambda: export(prog, [(s, np.float64) for s in params["shapes"]]), example=params["example"])


CHILD = {"ring": _ring}
