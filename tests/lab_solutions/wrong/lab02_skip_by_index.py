"""Wrong (lab02): skips a causal hop by the shards' numbers (``kv_idx > my_idx``: the contiguous layout's
rule) instead of asking the mask about the true positions. Right for contiguous causal rings; under the
striped and zigzag layouts no hop is empty, and a window or documents empty hops the rule never sees.

lab: lab02
expect: a hop is computed exactly when its mask is not provably empty
"""
from ringattn_ref.blockwise import attend_kv_shard, bias_tile


def ring_step(hosts, step, problem):
    n, hop = len(hosts), problem.hop
    last = step == n - 1
    if not last:
        for host in hosts:
            hosts[(host.my_idx + 1) % n].recv = host.held
    computed = []
    for host in hosts:
        qs, kv = host.qs, host.held.kv
        empty = bool(hop.causal) and host.held.kv_idx > host.my_idx  # by number, not by position
        if not empty:
            kv = kv._replace(bias=bias_tile(problem.bias, qs.pos, kv.pos))
            attend_kv_shard((host.m, host.l, host.o), qs, kv, hop)
        computed.append(not empty)
    if not last:
        for host in hosts:
            host.held, host.recv = host.recv, None
    return computed
