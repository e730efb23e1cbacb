"""Wrong (lab02): asks the mask whether a hop is empty but leaves out the segment ids (documents): the
output is still exact (attend_kv_shard masks the documents inside the hop), but hops that no query may
see are computed, which the lab's skip must not do.

lab: lab02
expect: a hop is computed exactly when its mask is not provably empty
"""
from ringattn_ref.blockwise import attend_kv_shard, bias_tile
from ringattn_ref.masks import tile_is_empty


def ring_step(hosts, step, problem):
    n, hop = len(hosts), problem.hop
    last = step == n - 1
    if not last:
        for host in hosts:
            hosts[(host.my_idx + 1) % n].recv = host.held
    computed = []
    for host in hosts:
        qs, kv = host.qs, host.held.kv
        empty = tile_is_empty(qs.pos, kv.pos, None, None, causal=hop.causal, window=hop.window)  # no documents
        if not empty:
            kv = kv._replace(bias=bias_tile(problem.bias, qs.pos, kv.pos))
            attend_kv_shard((host.m, host.l, host.o), qs, kv, hop)
        computed.append(not empty)
    if not last:
        for host in hosts:
            host.held, host.recv = host.recv, None
    return computed
