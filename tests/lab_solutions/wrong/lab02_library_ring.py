"""Wrong (lab02): the library's own send and swap, reached through the package.

lab: lab02
expect: calls ringattn_ref.ring.send_to_next
"""
import ringattn_ref.ring
from ringattn_ref.blockwise import attend_kv_shard, bias_tile
from ringattn_ref.masks import tile_is_empty


def ring_step(hosts, step, problem):
    last, hop = step == len(hosts) - 1, problem.hop
    if not last:
        ringattn_ref.ring.send_to_next(hosts)
    computed = []
    for host in hosts:
        qs, kv = host.qs, host.held.kv
        empty = tile_is_empty(qs.pos, kv.pos, qs.seg, kv.seg, causal=hop.causal, window=hop.window)
        if not empty:
            attend_kv_shard((host.m, host.l, host.o), qs, kv._replace(bias=bias_tile(problem.bias, qs.pos, kv.pos)), hop)
        computed.append(not empty)
    if not last:
        ringattn_ref.ring.swap_buffers(hosts)
    return computed
