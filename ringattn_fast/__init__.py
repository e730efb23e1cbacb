"""ringattn_fast — Ring Attention for real: jax.shard_map + lax.ppermute, custom VJP, Pallas kernels.

Reading order, following ``q`` from the public function to a kernel and back:
``ring`` (``ring_attention`` / ``ring_attention_shard``) -> ``front`` (the front door: every call is
validated once and becomes a ``HostInputs``; global arrays are padded, laid out and sharded) -> ``ring``
(``attend``: the ``custom_vjp`` and the forward ring) -> ``schedule`` (what stays, what travels:
``QShard``, ``KVShard``; ``ring_loop``, positions) -> ``dispatch`` (``impl=``) -> ``kernels/`` (``xla``,
``pallas_gpu``, ``pallas_tpu``, ``pallas_tpu_fused``) -> ``masks`` and ``softmax.merge`` -> ``backward``
(the backward ring). Beside the ring: ``mesh``, ``layouts``, ``feedforward``, ``padding`` (any sequence
length), ``packing`` (``cu_seqlens``), ``comm`` (``comm_dtype``: K/V in bfloat16/float8 on the wire).
The two other strategies, on the same front door and hop code: ``allgather`` (``allgather_attention``)
and ``ulysses`` (``ulysses_attention``), and ``hybrid`` (``hybrid_attention``: Ulysses inside groups, the
ring across them, on a 2-D mesh). In a model:
``jax_nn.dot_product_attention`` (``jax.nn``'s twin) and ``flax_adapter.flax_attention_fn`` (an
``attention_fn`` for Flax's attention modules).
Serving: ``inference`` (a sequence-sharded KV cache, ring prefill, decode with an all-reduce merge).
"""
from ._compat import check_jax

check_jax()  # an ImportError naming the JAX needed, before any module reaches for a newer API

from .feedforward import blockwise_feedforward
from .flax_adapter import flax_attention_fn
from .inference import KVCache, decode_step, init_cache, prefill
from .jax_nn import dot_product_attention
from .layouts import from_layout, to_layout
from .mesh import make_mesh
from .packing import positions_from_segment_ids, segment_ids_from_cu_seqlens
from .padding import pad_for_ring
from .ring import ring_attention, ring_attention_shard
from .softmax import merge
from .allgather import allgather_attention, allgather_attention_shard
from .ulysses import ulysses_attention, ulysses_attention_shard
from .hybrid import hybrid_attention, hybrid_attention_shard

__all__ = ["blockwise_feedforward", "dot_product_attention", "flax_attention_fn", "from_layout", "make_mesh",
           "merge", "pad_for_ring", "positions_from_segment_ids", "ring_attention", "ring_attention_shard",
           "segment_ids_from_cu_seqlens", "to_layout"]
__all__ += ["KVCache", "decode_step", "init_cache", "prefill"]
__all__ += ["allgather_attention", "allgather_attention_shard", "ulysses_attention", "ulysses_attention_shard"]
__all__ += ["hybrid_attention", "hybrid_attention_shard"]
