"""Ring Attention, backward: a ``jax.custom_vjp`` whose backward is a second ring.

The forward saves only ``q, k, v, o, lse`` (plus the int positions / segment ids and the bias, which
are inputs): ``O(S/N)`` per host. The backward recomputes every tile FlashAttention-2 style
(arXiv:2307.08691, Algorithm 2) with ``D = rowsum(dO * O)``, and runs the ring again (as the authors'
code does, arXiv:2310.01889): ``dQ`` stays on its host; ``dK, dV`` (float32/64 accumulators, and the
gradient of a key-only bias) travel *with* their K/V shard.

Message count: at step ``step`` host ``i`` holds K/V shard ``i - step`` and its gradient
accumulators; it adds its hop's contribution and sends both on. K/V are sent ``N - 1`` times (top of
each step but the last), dK/dV ``N`` times (after every step): after the last hop host ``i`` holds the
accumulators of shard ``i + 1`` and that ``N``-th send delivers every shard's gradient to its home.
A token that visits all ``N`` hosts and returns needs ``N`` moves, so no message is wasted and there
is no extra permute of K/V.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from . import masks
from .dispatch import hop_functions
from .hop import acc_dtype
from .mesh import varying_axes, vary_like
from .ring import hop_bias, ring_forward, ring_loop, ring_perm


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_core(cfg, q, k, v, pos, seg, bias):
    """Ring attention on this host (inside ``shard_map``): o ``[b, sq, h, d]`` in q's dtype."""
    o, _ = ring_forward(cfg, q, k, v, pos, seg, bias)
    return o.astype(q.dtype)


def _core_fwd(cfg, q, k, v, pos, seg, bias):
    o, lse = ring_forward(cfg, q, k, v, pos, seg, bias)
    o = o.astype(q.dtype)
    return o, (q, k, v, pos, seg, bias, o, lse)


def _core_bwd(cfg, res, do):
    q, k, v, pos, seg, bias, o, lse = res
    dq, dk, dv, dbias = ring_backward(cfg, q, k, v, pos, seg, bias, o, lse, do)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            None if bias is None else dbias.astype(bias.dtype))


ring_core.defvjp(_core_fwd, _core_bwd)


def ring_backward(cfg, q, k, v, pos, seg, bias, o, lse, do):
    """The backward ring on this host: ``(dq, dk, dv, dbias)`` in float32/64, dk/dv home."""
    hop_bwd = hop_functions(cfg.impl)[1]
    n, my_idx = lax.axis_size(cfg.axis_name), lax.axis_index(cfg.axis_name)
    sq = q.shape[1]
    acc = acc_dtype(q.dtype)
    skip = masks.can_be_empty(cfg.causal, cfg.window, seg is not None)
    axes = varying_axes(q, k, v, pos, seg, bias, o, lse, do)
    travel = cfg.bias_mode == "travel"
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(acc), o.astype(acc))  # FA-2's D, (b, h, sq)

    kv = (k, v, pos, seg, bias if travel else None)
    grads = (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc), jnp.zeros(bias.shape, acc) if travel else None)
    dq = jnp.zeros(q.shape, acc)
    dbias = jnp.zeros(bias.shape, acc) if bias is not None and not travel else None  # stays here

    def hop(step, kv, grads, dq, dbias):
        k_, v_, k_pos, k_seg, bias_t = kv
        kv_idx = (my_idx - step) % n

        def backward(grads, dq, dbias):
            dq_h, dk_h, dv_h, db_h = hop_bwd(q, k_, v_, do, lse, delta, pos, k_pos, seg, k_seg,
                                             hop_bias(cfg, bias, bias_t, kv_idx, sq), **cfg.hop_kwargs())
            dk, dv, dbias_t = grads
            if travel:
                dbias_t = dbias_t + db_h
            elif cfg.bias_mode == "columns":  # each block of key columns is visited exactly once
                dbias = lax.dynamic_update_slice_in_dim(dbias, db_h.astype(acc), kv_idx * sq, axis=3)
            elif cfg.bias_mode == "static":
                dbias = dbias + db_h
            return (dk + dk_h, dv + dv_h, dbias_t), dq + dq_h, dbias

        if skip:
            empty = masks.tile_is_empty(pos, k_pos, seg, k_seg, causal=cfg.causal, window=cfg.window)
            return lax.cond(empty, lambda *a: a, backward, grads, dq, dbias)
        return backward(grads, dq, dbias)

    def step_fn(carry, step):
        kv, grads, dq, dbias = carry
        kv_next = lax.ppermute(kv, cfg.axis_name, ring_perm(n))  # K/V: issued first, overlaps the hop
        grads, dq, dbias = hop(step, kv, grads, dq, dbias)
        grads = lax.ppermute(grads, cfg.axis_name, ring_perm(n))  # dK/dV follow their K/V shard
        return kv_next, grads, dq, dbias

    carry = (kv,) + vary_like((grads, dq, dbias), axes)
    kv, grads, dq, dbias = ring_loop(step_fn, carry, n)
    grads, dq, dbias = hop(n - 1, kv, grads, dq, dbias)
    if n > 1:
        grads = lax.ppermute(grads, cfg.axis_name, ring_perm(n))  # the N-th move: home
    dk, dv, dbias_t = grads
    return dq, dk, dv, dbias_t if travel else dbias
