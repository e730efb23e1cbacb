"""What goes on the wire: K/V sent in a narrower dtype (``comm_dtype``), dK/dV in ``grad_comm_dtype``.

The ring (and the all-gather) move K/V ``N - 1`` times per pass; in float32 that is 4 bytes per
element, the hop's compute accumulates in float32 whatever the inputs. With
``comm_dtype="bfloat16"`` each host rounds its own K/V shard to bfloat16 **once, at home**, and that
rounded shard is what travels and what every hop (its own included) reads, widened back to the
input dtype: the result is exactly attention on ``K, V`` rounded to bfloat16, accumulated in
float32, at half the bytes. ``"float8_e4m3fn"`` / ``"float8_e5m2"`` send a quarter of the bytes: the
shard is divided by a per-shard scale first (one float per batch row and kv head of the shard:
``amax / dtype max``, so the shard's largest value lands at the top of the float8 range) and the
scale travels with it (:class:`Wire`). Gradients pass straight through the rounding (those of
attention on the rounded K/V), so the forward and the backward agree.

``grad_comm_dtype`` (default None: the float32/64 accumulators as they are) rounds the dK/dV
accumulators to that dtype before each send; the receiver keeps accumulating in float32, so the
rounding happens ``N`` times along the ring (once per contribution in the all-gather, which sums the
received shards in float32). Errors measured: ``docs/benchmarks.md``, "bfloat16 on the wire".
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from .softmax import acc_dtype

COMM_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
GRAD_COMM_DTYPES = ("bfloat16", "float16", "float32")
SCALED = ("float8_e4m3fn", "float8_e5m2")  # too little range without a scale
UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@partial(jax.tree_util.register_dataclass, data_fields=["kv", "k_scale", "v_scale"], meta_fields=["dtype", "packed"])
@dataclasses.dataclass(frozen=True)
class Wire:
    """A K/V shard as sent: ``kv`` (a ``schedule.KVShard``) with k, v holding the bits of their values in
    ``dtype`` (the comm dtype's name, or None: the values as they are; static, not a leaf), and for float8
    the per-shard scales ``k_scale, v_scale`` [b, shards, hk, 1] (one per shard; after an all-gather,
    ``shards = N``), else None. ``packed``: k holds K and V stacked, ``[2, b, s, hk, d]``, and v is None."""
    kv: object
    dtype: str | None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    packed: bool = False


def gather(x, axis_name, axis):
    """``x`` of every host concatenated along ``axis`` (a tiled all-gather); None stays None."""
    return None if x is None else lax.all_gather(x, axis_name, axis=axis, tiled=True)


def check_comm_dtype(comm_dtype, name="comm_dtype", allowed=COMM_DTYPES):
    """None, or the dtype's name (a str, hashable for a static config); a ValueError naming the rest."""
    if comm_dtype is None:
        return None
    try:
        dtype = jnp.dtype(comm_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in allowed:
        raise ValueError(f"{name} must be None or one of {allowed}; got {comm_dtype!r}")
    return dtype.name


def _scaled(x, dtype):
    """``(x / scale).astype(dtype), scale``: scale [b, 1, hk, 1] maps the shard's largest finite |x| to
    the dtype's largest value (a marked key's NaN K stays NaN: ``masks.mark_bad_keys``)."""
    acc = acc_dtype(x.dtype)
    amax = jnp.abs(jnp.where(jnp.isfinite(x), x, 0)).astype(acc).max(axis=(1, 3), keepdims=True)  # (b, 1, hk, 1)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0).astype(acc)
    return (x.astype(acc) / scale).astype(dtype), scale


def as_bits(x):
    """x's bits as unsigned ints of its width: XLA CPU moves a float convert that follows a
    collective-permute in front of it (the compiled ring then sent float32 again, measured); it cannot
    move one across a bitcast, so what travels stays 2 (1) bytes per element."""
    return lax.bitcast_convert_type(x, UINT_OF_WIDTH[x.dtype.itemsize])


def encode(kv, comm_dtype, pack=False):
    """This host's (already marked) K/V shard in its wire format: a :class:`Wire` (``kv`` itself when
    ``comm_dtype`` is None and not ``pack``); k, v as the bits of their ``comm_dtype`` values.

    ``pack``: K and V stacked into one array where their shapes and dtypes agree, so that a ring step
    sends them as one transfer. With K and V apart XLA:TPU scheduled some of a v6e ring's K/V sends
    after the hop's kernel (``benchmarks/overlap.py``); stacked once at home, they travel and are read
    in place (a hop reads ``k[0]``, ``k[1]``), with no copy per step."""
    if comm_dtype is None and not pack:
        return kv
    k_scale = v_scale = None
    if comm_dtype is None:
        k, v = kv.k, kv.v
    elif comm_dtype in SCALED:
        (k, k_scale), (v, v_scale) = _scaled(kv.k, comm_dtype), _scaled(kv.v, comm_dtype)
        k, v = as_bits(k), as_bits(v)
    else:
        k, v = as_bits(kv.k.astype(comm_dtype)), as_bits(kv.v.astype(comm_dtype))
    if pack and k.shape == v.shape and k.dtype == v.dtype:
        return Wire(kv._replace(k=jnp.stack([k, v]), v=None), comm_dtype, k_scale, v_scale, packed=True)
    return Wire(kv._replace(k=k, v=v), comm_dtype, k_scale, v_scale)


def _unscale(x, scale, dtype):
    """x [b, s, hk, d] times its shards' scales [b, shards, hk, 1] (``s / shards`` tokens per shard)."""
    b, s, hk, d = x.shape
    shards = scale.shape[1]
    x = x.astype(scale.dtype).reshape(b, shards, s // shards, hk, d) * scale[:, :, None]
    return x.reshape(b, s, hk, d).astype(dtype)


def decode(wire, dtype):
    """The ``KVShard`` a hop reads: k, v widened back to ``dtype`` (the inputs' dtype)."""
    if not isinstance(wire, Wire):
        return wire
    kv = wire.kv
    k, v = (kv.k[0], kv.k[1]) if wire.packed else (kv.k, kv.v)
    if wire.dtype is None:
        return kv._replace(k=k, v=v)
    k, v = (lax.bitcast_convert_type(x, wire.dtype) for x in (k, v))
    if wire.k_scale is None:
        return kv._replace(k=k.astype(dtype), v=v.astype(dtype))
    return kv._replace(k=_unscale(k, wire.k_scale, dtype), v=_unscale(v, wire.v_scale, dtype))


def sent_as(send, x, dtype):
    """``send(x)`` with every leaf narrowed to ``dtype`` on the wire and widened back to its own dtype on
    arrival (``dtype`` None: sent as it is). ``send``: a collective, e.g. ``schedule.send_to_next``."""
    if dtype is None:
        return send(x)
    received = send(jax.tree.map(lambda g: as_bits(g.astype(dtype)), x))
    return jax.tree.map(lambda r, g: lax.bitcast_convert_type(r, dtype).astype(g.dtype), received, x)
