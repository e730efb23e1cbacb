"""Wrong (lab08): asks the library's cost model to choose (ringattn_ref.choose_strategy).

lab: lab08
expect: calls ringattn_ref.strategy_cost.choose_strategy
"""
import ringattn_fast as rf
import ringattn_ref


def attention(q, k, v, *, mesh, causal, strategy):
    fn = {"allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention, "ring": rf.ring_attention}[strategy]
    return fn(q, k, v, mesh=mesh, causal=causal)


def choose(shapes, *, mesh, causal, memory_budget):
    (b, s, h, d), (_, _, hk, _) = shapes[0], shapes[1]
    choice = ringattn_ref.choose_strategy(seq=s, heads=h, kv_heads=hk, dim=d, devices=mesh.shape["sp"],
                                          hardware="TPU v4", memory_limit_bytes=memory_budget)
    return choice.strategy, {}
