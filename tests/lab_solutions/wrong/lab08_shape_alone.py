"""Wrong (lab08): measures every strategy (and reports it truthfully) but never reads ``memory_budget``:
it picks by shape alone, the all-gather for a short sequence, else Ulysses where the heads split over
the devices, else the ring. Right for the three scenarios whose budget follows the shape; wrong where
the budget decides (a long sequence with ample memory, a short one with room for the leanest only).

lab: lab08
expect: the simplest strategy that fits the budget
"""
from functools import partial

import jax

import ringattn_fast as rf

SHORT = 256  # tokens: "short enough to gather"


def attention(q, k, v, *, mesh, causal, strategy):
    fn = {"allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention, "ring": rf.ring_attention}[strategy]
    return fn(q, k, v, mesh=mesh, causal=causal)


def choose(shapes, *, mesh, causal, memory_budget):
    specs = [jax.ShapeDtypeStruct(s, "float32") for s in shapes]
    n, seq, heads = mesh.shape["sp"], shapes[0][1], shapes[0][2]
    measured = {}
    for strategy in ("allgather", "ulysses", "ring"):
        if strategy == "ulysses" and heads % n:
            continue
        program = jax.jit(partial(attention, mesh=mesh, causal=causal, strategy=strategy)).lower(*specs)
        measured[strategy] = program.compile().memory_analysis().temp_size_in_bytes
    if seq <= SHORT:
        return "allgather", measured
    return ("ulysses" if heads % n == 0 else "ring"), measured
