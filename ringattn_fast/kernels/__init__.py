"""Pallas kernels for one ring hop (docs/design.md, "Per-hop contract").

Modules (imported on demand, never here, so that importing the package does not pull in Pallas):
  ``pallas_gpu``  Triton backend (GPU; interpreted on CPU), ``hop_fwd`` / ``hop_bwd``;
  ``pallas_tpu``  Mosaic TPU backend (TPU; interpreted on CPU), ``hop_fwd`` / ``hop_bwd``;
  ``tiles``       masks, tile skipping and argument checks shared by both.
"""
