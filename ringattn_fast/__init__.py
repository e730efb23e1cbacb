"""ringattn_fast — Ring Attention for real: jax.shard_map + lax.ppermute, custom VJP, Pallas kernels.

Reading order: ``mesh`` -> ``masks`` -> ``softmax`` (merge) -> ``hop`` (one hop, XLA) -> ``ring``
(forward, public API) -> ``ring_vjp`` (backward ring) -> ``layouts`` -> ``dispatch`` (``impl=``) ->
``feedforward`` -> ``bench``. Names are imported lazily: ``import ringattn_fast`` imports no kernel
(and not even JAX) until a name is used.
"""
from importlib import import_module

_EXPORTS = {
    "make_mesh": "mesh",
    "ring_attention": "ring",
    "ring_attention_shard": "ring",
    "to_layout": "layouts",
    "from_layout": "layouts",
    "merge": "softmax",
    "blockwise_feedforward": "feedforward",
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
