"""ringattn_ref — a readable float64 numpy simulation of Ring Attention (arXiv:2310.01889).

Reading order: ``attention`` (the oracle) -> ``softmax`` (online softmax, merge) -> ``masks`` ->
``shards`` (what stays, what travels: ``QShard``, ``KVShard``, ``HopConfig``) -> ``blockwise`` (BPT on one device) -> ``layouts`` -> ``ring`` (N virtual hosts) -> ``backward`` ->
``feedforward`` -> ``cost`` -> ``viz`` -> ``testing``; ``packing`` for packed documents;
``strategies`` (all-gather and Ulysses beside the ring) -> ``hybrid`` (Ulysses inside groups, the ring
across them) -> ``strategy_cost`` (which one to use, and the hybrid's split).
Serving: ``inference`` (a KV cache over the hosts, ring prefill, decode with a merge tree).
Programming attention: ``variants`` (mask and score functions of true positions; the oracle takes
``mask_fn``, ``score_fn``, ``logit_softcap``, ``sinks``, a value width of its own and ``t != s``; so does
the ring, ``sinks`` aside) -> ``block_mask`` (which tiles and hops a mask leaves empty, found before the ring)
-> ``balance`` (the work per host and step it leaves, the imbalance, and layouts that even it out).

Plain imports: every module needs only numpy (matplotlib and hypothesis are imported inside the
functions that use them), so importing all of them costs a few milliseconds beyond numpy.
"""
from . import variants
from .attention import attention
from .backward import backward_factors, hop_attention_vjp, ring_attention_vjp
from .balance import Balance, balanced_layout, imbalance, layout_block_mask, step_imbalance
from .block_mask import BlockMask, ring_block_mask, tile_kinds
from .blockwise import blockwise_attention, hop_attention
from .cost import HARDWARE, Hardware, hop_times, min_block_size, step_bytes, step_flops, table1, table2
from .feedforward import blockwise_feedforward, relu_ffn
from .hybrid import hybrid_attention, hybrid_splits, kv_repeat
from .inference import InferenceTrace, KVCache, decode_step, init_cache, prefill
from .layouts import Layout, as_layout, from_layout, layout_permutation, per_document_zigzag, to_layout
from .packing import positions_from_segment_ids, segment_ids_from_cu_seqlens
from .ring import RingTrace, ring_attention
from .shards import HopConfig, HopGrads, KVShard, QShard
from .softmax import merge
from .strategies import StrategyTrace, allgather_attention, ulysses_attention
from .strategy_cost import StrategyChoice, StrategyCost, choose_strategy, hybrid_bytes_sent, strategy_costs
from .testing import AttentionProblem, attention_problems

__all__ = ["AttentionProblem", "HARDWARE", "RingTrace", "attention", "attention_problems", "blockwise_attention",
           "blockwise_feedforward", "from_layout", "hop_attention", "hop_attention_vjp", "hop_times",
           "layout_permutation", "merge", "min_block_size", "positions_from_segment_ids", "relu_ffn",
           "ring_attention", "ring_attention_vjp", "segment_ids_from_cu_seqlens", "step_bytes", "step_flops",
           "table1", "table2", "to_layout",
           "StrategyChoice", "StrategyCost", "StrategyTrace", "allgather_attention", "choose_strategy",
           "strategy_costs", "ulysses_attention"]
__all__ += ["InferenceTrace", "KVCache", "decode_step", "init_cache", "prefill"]
__all__ += ["HopConfig", "HopGrads", "KVShard", "QShard"]
__all__ += ["BlockMask", "ring_block_mask", "tile_kinds"]
__all__ += ["Hardware", "hybrid_attention", "hybrid_bytes_sent", "hybrid_splits", "kv_repeat"]
__all__ += ["Balance", "Layout", "as_layout", "balanced_layout", "imbalance", "layout_block_mask",
            "per_document_zigzag", "step_imbalance"]
__all__ += ["backward_factors"]
