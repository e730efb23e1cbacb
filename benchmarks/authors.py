"""The authors' ``ringattention`` 0.1.2 (PyPI), made importable under today's JAX: a benchmark peer only.

Why the stand-ins exist: the package predates jax 0.8 and, at import,

- calls ``jax.lib.xla_bridge.get_backend()``, which JAX has removed: a stand-in answering
  ``platform = jax.default_backend()`` is installed when it is missing;
- imports ``flax`` for its blockwise FFN only: when flax is absent, empty stand-in modules
  ``flax``, ``flax.linen`` and ``flax.linen.partitioning`` let it import (the ring path that
  ``benchmarks.bench`` calls never touches flax).

Both patch global state (``jax.lib``, ``sys.modules``) of the benchmark's own process, which is why
they live here and never in ``ringattn_ref`` / ``ringattn_fast``; the libraries and the tests do not
import this module.
"""
from __future__ import annotations

import importlib.util
import sys
import types


def install_get_backend():
    """Give ``jax.lib.xla_bridge`` a ``get_backend()`` if this JAX has none (removed in jax 0.8)."""
    import jax

    bridge = getattr(jax.lib, "xla_bridge", None)
    if bridge is None or not hasattr(bridge, "get_backend"):
        jax.lib.xla_bridge = types.SimpleNamespace(
            get_backend=lambda: types.SimpleNamespace(platform=jax.default_backend()))


def install_flax_stubs():
    """Empty ``flax``, ``flax.linen``, ``flax.linen.partitioning`` modules, if flax is not installed."""
    if importlib.util.find_spec("flax") is not None:
        return
    for name in ("flax", "flax.linen", "flax.linen.partitioning"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["flax"].linen = sys.modules["flax.linen"]
    sys.modules["flax.linen"].partitioning = sys.modules["flax.linen.partitioning"]


def import_ring_attention():
    """The authors' ``ringattention_jax`` (their ring attention, one host's shards inside ``shard_map``),
    imported with the stand-ins above; None if the package is not installed."""
    if importlib.util.find_spec("ringattention") is None:
        return None
    install_get_backend()
    install_flax_stubs()
    from ringattention import ringattention_jax
    return ringattention_jax
