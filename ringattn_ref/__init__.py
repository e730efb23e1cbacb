"""ringattn_ref — a readable float64 numpy simulation of Ring Attention (arXiv:2310.01889).

Reading order: attention -> softmax -> masks -> blockwise -> layouts -> ring -> backward
-> feedforward -> cost -> viz -> testing.
"""
