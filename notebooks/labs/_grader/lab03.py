"""Grader of lab 3: the zigzag permutation, per-host positions inside shard_map, the zigzag JAX ring.

Parent: sizes and problems (fixed: 3, 5 and 8 hosts, GQA, b and d > 1, causal and not; plus draws).
Child: calls ``zigzag_permutation`` (numpy, results back as arrays) and exports two programs per
ring size: ``zigzag_positions`` inside a ``shard_map``, and ``zigzag_ring_attention`` (traced on
shapes only). It exports the ring a second time with ``ringattn_fast.ring_attention_shard`` replaced
by a *probe* that returns, for every token, the host it sits on and the position it was given: the
parent runs that program and sees the layout the student's ring really used. So neither dense
attention (no ppermute), nor the contiguous library ring (its tokens sit on the wrong hosts) passes.
The positions program's per-host part (read from its StableHLO) may hold no array larger than the
host's shard: a solution that builds the whole permutation, or half-sequence iotas, on every host and
slices its shard out fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ("ringattn_fast.ring.ring_attention_shard", "ringattn_fast.mesh.make_mesh")
FUNCTIONS = {"zigzag_permutation": "zigzag_permutation(seq, n_hosts) -> int array [seq]",
             "zigzag_positions": "zigzag_positions(seq_local, axis_name) -> int32 [seq_local]",
             "zigzag_ring_attention": "zigzag_ring_attention(q, k, v, *, mesh, causal) -> o"}
LAYOUT_EXAMPLES = 30
TOL = 1e-10


@dataclass(frozen=True)
class Size:
    """A ring size and a sequence length, a multiple of 2 * n_hosts."""
    n_hosts: int
    seq: int

    def __repr__(self):
        return f"(seq={self.seq}, n_hosts={self.n_hosts})"


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


def zigzag_owner(seq, n):
    """host [seq]: which host owns each true position under zigzag (chunks r and 2N-1-r)."""
    chunk = np.arange(seq) // (seq // (2 * n))
    return np.where(chunk < n, chunk, 2 * n - 1 - chunk)


def zigzag_spec(seq, n):
    """The true positions host r owns, in layout order: chunk r, then chunk 2N-1-r."""
    c = seq // (2 * n)
    return np.concatenate([np.r_[r * c:(r + 1) * c, (2 * n - 1 - r) * c:(2 * n - r) * c] for r in range(n)])


def fixed_rings():
    rng = np.random.default_rng(2403)
    for name, n, (b, s, h, hk, d), causal in (("GQA, 3 hosts", 3, (2, 12, 4, 2, 3), True),
                                               ("MQA, 5 hosts", 5, (1, 20, 3, 1, 2), False),
                                               ("8 hosts", 8, (2, 32, 2, 2, 4), True)):
        q = rng.standard_normal((b, s, h, d))
        k, v = rng.standard_normal((2, b, s, hk, d))
        yield Ring(name, q, k, v, n, causal)


def build(tasks):
    from hypothesis import strategies as st
    from ringattn_ref.testing import attention_problems

    @st.composite
    def sizes(draw_):
        n = draw_(st.integers(1, 8))
        return Size(n, 2 * n * draw_(st.integers(1, 4)))

    layout_sizes = [Size(3, 18), Size(5, 10), Size(8, 48), Size(1, 2)] + draw(sizes(), LAYOUT_EXAMPLES)
    perm_task = tasks.add("perm", sizes=[[s.n_hosts, s.seq] for s in layout_sizes])
    pos_sizes = [Size(3, 12), Size(5, 30), Size(8, 32)]
    pos_tasks = [tasks.add("positions", n_hosts=s.n_hosts, seq=s.seq) for s in pos_sizes]
    drawn = []
    for causal in (True, False):
        strat = attention_problems(min_hosts=2, max_hosts=8, max_shard=4, layouts=("zigzag",), causal=causal,
                                   segment_ids=False, bias=False, window=False, masked_rows=False)
        p = draw(strat.filter(lambda p: p.scale is None and p.n_hosts > 2), 3)[-1]
        drawn.append(Ring("drawn", p.q, p.k, p.v, p.n_hosts, p.causal))
    rings = list(fixed_rings()) + drawn
    ring_tasks = [(r, tasks.add("ring", shapes=[list(x.shape) for x in (r.q, r.k, r.v)], n_hosts=r.n_hosts,
                                causal=r.causal, example=repr(r))) for r in rings]
    probe_tasks = [(r, tasks.add("probe", shapes=[list(x.shape) for x in (r.q, r.k, r.v)], n_hosts=r.n_hosts,
                                 causal=r.causal, example=repr(r))) for r in rings[:3]]

    def verify(results):
        from ringattn_ref.attention import attention

        from .programs import Program, require_ppermute_only, require_ring

        out = results.arrays(perm_task)
        for i, size in enumerate(layout_sizes):
            _check_perm(out.get(f"p{i}"), size)
        ok("zigzag_permutation: a permutation, balanced causal work, chunks r and 2N-1-r", len(layout_sizes))
        for size, task in zip(pos_sizes, pos_tasks):
            prog = Program(results.blob(task), "zigzag_positions", size.n_hosts, size)
            got = prog(np.zeros((1, size.seq), np.int32))[0]
            got = check_array("zigzag_positions (all hosts, concatenated)", got, (size.seq,), None, size)
            want = zigzag_spec(size.seq, size.n_hosts)
            if not np.issubdtype(got.dtype, np.integer) or not np.array_equal(got, want):
                raise Fail(f"property 'the positions inside shard_map are the zigzag layout's' failed on example "
                           f"{size!r}: hosts give {got.reshape(size.n_hosts, -1).tolist()}, zigzag is "
                           f"{want.reshape(size.n_hosts, -1).tolist()}")
            _check_per_host_memory(prog, size)
        ok("zigzag_positions: inside shard_map, the zigzag layout's true positions, no sequence-sized array on a "
           "host", len(pos_sizes))
        for r, task in ring_tasks:
            prog = Program(results.blob(task), "zigzag_ring_attention", r.n_hosts, r)
            # the reorder to and from the layout outside the shard_map may gather or all-reduce the arrays;
            # the ring itself is checked by the probe below (it sees where each token was attended)
            require_ring(prog, r.n_hosts, "the ring: a shard_map whose K/V travel i -> i+1 by ppermute", r,
                         counted=False, others=("all-reduce", "all-gather", "all-to-all"))
            require_ppermute_only(prog, "K/V travel inside the shard_map by ppermute only", r)
            got = check_array("zigzag_ring_attention's output", prog(r.q, r.k, r.v)[0], r.q.shape, np.float64, r)
            check_close("o", got, attention(r.q, r.k, r.v, causal=r.causal), TOL,
                        "the ring's output is the float64 oracle's, in true order", r)
        ok("zigzag_ring_attention: a ring of ppermutes, the float64 oracle's output (3 to 8 hosts, GQA)",
           len(ring_tasks))
        for r, task in probe_tasks:
            prog = Program(results.blob(task), "zigzag_ring_attention (probe)", r.n_hosts, r)
            got = prog(*(np.zeros_like(x) for x in (r.q, r.k, r.v)))[0]  # (b, s, h, d): [host, position, 0 ...]
            seq = r.q.shape[1]
            host, pos = np.rint(got[..., 0]).astype(int), np.rint(got[..., 1]).astype(int)
            want_host = np.broadcast_to(zigzag_owner(seq, r.n_hosts)[None, :, None], host.shape)
            if not np.array_equal(host, want_host):
                t = np.argwhere(host != want_host)[0]
                raise Fail(f"property 'every token is attended on its zigzag host' failed on example {r!r}: token "
                           f"{t[1]} sits on host {host[tuple(t)]}, zigzag puts it on host {want_host[tuple(t)]} "
                           f"(hosts by token: {host[0, :, 0].tolist()})")
            if not np.array_equal(pos, np.broadcast_to(np.arange(seq)[None, :, None], pos.shape)):
                raise Fail(f"property 'ring_attention_shard gets each token's true position' failed on example "
                           f"{r!r}: positions by token {pos[0, :, 0].tolist()}")
        ok("the ring's layout, seen by a probe: every token on its zigzag host with its true position",
           len(probe_tasks))
        return "the zigzag permutation, its per-host positions and the JAX ring in that layout are exact"

    return verify


def _check_per_host_memory(prog, size):
    """Fail if a host's part of the positions program holds an array of more elements than its shard has
    tokens (the whole layout's table, a sequence-long iota, half-sequence iotas, a replicated constant):
    each host's positions come from its index and the ring size, O(S / N) memory. Read from the exported
    StableHLO, so nothing XLA folds away hides it."""
    from .programs import per_host_arrays

    shard = size.seq // size.n_hosts
    big = [(dtype, shape) for dtype, shape in per_host_arrays(prog.stablehlo) if int(np.prod(shape)) > shard]
    if big:
        dtype, shape = max(big, key=lambda a: int(np.prod(a[1])))
        raise Fail(f"property 'no sequence-sized array on a host: none larger than its shard (zigzag_positions "
                   f"computes a host's positions from its index)' failed on example {size!r}: inside the shard_map "
                   f"a host holds {dtype}{list(shape)}, {int(np.prod(shape))} elements for a shard of {shard} tokens")


def _check_perm(perm, size):
    n, seq = size.n_hosts, size.seq
    perm = check_array("zigzag_permutation's result", perm, (seq,), None, size)
    if not np.issubdtype(perm.dtype, np.integer) or sorted(perm.tolist()) != list(range(seq)):
        raise Fail(f"property 'a permutation of range(seq)' failed on example {size!r}: got {perm.tolist()}")
    owned = perm.reshape(n, seq // n)  # (host, its true positions)
    work = (owned + 1).sum(axis=1).tolist()  # causal pairs per host: query t sees keys 0..t
    if len(set(work)) != 1:
        raise Fail(f"property 'every host gets the same causal work' failed on example {size!r}: causal "
                   f"(query, key) pairs per host {work} (perm {perm.tolist()})")
    want = zigzag_spec(seq, n).reshape(n, -1)
    for r in range(n):
        if sorted(owned[r].tolist()) != sorted(want[r].tolist()):
            raise Fail(f"property 'host r owns chunks r and 2N-1-r' failed on example {size!r}: host {r} owns "
                       f"{sorted(owned[r].tolist())}, wants {sorted(want[r].tolist())}")


# ---- child side ----------------------------------------------------------------------------------------------

def _perm(sol, a, params):
    fn = sol.function("zigzag_permutation", FUNCTIONS["zigzag_permutation"])
    out = {}
    for i, (n, seq) in enumerate(params["sizes"]):
        got = sol.call("zigzag_permutation", fn, seq, n, example=Size(n, seq))
        if not hasattr(got, "shape") or np.asarray(got).dtype == object:
            raise Fail(f"zigzag_permutation returned {type(got).__name__}; expected an int array [seq] on example "
                       f"{Size(n, seq)!r}")
        out[f"p{i}"] = np.asarray(got)
    return out


def _positions(sol, a, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    fn = sol.function("zigzag_positions", FUNCTIONS["zigzag_positions"])
    n, seq = params["n_hosts"], params["seq"]
    c = seq // n
    per_host = lambda x: fn(c, "sp") + 0 * x[0]  # noqa: E731 - x only gives the program a sharded input
    prog = jax.jit(jax.shard_map(per_host, mesh=make_mesh(n), in_specs=jax.P(None, "sp"), out_specs=jax.P("sp"),
                                 check_vma=False))
    return sol.call("zigzag_positions", lambda: export(prog, [((1, seq), np.int32)]), example=Size(n, seq))


def _ring_program(sol, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    fn = sol.function("zigzag_ring_attention", FUNCTIONS["zigzag_ring_attention"])
    prog = jax.jit(partial(fn, mesh=make_mesh(params["n_hosts"]), causal=params["causal"]))
    return sol.call("zigzag_ring_attention", lambda: export(prog, [(s, np.float64) for s in params["shapes"]]),
                    example=params["example"])


def probe_ring_attention_shard(q, k, v, *, axis_name="sp", causal=False, positions=None, layout="contiguous",
                               block_q=None, block_kv=None, impl="auto", **unsupported):
    """Stands in for ``ringattn_fast.ring_attention_shard`` in the probe export: o[..., 0] = this host,
    o[..., 1] = the position each query was given (the layout the caller really used)."""
    import jax.numpy as jnp
    from jax import lax

    if positions is None or not isinstance(layout, str) or layout != "contiguous" or unsupported:
        raise ValueError(f"in lab 3 call ring_attention_shard(q, k, v, axis_name=..., causal=..., positions=...) "
                         f"with your zigzag positions (got positions={'None' if positions is None else '...'}, "
                         f"layout={layout!r}{', ' + ', '.join(unsupported) if unsupported else ''})")
    host = jnp.broadcast_to(lax.axis_index(axis_name).astype(q.dtype), q.shape[:3])
    pos = jnp.broadcast_to(positions.astype(q.dtype)[..., None], q.shape[:3])
    return jnp.zeros_like(q).at[..., 0].set(host).at[..., 1].set(pos)


def _probe(sol, a, params):
    import ringattn_fast
    import ringattn_fast.ring

    real = ringattn_fast.ring.ring_attention_shard
    holders = [ringattn_fast, ringattn_fast.ring, sol.module]
    saved = [(m, name) for m in holders for name, obj in list(vars(m).items()) if obj is real]
    for m, name in saved:
        setattr(m, name, probe_ring_attention_shard)
    try:
        return _ring_program(sol, params)
    finally:
        for m, name in saved:
            setattr(m, name, real)


CHILD = {"perm": _perm, "positions": _positions, "ring": lambda sol, a, params: _ring_program(sol, params),
         "probe": _probe}
