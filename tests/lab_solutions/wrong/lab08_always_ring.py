"""Wrong (lab08): the ring always: it fits every budget, but where the all-gather fits it is simpler.

lab: lab08
expect: the simplest strategy that fits the budget
"""
import ringattn_fast as rf


def attention(q, k, v, *, mesh, causal, strategy):
    return rf.ring_attention(q, k, v, mesh=mesh, causal=causal)


def choose(shapes, *, mesh, causal, memory_budget):
    return "ring", {}
