"""Wrong (lab09): the library's block mask and prefix-LM instead of the student's own.

lab: lab09
expect: calls ringattn_ref.variants
"""
from ringattn_ref import variants
from ringattn_ref.block_mask import ring_block_mask


def prefix_lm_documents(lengths, prefix):
    docs, lm = variants.documents(lengths), variants.prefix_lm(prefix)
    return variants.both(docs, lm)


def block_mask(mask_fn, seq_len, n_hosts, *, layout, block_q, block_kv):
    bm = ring_block_mask(mask_fn, seq_len, n_hosts, layout=layout, block_q=block_q, block_kv=block_kv)
    return bm.tiles, bm.hops
