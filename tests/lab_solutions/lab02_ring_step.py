"""Lab 2 reference solution: one step of the virtual ring (Ring Attention, Algorithm 1)."""
from ringattn_ref.blockwise import attend_kv_block
from ringattn_ref.masks import tile_is_empty


def ring_step(hosts, step, problem):
    n = len(hosts)
    last = step == n - 1
    if not last:  # post the sends first: they overlap the compute on hardware
        for host in hosts:
            hosts[(host.my_idx + 1) % n].recv = host.held
    computed = []
    for host in hosts:
        kv = host.held
        empty = tile_is_empty(host.q_pos, kv.k_pos, host.q_seg, kv.k_seg, causal=problem.causal,
                              window=problem.window)
        if not empty:
            attend_kv_block((host.m, host.l, host.o), host.q, kv.k, kv.v, host.q_pos, kv.k_pos, host.q_seg,
                            kv.k_seg, problem.bias, scale=problem.scale, causal=problem.causal,
                            window=problem.window, block_q=problem.block_q, block_kv=problem.block_kv)
        computed.append(not empty)
    if not last:
        for host in hosts:
            host.held, host.recv = host.recv, None
    return computed
