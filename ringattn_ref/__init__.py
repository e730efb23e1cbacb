"""ringattn_ref — a readable float64 numpy simulation of Ring Attention (arXiv:2310.01889).

Reading order: ``attention`` (the oracle) -> ``softmax`` (online softmax, merge) -> ``masks`` ->
``blockwise`` (BPT on one device) -> ``layouts`` -> ``ring`` (N virtual hosts) -> ``backward`` ->
``feedforward`` -> ``cost`` -> ``viz`` -> ``testing``.

Names are imported lazily so ``import ringattn_ref`` is instant and each module stands alone.
"""
from importlib import import_module

# The function ``attention`` shares its name with its module. Importing the submodule (which any
# other module here does) sets the package attribute ``attention`` to the *module*, and a lazy
# ``__getattr__`` is then never consulted. Import it eagerly so the name is always the function.
from .attention import attention  # noqa: E402

_EXPORTS = {
    "attention": "attention",
    "merge": "softmax",
    "to_layout": "layouts",
    "from_layout": "layouts",
    "layout_permutation": "layouts",
    "blockwise_attention": "blockwise",
    "hop_attention": "blockwise",
    "attention_problems": "testing",
    "AttentionProblem": "testing",
    "ring_attention": "ring",
    "RingTrace": "ring",
    "ring_attention_vjp": "backward",
    "hop_attention_vjp": "backward",
    "blockwise_feedforward": "feedforward",
    "relu_ffn": "feedforward",
    "HARDWARE": "cost",
    "step_flops": "cost",
    "step_bytes": "cost",
    "min_block_size": "cost",
    "hop_times": "cost",
    "table1": "cost",
    "table2": "cost",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
