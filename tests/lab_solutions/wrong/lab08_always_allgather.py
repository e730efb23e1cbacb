"""Wrong (lab08): measures honestly, then takes the all-gather whatever the budget.

lab: lab08
expect: fits the memory budget (measured)
"""
from functools import partial

import jax

import ringattn_fast as rf


def attention(q, k, v, *, mesh, causal, strategy):
    fn = {"allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention, "ring": rf.ring_attention}[strategy]
    return fn(q, k, v, mesh=mesh, causal=causal)


def choose(shapes, *, mesh, causal, memory_budget):
    specs = [jax.ShapeDtypeStruct(s, "float32") for s in shapes]
    measured = {}
    for strategy in ("allgather", "ulysses", "ring"):
        if strategy == "ulysses" and shapes[0][2] % mesh.shape["sp"]:
            continue
        program = jax.jit(partial(attention, mesh=mesh, causal=causal, strategy=strategy)).lower(*specs)
        measured[strategy] = program.compile().memory_analysis().temp_size_in_bytes
    return "allgather", measured
