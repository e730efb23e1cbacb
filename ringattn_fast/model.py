"""A small decoder-only transformer whose every attention layer runs around the ring.

The model the course trains (``python -m examples.recall.train``, notebook 12): token embedding,
pre-norm blocks of RMSNorm -> grouped-query attention (rotary positions) -> RMSNorm -> SwiGLU
feedforward, a final RMSNorm and an untied output projection. The whole forward runs inside one
``jax.shard_map``: each host holds its shard of the (layout-ordered) tokens and *their true
positions*, the attention of every layer is :func:`~ringattn_fast.ring.ring_attention_shard`
(K/V travel around the ring, Ring Attention arXiv:2310.01889 Algorithm 1), and everything else is
position-wise, so it never leaves the host. The feedforward is blockwise
(:func:`~ringattn_fast.feedforward.blockwise_feedforward`, BPT arXiv:2305.19370 §3) and every
block is rematerialised (``jax.checkpoint``): the backward keeps one residual stream per layer.

Rotary embeddings (RoFormer, arXiv:2104.09864, eq. 34) rotate q and k by angles computed from the
token's true position, not its index in the shard, so a striped or zigzag layout, or packed documents
with their own positions, give the same model. Parameters are float32; ``compute_dtype=bfloat16``
casts weights and activations for the matmuls, while norms, the softmax statistics inside the ring
(float32 accumulators) and the logits stay float32.

``devices == 1`` may use plain dense attention (:func:`dense_attention`): the oracle the ring's
training curve is tested against.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from einops import repeat

from .feedforward import blockwise_feedforward
from .mesh import auto_mesh, call_auto, spec_of
from .ring import ring_attention_shard


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of the model (hashable: it is a static argument of the jitted step).

    - vocab, d_model, n_layers, n_heads, n_kv_heads (GQA: ``n_heads % n_kv_heads == 0``), d_ff
      (SwiGLU hidden width);
    - window: attention window ``(left, 0)`` or None (whole causal prefix): the "local" model;
    - compute_dtype: "float32" or "bfloat16" (parameters stay float32);
    - ffn_block: tokens per feedforward chunk (divides the host's shard);
    - rope_base: the rotary base ``theta`` of RoFormer.
    """
    vocab: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    window: tuple | None = None
    compute_dtype: str = "float32"
    ffn_block: int = 32
    rope_base: float = 10000.0

    def __post_init__(self):
        # Any spelling (np.float32, jnp.bfloat16, "float32", np.dtype...) becomes its name: equal dtypes give
        # equal (hashable) configs, so one compiled step; anything not a float is refused here, not in a trace.
        try:
            dtype = jnp.dtype(self.compute_dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16 (any spelling: 'float32', np.float32, "
                             f"jnp.bfloat16, np.dtype(...)); got {self.compute_dtype!r}")
        object.__setattr__(self, "compute_dtype", dtype.name)

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


def init_params(key, cfg):
    """float32 parameters: a dict of arrays, layer weights stacked on a leading ``n_layers`` axis.

    Jitted on the shapes alone (not the window or dtype): the ring and the one-shard model of a run
    share one compile (drawing ten normal arrays op by op would compile each op, seconds on a CPU).
    """
    return _init_params(key, vocab=cfg.vocab, d=cfg.d_model, L=cfg.n_layers, n_heads=cfg.n_heads,
                        n_kv_heads=cfg.n_kv_heads, hd=cfg.head_dim, d_ff=cfg.d_ff)


@partial(jax.jit, static_argnames=("vocab", "d", "L", "n_heads", "n_kv_heads", "hd", "d_ff"))
def _init_params(key, *, vocab, d, L, n_heads, n_kv_heads, hd, d_ff):
    ks = jax.random.split(key, 8)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5  # noqa: E731
    return {
        "embed": jax.random.normal(ks[0], (vocab, d), jnp.float32),
        "layers": {
            "attn_norm": jnp.ones((L, d), jnp.float32),
            "wq": normal(ks[1], (L, d, n_heads, hd), d),
            "wk": normal(ks[2], (L, d, n_kv_heads, hd), d),
            "wv": normal(ks[3], (L, d, n_kv_heads, hd), d),
            "wo": normal(ks[4], (L, n_heads, hd, d), n_heads * hd),
            "ffn_norm": jnp.ones((L, d), jnp.float32),
            "w_gate": normal(ks[5], (L, d, d_ff), d),
            "w_up": normal(ks[6], (L, d, d_ff), d),
            "w_down": normal(ks[7], (L, d_ff, d), d_ff),
        },
        "final_norm": jnp.ones((d,), jnp.float32),
        "unembed": normal(jax.random.fold_in(key, 99), (d, vocab), d),
    }


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm (Zhang & Sennrich 2019) in float32, returned in x's dtype: x [..., d], weight [d]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight).astype(x.dtype)


def rope(x, positions, base=10000.0):
    """Rotate pairs of features by ``position * base**(-2i/d)`` (RoFormer eq. 34, half-split pairs).

    x: [b, s, heads, d] (d even); positions: int [b, s] true positions. Angles in float32; the result
    is in x's dtype. ``q . k`` after rotation depends on the positions only through their difference.
    """
    d = x.shape[-1]
    freq = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) / (d // 2))  # (d/2,)
    angle = positions.astype(jnp.float32)[..., None] * freq  # (b, s, d/2)
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]  # (b, s, 1, d/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def dense_attention(q, k, v, positions, *, window=None, segment_ids=None):
    """Causal GQA softmax attention over the whole (unsharded) sequence: the 1-device oracle.

    q [b, s, h, d], k, v [b, s, hk, d], positions int [b, s]; window ``(left, 0)`` or None.
    Logits and softmax in float32; returns [b, s, h, d] in q's dtype.
    """
    g = q.shape[2] // k.shape[2]
    k, v = (repeat(x, "b s hk d -> b s (hk g) d", g=g) for x in (k, v))  # (b, s, h, d): head h uses kv head h // g
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    dist = positions[:, :, None] - positions[:, None, :]  # (b, q, k): query minus key position
    ok = dist >= 0
    if window is not None and window[0] >= 0:
        ok &= dist <= window[0]
    if segment_ids is not None:
        ok &= segment_ids[:, :, None] == segment_ids[:, None, :]
    p = jax.nn.softmax(jnp.where(ok[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def _attention(cfg, layer, x, positions, segment_ids, axis_name):
    """Pre-norm GQA attention with rotary q/k; the ring when ``axis_name`` is set, else dense."""
    dt = jnp.dtype(cfg.compute_dtype)
    h = rms_norm(x, layer["attn_norm"])
    q = jnp.einsum("bsd,dhe->bshe", h, layer["wq"].astype(dt))  # (b, s, h, hd)
    k = jnp.einsum("bsd,dhe->bshe", h, layer["wk"].astype(dt))  # (b, s, hk, hd)
    v = jnp.einsum("bsd,dhe->bshe", h, layer["wv"].astype(dt))
    q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
    if axis_name is None:
        o = dense_attention(q, k, v, positions, window=cfg.window, segment_ids=segment_ids)
    else:
        o = ring_attention_shard(q, k, v, axis_name=axis_name, causal=True, window=cfg.window,
                                 positions=positions, segment_ids=segment_ids)
    return jnp.einsum("bshe,hed->bsd", o, layer["wo"].astype(dt))


def _feedforward(cfg, layer, x):
    """Pre-norm SwiGLU (Shazeer 2020): ``W_down (silu(x W_gate) * x W_up)``, chunk by chunk."""
    dt = jnp.dtype(cfg.compute_dtype)
    w_gate, w_up, w_down = (layer[n].astype(dt) for n in ("w_gate", "w_up", "w_down"))

    def swiglu(t):  # (b, block, d) -> (b, block, d)
        return (jax.nn.silu(t @ w_gate) * (t @ w_up)) @ w_down

    h = rms_norm(x, layer["ffn_norm"])
    return blockwise_feedforward(swiglu, h, block=min(cfg.ffn_block, x.shape[1]), remat=True)


def check_tokens(tokens, positions):
    """tokens int [batch, seq] with batch, seq >= 1 and positions of the same shape, or a ValueError (a
    batch of 0 used to end deep in ``lax.scan`` with a carry-type error)."""
    shape = tuple(getattr(tokens, "shape", ()))
    if len(shape) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [batch, seq]; got shape {shape}, dtype "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
    if min(shape) < 1:
        raise ValueError(f"tokens must hold batch >= 1 and seq >= 1 tokens; got shape {shape} (batch = "
                         f"{shape[0]}, seq = {shape[1]})")
    if tuple(getattr(positions, "shape", ())) != shape:
        raise ValueError(f"positions must have the shape of tokens {shape}; got "
                         f"{tuple(getattr(positions, 'shape', ()))}")


def forward(params, tokens, positions, cfg, *, axis_name=None, segment_ids=None):
    """Logits float32 [b, s, vocab] for this host's tokens int [b, s] at true ``positions`` [b, s].

    Inside ``shard_map`` pass the ring's ``axis_name``: tokens and positions are then the host's
    shard (layout order) and attention runs around the ring. Each block is a ``jax.checkpoint``.
    """
    check_tokens(tokens, positions)
    dt = jnp.dtype(cfg.compute_dtype)
    x = params["embed"][tokens].astype(dt)  # (b, s, d)

    @partial(jax.checkpoint, prevent_cse=False)
    def block(x, layer):
        x = x + _attention(cfg, layer, x, positions, segment_ids, axis_name)
        return x + _feedforward(cfg, layer, x), None

    x, _ = jax.lax.scan(block, x, params["layers"])  # one compiled block for all layers
    x = rms_norm(x, params["final_norm"]).astype(jnp.float32)
    return x @ params["unembed"]


def sharded_forward(params, tokens, positions, cfg, mesh, *, axis_name="sp"):
    """:func:`forward` on global arrays in layout order: tokens and positions int [b, S] sharded over
    ``axis_name`` of ``mesh`` (params replicated; Auto or Explicit axes). A 1-device mesh uses dense
    attention."""
    check_tokens(tokens, positions)
    if mesh.shape[axis_name] == 1:
        return forward(params, tokens, positions, cfg)
    spec = jax.P(None, axis_name)
    fn = jax.shard_map(partial(forward, cfg=cfg, axis_name=axis_name), mesh=auto_mesh(mesh),
                       in_specs=(jax.P(), spec, spec), out_specs=spec)
    return call_auto(mesh, fn, params, tokens, positions, out_specs=jax.P(*spec_of(tokens, 2), None))


def n_params(params):
    """The number of parameters (for the progress line and the docs)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


__all__ = ["ModelConfig", "check_tokens", "dense_attention", "forward", "init_params", "n_params", "rms_norm", "rope",
           "sharded_forward"]
