"""ringattn_fast — Ring Attention for real: jax.shard_map + lax.ppermute, custom VJP, Pallas kernels."""
