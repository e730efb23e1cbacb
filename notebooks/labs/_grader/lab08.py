"""Grader of lab 8: choose a sequence-parallel strategy by measuring, and meet a memory budget.

Parent: five scenarios on 8 devices (float32, causal) and, for each, the per-device scratch memory
(``memory_analysis().temp_size_in_bytes``) of the library's three compiled programs
(``ringattn_fast.allgather_attention``, ``ulysses_attention``, ``ring_attention``), from which it sets
a budget: ample (everything fits), between Ulysses and the all-gather, and between the ring and the
all-gather with a head count Ulysses cannot split; then the same shapes again where the budget, not
the shape, decides: the long sequence with ample memory (the all-gather fits after all) and the short
sequence with room for only the leanest program. So a ``choose`` that never reads ``memory_budget``
and picks by shape alone fails. Child: calls the student's ``choose`` (which
measures the candidates itself) and exports ``attention`` with the strategy chosen. Parent: the
student's compiled program must fit the budget, use the chosen strategy's collectives and compute
the oracle's output; the choice must be the simplest strategy that fits (all-gather, then Ulysses,
then the ring: fewest collective steps first, notebook 13), and the memory ``choose`` reports must be
what the compiled programs need.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

import numpy as np

from .common import Fail, check_array, check_close, ok

ALLOWED = ("ringattn_fast.ring.ring_attention", "ringattn_fast.allgather.allgather_attention",
           "ringattn_fast.ulysses.ulysses_attention", "ringattn_fast.mesh.make_mesh")
FUNCTIONS = {"attention": "attention(q, k, v, *, mesh, causal, strategy) -> o",
             "choose": "choose(shapes, *, mesh, causal, memory_budget) -> (strategy, {strategy: bytes})"}
STRATEGIES = ("allgather", "ulysses", "ring")  # simplest first: 1 collective step, 4 all-to-alls, N - 1 steps
COLLECTIVE = {"allgather": "all-gather", "ulysses": "all-to-all", "ring": "collective-permute"}
DEVICES = 8
TOL = 1e-4  # float32 against the float64 oracle


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: tuple  # (batch, seq, heads, kv_heads, dim)
    budget: int
    measured: tuple  # ((strategy, temp bytes), ...) of the library's programs, measured here

    def __repr__(self):
        b, s, h, hk, d = self.shape
        return (f"{self.name}(batch={b}, seq={s}, heads={h}, kv_heads={hk}, dim={d}, devices={DEVICES}, "
                f"memory_budget={self.budget} bytes)")


def _shapes(shape):
    b, s, h, hk, d = shape
    return [(b, s, h, d), (b, s, hk, d), (b, s, hk, d)]


@functools.cache
def _measure(shape):
    """Per-device scratch bytes of each library strategy's compiled forward (Ulysses only if h % N == 0);
    once per shape (the scenarios that vary only the budget share it)."""
    import jax

    import ringattn_fast as rf

    mesh = rf.make_mesh(DEVICES)
    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in _shapes(shape)]
    fns = {"allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention, "ring": rf.ring_attention}
    out = {}
    for name in STRATEGIES:
        if name == "ulysses" and shape[2] % DEVICES:
            continue
        compiled = jax.jit(partial(fns[name], mesh=mesh, causal=True)).lower(*specs).compile()
        out[name] = int(compiled.memory_analysis().temp_size_in_bytes)
    return out


def scenarios():
    short = (1, 256, 8, 8, 16)
    m = _measure(short)
    yield Scenario("short sequence, ample memory", short, 2 * max(m.values()), tuple(m.items()))
    long_mha = (1, 1024, 8, 8, 16)
    m = _measure(long_mha)
    budget = int(np.sqrt(m["ulysses"] * m["allgather"]))  # Ulysses fits, the all-gather does not
    yield Scenario("long sequence, 8 heads", long_mha, budget, tuple(m.items()))
    long_gqa = (1, 1024, 6, 2, 16)
    m = _measure(long_gqa)
    budget = int(np.sqrt(m["ring"] * m["allgather"]))  # the ring fits, the all-gather does not; no Ulysses
    yield Scenario("long sequence, 6 heads on 8 devices", long_gqa, budget, tuple(m.items()))
    # the budget decides, not the shape: the shapes above again
    m = _measure(long_mha)
    yield Scenario("long sequence, 8 heads, ample memory", long_mha, 2 * max(m.values()), tuple(m.items()))
    m = _measure(short)
    lean, second = sorted(m.values())[:2]
    yield Scenario("short sequence, tight memory", short, (lean + second) // 2, tuple(m.items()))  # the leanest only


def build(tasks):
    plan = [(sc, tasks.add("choose", shapes=_shapes(sc.shape), budget=sc.budget, example=repr(sc)))
            for sc in scenarios()]

    def verify(results):
        from ringattn_ref.attention import attention

        from .programs import Program

        reasons = []
        for sc, task in plan:
            out = results.arrays(task)
            index = int(out.get("strategy", np.array(-1)))
            if not 0 <= index < len(STRATEGIES):
                raise Fail(f"choose did not return one of {STRATEGIES} on example {sc!r}")
            chosen = STRATEGIES[index]
            prog = Program(out["program"].tobytes(), f"attention(strategy={chosen!r})", DEVICES, sc)
            if prog.temp_bytes > sc.budget:
                raise Fail(f"property 'the program fits the memory budget (measured)' failed on example {sc!r}: "
                           f"attention with {chosen!r} needs {prog.temp_bytes} bytes of scratch per device")
            if not prog.count(COLLECTIVE[chosen]):
                raise Fail(f"property 'attention runs the strategy chosen' failed on example {sc!r}: {chosen!r} was "
                           f"chosen but the program has no {COLLECTIVE[chosen]} (it has "
                           f"{sorted({c.opcode for c in prog.collectives})})")
            rng = np.random.default_rng(sum(sc.shape))
            q, k, v = (rng.standard_normal(s).astype(np.float32) for s in _shapes(sc.shape))
            got = check_array("attention's output", prog(q, k, v)[0], q.shape, np.float32, sc)
            want = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
            check_close("o", got, want, TOL, "attention's output is the float64 oracle's", sc)
            measured = dict(sc.measured)
            fits = [s for s in STRATEGIES if s in measured and measured[s] <= sc.budget]
            if chosen != fits[0]:
                raise Fail(f"property 'the simplest strategy that fits the budget' failed on example {sc!r}: chose "
                           f"{chosen!r}; measured scratch bytes {measured}, so {fits[0]!r} (all-gather, then "
                           f"Ulysses, then the ring) fits")
            reported = {s: int(out[f"bytes_{s}"]) for s in STRATEGIES if f"bytes_{s}" in out}
            for s, nbytes in measured.items():
                if reported.get(s) != nbytes:
                    raise Fail(f"property 'choose reports what the compiled programs need' failed on example "
                               f"{sc!r}: for {s!r} it reports {reported.get(s)} bytes, the compiled program needs "
                               f"{nbytes}")
            reasons.append(f"{sc.name}: {chosen}")
        ok("the chosen strategy fits the budget (measured), runs its own collectives, is exact, is the simplest "
           "that fits, and choose's measurements are the compiled programs'", len(plan))
        return "; ".join(reasons)

    return verify


# ---- child side ----------------------------------------------------------------------------------------------

def _choose(sol, a, params):
    import jax

    from ringattn_fast import make_mesh

    from .child import export

    choose = sol.function("choose", FUNCTIONS["choose"])
    attention = sol.function("attention", FUNCTIONS["attention"])
    mesh = make_mesh(DEVICES)
    shapes = [tuple(s) for s in params["shapes"]]
    res = sol.call("choose", choose, shapes, mesh=mesh, causal=True, memory_budget=params["budget"],
                   example=params["example"])
    if not isinstance(res, tuple) or len(res) != 2 or res[0] not in STRATEGIES or not isinstance(res[1], dict):
        raise Fail(f"choose returned {res!r:.120}; expected (one of {STRATEGIES}, {{strategy: bytes}}) on example "
                   f"{params['example']}")
    strategy, measured = res
    prog = jax.jit(partial(attention, mesh=mesh, causal=True, strategy=strategy))
    blob = sol.call("attention", lambda: export(prog, [(s, np.float32) for s in shapes]), example=params["example"])
    out = {"strategy": np.array(STRATEGIES.index(strategy)), "program": np.frombuffer(blob, np.uint8)}
    for s, nbytes in measured.items():
        if s in STRATEGIES and isinstance(nbytes, (int, np.integer)):
            out[f"bytes_{s}"] = np.array(int(nbytes))
    return out


CHILD = {"choose": _choose}
