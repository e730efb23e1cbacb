"""Lab 2 reference solution: one step of the virtual ring (Ring Attention, Algorithm 1)."""
from ringattn_ref.blockwise import attend_kv_shard, bias_tile
from ringattn_ref.masks import tile_is_empty


def ring_step(hosts, step, problem):
    n, hop = len(hosts), problem.hop
    last = step == n - 1
    if not last:  # post the sends first: they overlap the compute on hardware
        for host in hosts:
            hosts[(host.my_idx + 1) % n].recv = host.held
    computed = []
    for host in hosts:
        qs, kv = host.qs, host.held.kv
        empty = tile_is_empty(qs.pos, kv.pos, qs.seg, kv.seg, causal=hop.causal, window=hop.window)
        if not empty:
            kv = kv._replace(bias=bias_tile(problem.bias, qs.pos, kv.pos))
            attend_kv_shard((host.m, host.l, host.o), qs, kv, hop)
        computed.append(not empty)
    if not last:
        for host in hosts:
            host.held, host.recv = host.recv, None
    return computed
