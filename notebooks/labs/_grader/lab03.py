"""Grader of lab 3: the zigzag permutation, per-host positions inside shard_map, the ring's output."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from ringattn_fast import make_mesh
from ringattn_ref.attention import attention

from .common import Fail, check_array, check_close, for_all, for_all_rings, forbid, ok

LAYOUT_EXAMPLES, RING_EXAMPLES = 30, 2
TOL = 1e-10


class Size(NamedTuple):
    """A ring size and a sequence length, a multiple of 2 * n_hosts."""
    n_hosts: int
    seq: int

    def __repr__(self):
        return f"(seq={self.seq}, n_hosts={self.n_hosts})"


@st.composite
def sizes(draw):
    n = draw(st.integers(1, 8))
    return Size(n, 2 * n * draw(st.integers(1, 4)))


def _zigzag_spec(seq, n):
    """Which true positions host r should own: chunks r and 2N-1-r (written as the docstring says)."""
    chunk = seq // (2 * n)
    return [sorted(list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)))
            for r in range(n)]


def _check_perm(sol, fn, size):
    n, seq = size
    perm = np.asarray(sol.call("zigzag_permutation", fn, seq, n, example=size))
    check_array("zigzag_permutation's result", perm, (seq,), perm.dtype, size)
    if not np.issubdtype(perm.dtype, np.integer) or sorted(perm.tolist()) != list(range(seq)):
        raise Fail(f"property 'a permutation of range(seq)' failed on example {size!r}: got {perm.tolist()}")
    owned = perm.reshape(n, seq // n)  # (host, its true positions)
    work = (owned + 1).sum(axis=1).tolist()  # causal pairs per host: query t sees keys 0..t
    if len(set(work)) != 1:
        raise Fail(f"property 'every host gets the same causal work' failed on example {size!r}: causal "
                   f"(query, key) pairs per host {work} (perm {perm.tolist()})")
    for r, (got, want) in enumerate(zip(owned, _zigzag_spec(seq, n))):
        if sorted(got.tolist()) != want:
            raise Fail(f"property 'host r owns chunks r and 2N-1-r' failed on example {size!r}: host {r} owns "
                       f"{sorted(got.tolist())}, wants {want}")


def _check_positions(sol, fn, perm_fn, size):
    n, seq = size
    c = seq // n
    mesh = make_mesh(n)
    positions = jax.shard_map(lambda x: fn(c, "sp") + 0 * x[0], mesh=mesh, in_specs=jax.P(None, "sp"),
                              out_specs=jax.P("sp"), check_vma=False)
    got = sol.call("zigzag_positions", lambda: positions(jnp.zeros((1, seq), jnp.int32)), example=size)
    got = check_array("zigzag_positions (all hosts, concatenated)", got, (seq,), got.dtype, size)
    if not np.issubdtype(got.dtype, np.integer):
        raise Fail(f"zigzag_positions returned dtype {got.dtype}; expected int32 on example {size!r}")
    want = np.asarray(perm_fn(seq, n))
    if not np.array_equal(got, want):
        raise Fail(f"property 'the positions inside shard_map are the permutation's' failed on example {size!r}: "
                   f"hosts give {got.reshape(n, c).tolist()}, the permutation {want.reshape(n, c).tolist()}")


def _check_ring(sol, fn, p):
    mesh = make_mesh(p.n_hosts)
    got = sol.call("zigzag_ring_attention", lambda: jax.block_until_ready(
        fn(jnp.asarray(p.q), jnp.asarray(p.k), jnp.asarray(p.v), mesh=mesh, causal=p.causal)), example=p)
    got = check_array("zigzag_ring_attention's output", got, p.q.shape, np.float64, p)
    want = attention(p.q, p.k, p.v, causal=p.causal)
    check_close("o", got, want, TOL, "the ring's output is the float64 oracle's, in true order", p)


def check(sol):
    forbid(sol, "ringattn_ref.layouts", "ringattn_fast.layouts")
    perm = sol.function("zigzag_permutation", "zigzag_permutation(seq, n_hosts) -> int array [seq]")
    positions = sol.function("zigzag_positions", "zigzag_positions(seq_local, axis_name) -> int32 [seq_local]")
    ring = sol.function("zigzag_ring_attention", "zigzag_ring_attention(q, k, v, *, mesh, causal) -> o")
    for_all(sizes(), lambda size: _check_perm(sol, perm, size), examples=LAYOUT_EXAMPLES)
    ok("zigzag_permutation: a permutation, balanced causal work, chunks r and 2N-1-r", LAYOUT_EXAMPLES)
    for size in [Size(3, 12), Size(8, 32)]:
        _check_positions(sol, positions, perm, size)
    ok("zigzag_positions: inside shard_map, equal to the permutation", 2)
    for_all_rings(lambda p: _check_ring(sol, ring, p), examples=RING_EXAMPLES, min_hosts=2)
    ok("zigzag_ring_attention: the float64 oracle's output, causal and not", RING_EXAMPLES)
    return "the zigzag permutation, its per-host positions and the JAX ring in that layout are exact"
