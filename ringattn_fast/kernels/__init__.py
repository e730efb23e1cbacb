"""Pallas kernels for one ring hop, and one for the whole ring (docs/design.md, "Per-hop contract").

Modules (imported by ``ringattn_fast.dispatch``, never here, so importing the package pulls in no
Pallas):

- ``pallas_gpu``: Triton backend (GPU; interpreted on CPU): ``hop_fwd`` / ``hop_bwd`` /
  ``fwd_tile_counts`` on ``(QShard, KVShard, HopConfig)``;
- ``pallas_tpu``: Mosaic TPU backend (TPU; interpreted on CPU), the same three functions;
- ``tpu_ring_fused``: the whole ring in one TPU kernel (remote DMA): ``fused_ring_attention_shard``;
- ``tiles``: what they share: tile bounds and schedules on ``masks.bounds_empty``, ``NEG_INF``,
  ``interpret_mode`` and the argument checks (``check_hop_args``, ``check_kernel_dtypes``).

K/V reach every kernel marked by ``masks.mark_bad_keys`` (the ring does it once, before the first hop);
what is left of the non-finite-key rule, ``masks.finite_part`` and ``masks.masked_grad``, the kernels
share with the XLA hop.
"""
