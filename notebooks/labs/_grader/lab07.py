"""Grader of lab 7: decode over a sequence-sharded KV cache: local attention, then one pmax and one psum.

Child: wraps the student's per-host ``decode_attention_shard`` in the grader's ``shard_map`` (the
cache sharded striped, as ``ringattn_fast.inference`` keeps it: host ``r``'s slot ``i`` holds position
``i * N + r``) and exports it, traced on shapes only. Parent: fills caches with a history of a different
length per row, then decodes several tokens, appending each one's K/V itself and running the program
once per token; every host's output is compared with the float64 oracle over the row's whole history
(fixed: 3, 5 and 8 hosts, GQA, rows of length 1, a token with logits past ``exp``'s range; plus a
draw). Only ``lengths`` says which slots hold the row's tokens: in even rows the slots past the row's
length hold stale tokens that look like data (an earlier, longer sequence's, drawn like the real
ones), in odd rows they hold the fill value ``GARBAGE`` (large: attended to, it dominates), and the
first token decoded into an odd row *is* the fill value. So a solution that guesses empty slots from
their contents, not from ``lengths``, fails one way or the other. From the compiled program: the only collectives are
all-reduces, at most two per token, each of at most ``b h (d + 1)`` numbers (never the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_fast.kernels.xla.hop_fwd", "ringattn_fast.schedule.QShard", "ringattn_fast.schedule.KVShard",
           "ringattn_fast.schedule.HopConfig", "ringattn_fast.masks")
FUNCTIONS = {"decode_attention_shard": "decode_attention_shard(q, k, v, lengths, *, axis_name) -> o"}
TOL = 1e-10
GARBAGE = 50.0  # what an empty slot of an odd row holds (attended to, it dominates), and a real token there


@dataclass(frozen=True)
class Decode:
    """A cache of ``max_seq`` slots on ``n_hosts`` hosts, rows holding ``history`` tokens, then
    ``steps`` tokens decoded (step ``big`` with queries scaled by 500: logits past float64 exp's range)."""
    name: str
    n_hosts: int
    batch: int
    heads: int
    kv_heads: int
    dim: int
    max_seq: int
    history: tuple
    steps: int = 3
    big: int = 1
    seed: int = 0

    def __repr__(self):
        return (f"{self.name}(batch={self.batch}, heads={self.heads}, kv_heads={self.kv_heads}, dim={self.dim}, "
                f"n_hosts={self.n_hosts}, max_seq={self.max_seq}, history={list(self.history)}, "
                f"steps={self.steps}, step {self.big} with large logits)")


def decodes():
    from hypothesis import strategies as st

    yield Decode("GQA, 3 hosts", 3, 3, 4, 2, 3, 18, (0, 6, 13), seed=1)
    yield Decode("MQA, 5 hosts", 5, 2, 3, 1, 2, 20, (4, 16), seed=2)
    yield Decode("8 hosts", 8, 2, 2, 2, 4, 32, (1, 27), seed=3)

    @st.composite
    def drawn(draw_):
        n, b, hk = draw_(st.integers(2, 8)), draw_(st.integers(1, 3)), draw_(st.integers(1, 2))
        h, d = hk * draw_(st.integers(1, 3)), draw_(st.integers(1, 4))
        max_seq = n * draw_(st.integers(2, 4))
        history = tuple(draw_(st.lists(st.integers(0, max_seq - 3), min_size=b, max_size=b)))
        return Decode("drawn", n, b, h, hk, d, max_seq, history, seed=draw_(st.integers(0, 2**16)))

    yield draw(drawn(), 3)[-1]


def _striped(n, max_seq):
    """perm[g] = the true position held at global cache index g (host r, slot i: position i * N + r)."""
    c = max_seq // n
    return np.array([i * n + r for r in range(n) for i in range(c)])


def _oracle(q, k, v):
    """float64 softmax attention of one query row q [1, h, d] over a row's tokens k, v [t, hk, d]."""
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    kr, vr = (np.repeat(x, h // hk, axis=1) for x in (k, v))  # query head j reads kv head j // (h // hk)
    s = np.einsum("hd,thd->ht", q[0], kr) * d ** -0.5
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (np.einsum("ht,thd->hd", p, vr) / p.sum(axis=1, keepdims=True))[None, None]  # (1, 1, h, d)


def check_collectives(prog, p):
    budget = p.batch * p.heads * (p.dim + 1) * 8
    reduces = 0
    for c in prog.collectives:
        if c.opcode != "all-reduce":
            raise Fail(f"property 'decode merges with all-reduces only (no ppermute, no gather of the cache)' failed "
                       f"on example {p!r}: the program has a {c.opcode} moving {c.nbytes} bytes")
        if c.runs is None:
            raise Fail(f"property 'at most two collectives per token' failed on example {p!r}: an all-reduce in a "
                       f"loop whose trip count XLA cannot see")
        if c.nbytes > budget:
            raise Fail(f"property 'each all-reduce moves at most b h (d + 1) numbers' failed on example {p!r}: one "
                       f"moves {c.nbytes} bytes ({list(c.arrays)}); b h (d + 1) float64 are {budget} bytes")
        reduces += c.runs
    if not 1 <= reduces <= 2:
        raise Fail(f"property 'at most two collectives per token (one pmax, one psum)' failed on example {p!r}: the "
                   f"program runs {reduces} all-reduces per token")
    return reduces


def build(tasks):
    plan = []
    for p in decodes():
        shapes = [[p.batch, 1, p.heads, p.dim], [p.batch, p.max_seq, p.kv_heads, p.dim],
                  [p.batch, p.max_seq, p.kv_heads, p.dim], [p.batch]]
        plan.append((p, tasks.add("decode", shapes=shapes, n_hosts=p.n_hosts, example=repr(p))))

    def verify(results):
        from .programs import Program

        counts = []
        for p, task in plan:
            prog = Program(results.blob(task), "decode_attention_shard", p.n_hosts, p)
            counts.append(check_collectives(prog, p))
            rng = np.random.default_rng(p.seed)
            b, hk, d = p.batch, p.kv_heads, p.dim
            total = max(p.history) + p.steps
            k_true, v_true = rng.standard_normal((2, b, total, hk, d))  # every row's tokens, in true order
            perm = _striped(p.n_hosts, p.max_seq)
            lengths = np.array(p.history, np.int64)
            # empty slots: stale tokens drawn like data in even rows, the fill value in odd rows; the first
            # token decoded into an odd row is the fill value itself (only lengths tells them apart)
            stale_k, stale_v = rng.standard_normal((2, b, p.max_seq, hk, d))
            odd = (np.arange(b) % 2 == 1)[:, None, None, None]
            cache_k = np.where(odd, GARBAGE, stale_k)
            cache_v = np.where(odd, -GARBAGE, stale_v)
            for row in range(1, b, 2):
                k_true[row, lengths[row]], v_true[row, lengths[row]] = GARBAGE, -GARBAGE
            for row in range(b):
                for pos in range(lengths[row]):
                    g = int(np.flatnonzero(perm == pos)[0])
                    cache_k[row, g], cache_v[row, g] = k_true[row, pos], v_true[row, pos]
            for step in range(p.steps):
                for row in range(b):  # append this step's token: position lengths[row]
                    g = int(np.flatnonzero(perm == lengths[row])[0])
                    cache_k[row, g], cache_v[row, g] = k_true[row, lengths[row]], v_true[row, lengths[row]]
                lengths = lengths + 1
                q = rng.standard_normal((b, 1, p.heads, d)) * (500.0 if step == p.big else 1.0)
                got = prog(q, cache_k, cache_v, lengths.astype(np.int32))[0]
                got = check_array("decode_attention_shard's output (every host's)", got,
                                  (p.n_hosts, b, 1, p.heads, d), np.float64, p)
                for row in range(b):
                    n_seen = int(lengths[row])
                    want = _oracle(q[row], k_true[row, :n_seen], v_true[row, :n_seen])
                    for host in range(p.n_hosts):
                        check_close("o", got[host, row:row + 1], want, TOL,
                                    f"decode step {step}: host {host}'s output for row {row} is the oracle's over the "
                                    f"row's {n_seen} tokens", p)
        ok("decode: every host's output is the float64 oracle's over the whole history (3 to 8 hosts, GQA, large "
           f"logits; past each row's length stale tokens or the fill value, and a real token equal to it); from the compiled program: {max(counts)} all-reduces per token at most, "
           "each b h (d + 1) numbers", len(plan))
        return "decode over the sharded cache is exact with at most two small all-reduces per token"

    return verify


# ---- child side ----------------------------------------------------------------------------------------------

def _decode(sol, a, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    fn = sol.function("decode_attention_shard", FUNCTIONS["decode_attention_shard"])
    per_host = lambda q, k, v, lengths: fn(q, k, v, lengths, axis_name="sp")[None]  # noqa: E731 - one per host
    cache = jax.P(None, "sp")
    prog = jax.jit(jax.shard_map(per_host, mesh=make_mesh(params["n_hosts"]),
                                 in_specs=(jax.P(), cache, cache, jax.P()), out_specs=jax.P("sp"), check_vma=False))
    dtypes = (np.float64,) * 3 + (np.int32,)
    return sol.call("decode_attention_shard", lambda: export(prog, list(zip(params["shapes"], dtypes))),
                    example=params["example"])


CHILD = {"decode": _decode}
