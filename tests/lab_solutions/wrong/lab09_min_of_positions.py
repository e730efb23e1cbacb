"""Wrong (lab09): a mask that is not elementwise. It finds the document's start as the smallest key
position it is given (``k_pos.min()``): right on the whole grid, wrong when the ring calls it on one tile,
whose smallest key may lie past its document's start (the prefix then starts too late).

lab: lab09
expect: the library's ring with your mask_fn (called per tile) gives the oracle's output
"""
import numpy as np

from ringattn_ref.layouts import layout_permutation


def prefix_lm_documents(lengths, prefix):
    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = ends - np.asarray(lengths, np.int64)

    def mask_fn(q_pos, k_pos, q_seg, k_seg, head):
        q_doc = np.searchsorted(ends, q_pos, side="right")
        k_doc = np.searchsorted(ends, k_pos, side="right")
        # a reduction over the keys it is called with: 0 on the whole grid, a tile's first key in the ring
        start = np.maximum(starts[np.minimum(k_doc, len(starts) - 1)], k_pos.min())
        return (q_doc == k_doc) & ((k_pos <= q_pos) | (k_pos - start < prefix))
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
