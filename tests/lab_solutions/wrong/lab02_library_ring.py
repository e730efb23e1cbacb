"""Wrong (lab02): the library's own send and swap, reached through the package.

lab: lab02
expect: calls ringattn_ref.ring.send_to_next
"""
import ringattn_ref.ring
from ringattn_ref.blockwise import attend_kv_block
from ringattn_ref.masks import tile_is_empty


def ring_step(hosts, step, problem):
    last = step == len(hosts) - 1
    if not last:
        ringattn_ref.ring.send_to_next(hosts)
    computed = []
    for host in hosts:
        kv = host.held
        empty = tile_is_empty(host.q_pos, kv.k_pos, host.q_seg, kv.k_seg, causal=problem.causal, window=problem.window)
        if not empty:
            attend_kv_block((host.m, host.l, host.o), host.q, kv.k, kv.v, host.q_pos, kv.k_pos, host.q_seg, kv.k_seg,
                            problem.bias, scale=problem.scale, causal=problem.causal, window=problem.window,
                            block_q=problem.block_q, block_kv=problem.block_kv)
        computed.append(not empty)
    if not last:
        ringattn_ref.ring.swap_buffers(hosts)
    return computed
