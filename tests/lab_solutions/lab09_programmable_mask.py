"""Lab 9 reference solution: a packed prefix-LM document mask, and the block mask of a ring."""
import numpy as np

from ringattn_ref.layouts import layout_permutation


def prefix_lm_documents(lengths, prefix):
    ends = np.cumsum(np.asarray(lengths, np.int64))  # document i ends before ends[i]
    starts = ends - np.asarray(lengths, np.int64)

    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        q_doc = np.searchsorted(ends, q_pos, side="right")  # elementwise: a constant table, looked up
        k_doc = np.searchsorted(ends, k_pos, side="right")
        start = starts[np.minimum(k_doc, len(starts) - 1)]
        in_prefix = (k_pos - start < prefix)
        return (q_doc == k_doc) & ((k_pos <= q_pos) | in_prefix)
    return mask_fn


def block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv):
    pos = np.asarray(layout_permutation(layout, seq_len, n_hosts))
    c = seq_len // n_hosts
    nq, nk = c // block_q, c // block_kv
    zero = np.zeros((1, 1, 1, 1), np.int64)
    kinds = np.zeros((n_hosts, n_hosts, nq, nk), np.int8)
    for i in range(n_hosts):
        q = pos[i * c:(i + 1) * c]
        for j in range(n_hosts):
            k = pos[j * c:(j + 1) * c]
            seen = np.broadcast_to(mask_fn(q[None, None, :, None], k[None, None, None, :], zero, zero, zero),
                                   (1, 1, c, c))[0, 0]
            tiles = seen.reshape(nq, block_q, nk, block_kv)
            kinds[i, j] = np.where(tiles.all(axis=(1, 3)), 1, np.where(tiles.any(axis=(1, 3)), 2, 0))
    hops = np.array([[kinds[i, (i - t) % n_hosts].any() for t in range(n_hosts)] for i in range(n_hosts)])
    return kinds, hops
