"""ringattn_fast — Ring Attention for real: jax.shard_map + lax.ppermute, custom VJP, Pallas kernels.

Reading order, following ``q`` from the public function to a kernel and back:
``ring`` (``ring_attention`` -> ``ring_attention_shard`` -> the ``custom_vjp`` and the forward ring)
-> ``schedule`` (what stays, what travels: ``QShard``, ``KVShard``; ``ring_loop``, positions)
-> ``dispatch`` (``impl=``) -> ``hop`` (one hop in XLA) or ``kernels/`` (Pallas) -> ``masks`` and
``softmax.merge`` -> ``backward`` (the backward ring). Beside the ring: ``mesh``, ``layouts``,
``feedforward``.
"""
from .feedforward import blockwise_feedforward
from .layouts import from_layout, to_layout
from .mesh import make_mesh
from .ring import ring_attention, ring_attention_shard
from .softmax import merge

__all__ = ["blockwise_feedforward", "from_layout", "make_mesh", "merge", "ring_attention",
           "ring_attention_shard", "to_layout"]
