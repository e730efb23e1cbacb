"""Grader of lab 4: the bidirectional ring's output, and what its ppermutes send, from the jaxpr."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ringattn_fast import make_mesh
from ringattn_ref.attention import attention

from .common import Fail, check_array, check_close, for_all_rings, forbid, ok

EXAMPLES = 2
TOL = 1e-10


def _subjaxprs(value):
    """The jaxprs inside an equation's parameter (a loop body, cond branches, a shard_map body)."""
    if hasattr(value, "eqns"):  # a Jaxpr (duck-typed: its class moved between JAX versions)
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):  # a ClosedJaxpr
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for x in value:
            yield from _subjaxprs(x)


def ppermutes(jaxpr):
    """Every ``ppermute`` in ``jaxpr`` and the jaxprs nested in it: a list of (perm, operand avals)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found.append((tuple(tuple(int(i) for i in pair) for pair in eqn.params["perm"]),
                          [v.aval for v in eqn.invars]))
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found += ppermutes(sub)
    return found


def _direction(perm, n):
    pairs = set(perm)
    if pairs == {(i, (i + 1) % n) for i in range(n)}:
        return "clockwise"
    if pairs == {(i, (i - 1) % n) for i in range(n)}:
        return "counter-clockwise"
    return None


def _check_traffic(jaxpr, p):
    n, c = p.n_hosts, p.q.shape[1] // p.n_hosts
    sent = {"clockwise": 0, "counter-clockwise": 0}
    found = ppermutes(jaxpr)
    for perm, avals in found:
        way = _direction(perm, n)
        if way is None:
            raise Fail(f"property 'K/V travel only to the neighbours' failed on example {p!r}: a ppermute with "
                       f"perm {list(perm)}; expected i -> i+1 or i -> i-1 on {n} hosts")
        for aval in avals:
            if not jnp.issubdtype(aval.dtype, jnp.floating):
                continue  # positions, segment ids: metadata
            if aval.ndim >= 2 and aval.shape[1] > c // 2:
                raise Fail(f"property 'no ppermute moves more than half a shard' failed on example {p!r}: a "
                           f"{way} ppermute moves a {aval.dtype} array of shape {aval.shape} ({aval.shape[1]} "
                           f"tokens; half a shard is {c // 2})")
            sent[way] += int(np.prod(aval.shape))
    if not all(sent.values()):
        raise Fail(f"property 'K/V travel both ways' failed on example {p!r}: float elements sent per traced "
                   f"ppermute: {sent}")
    if sent["clockwise"] != sent["counter-clockwise"]:
        raise Fail(f"property 'both directions carry the same number of elements' failed on example {p!r}: {sent}")


def _check(sol, fn, p):
    mesh = make_mesh(p.n_hosts)
    spec = jax.P(None, "sp")
    ring = jax.jit(jax.shard_map(partial(fn, axis_name="sp", causal=p.causal), mesh=mesh, in_specs=(spec,) * 3,
                                 out_specs=spec, check_vma=False))
    q, k, v = (jnp.asarray(x) for x in (p.q, p.k, p.v))
    jaxpr = sol.call("bidirectional_ring_attention_shard", lambda: jax.make_jaxpr(ring)(q, k, v), example=p)
    _check_traffic(jaxpr.jaxpr, p)  # from the traced program: no compile needed
    got = sol.call("bidirectional_ring_attention_shard", lambda: jax.block_until_ready(ring(q, k, v)), example=p)
    got = check_array("the output", got, p.q.shape, np.float64, p)
    check_close("o", got, attention(p.q, p.k, p.v, causal=p.causal), TOL,
                "the output is the float64 oracle's", p)


def check(sol):
    forbid(sol, "ringattn_fast.ring", "ringattn_ref.ring")
    fn = sol.function("bidirectional_ring_attention_shard",
                      "bidirectional_ring_attention_shard(q, k, v, *, axis_name, causal) -> o")
    # drawn as zigzag only for an even shard (halves); the lab's ring is contiguous
    for_all_rings(lambda p: _check(sol, fn, p), examples=EXAMPLES, min_hosts=3)
    ok("exact vs the float64 oracle; half of each shard each way, balanced", EXAMPLES)
    return "the bidirectional ring is exact and sends half of each K/V shard each way"
