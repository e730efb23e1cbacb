"""Wrong (lab09): the prefix counted from position 0, not from each document's start: only the first
document is a prefix-LM, the others are plain causal.

lab: lab09
expect: the mask is the packed prefix-LM documents' mask
"""
import numpy as np

from ringattn_ref.layouts import layout_permutation


def prefix_lm_documents(lengths, prefix):
    ends = np.cumsum(np.asarray(lengths, np.int64))

    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        same = np.searchsorted(ends, q_pos, side="right") == np.searchsorted(ends, k_pos, side="right")
        return same & ((k_pos <= q_pos) | (k_pos < prefix))
    return mask_fn


def block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv):
    pos = np.asarray(layout_permutation(layout, seq_len, n_hosts))
    c = seq_len // n_hosts
    zero = np.zeros((1, 1, 1, 1), np.int64)
    kinds = np.zeros((n_hosts, n_hosts, c // block_q, c // block_kv), np.int8)
    for i in range(n_hosts):
        for j in range(n_hosts):
            q, k = pos[i * c:(i + 1) * c], pos[j * c:(j + 1) * c]
            seen = np.broadcast_to(mask_fn(q[None, None, :, None], k[None, None, None, :], zero, zero, zero),
                                   (1, 1, c, c))[0, 0].reshape(c // block_q, block_q, c // block_kv, block_kv)
            kinds[i, j] = np.where(seen.all(axis=(1, 3)), 1, np.where(seen.any(axis=(1, 3)), 2, 0))
    hops = np.array([[kinds[i, (i - t) % n_hosts].any() for t in range(n_hosts)] for i in range(n_hosts)])
    return kinds, hops
