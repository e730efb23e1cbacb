"""Wrong (lab09): a tile's kind from its four corner pairs only. Right for masks whose visible pairs
reach a tile's corners (causal, windows, documents that start at tile edges); wrong for a mask that
attends only inside a tile: it calls that tile, and maybe the whole hop, empty, and the ring would skip
pairs that attend.

lab: lab09
expect: block_mask's tile kinds are the library's block mask
"""
import numpy as np

from ringattn_ref.layouts import layout_permutation


def prefix_lm_documents(lengths, prefix):
    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = ends - np.asarray(lengths, np.int64)

    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        q_doc = np.searchsorted(ends, q_pos, side="right")
        k_doc = np.searchsorted(ends, k_pos, side="right")
        return (q_doc == k_doc) & ((k_pos <= q_pos) | (k_pos - starts[np.minimum(k_doc, len(starts) - 1)] < prefix))
    return mask_fn


def block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv):
    pos = np.asarray(layout_permutation(layout, seq_len, n_hosts))
    c = seq_len // n_hosts
    nq, nk = c // block_q, c // block_kv
    zero = np.zeros((1, 1, 1, 1), np.int64)
    kinds = np.zeros((n_hosts, n_hosts, nq, nk), np.int8)
    for i in range(n_hosts):
        for j in range(n_hosts):
            for a in range(nq):
                for b in range(nk):
                    q = pos[i * c + a * block_q:i * c + (a + 1) * block_q][[0, -1]]
                    k = pos[j * c + b * block_kv:j * c + (b + 1) * block_kv][[0, -1]]
                    seen = np.asarray(mask_fn(q[None, None, :, None], k[None, None, None, :], zero, zero, zero))
                    kinds[i, j, a, b] = 1 if seen.all() else 2 if seen.any() else 0
    hops = np.array([[kinds[i, (i - t) % n_hosts].any() for t in range(n_hosts)] for i in range(n_hosts)])
    return kinds, hops
