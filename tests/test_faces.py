"""The faces a user meets first: meshes with Explicit axes, the cache's own mesh, one front door, lazy kernels.

Every public function of ``ringattn_fast`` takes a mesh from plain ``jax.make_mesh`` (Explicit axes,
JAX's default) as well as from ``ringattn_fast.make_mesh`` (Auto), also as the mesh of ``jax.set_mesh``;
a KV cache remembers the mesh it lives on; a bad argument is a ValueError raised once, before anything
is traced; importing the package imports no Pallas.
"""
import os
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
import ringattn_ref as ref
from ringattn_fast import front
from ringattn_fast.model import ModelConfig, init_params, sharded_forward

from helpers import max_abs_error, random_qkv

EXPLICIT = jax.sharding.AxisType.Explicit


def explicit_mesh(n=4):
    mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
    assert mesh.axis_types == (EXPLICIT,)
    return mesh


STRATEGIES = {"ring": rf.ring_attention, "allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention}


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_on_an_explicit_mesh_passed_and_set(name):
    """Eager with ``mesh=``, jitted under ``jax.set_mesh`` with ``mesh=None``, and its gradient there: the
    float64-oracle answer (``in_specs ... does not match`` before), o sharded like q."""
    q, k, v = random_qkv(2, 32, 4, 2, 8, seed=1)
    want = ref.attention(q, k, v, causal=True)
    fn, mesh = STRATEGIES[name], explicit_mesh()
    o = fn(q, k, v, mesh=mesh, causal=True, layout="zigzag")
    assert max_abs_error(o, want) < 1e-5
    with jax.set_mesh(mesh):
        o = jax.jit(lambda q, k, v: fn(q, k, v, causal=True, layout="striped"))(q, k, v)
        dq = jax.jit(jax.grad(lambda q: fn(q, k, v, causal=True).sum()))(q)
    assert max_abs_error(o, want) < 1e-5
    dq_auto = jax.grad(lambda q: fn(q, k, v, mesh=rf.make_mesh(4), causal=True).sum())(q)
    assert max_abs_error(dq, dq_auto) < 1e-5


@pytest.mark.slow
def test_adapters_model_and_inference_on_an_explicit_mesh():
    """jax.nn's twin, the Flax attention_fn, the model's sharded forward and prefill/decode on a
    ``jax.make_mesh`` mesh (Explicit), eager and under ``jax.set_mesh``."""
    mesh = explicit_mesh()
    q, k, v = random_qkv(2, 32, 4, 2, 8, seed=2)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert max_abs_error(rf.dot_product_attention(q, k, v, is_causal=True, mesh=mesh), want) < 1e-5
    with jax.set_mesh(mesh):
        o = jax.jit(lambda q, k, v: rf.flax_attention_fn(causal=True)(q, k, v))(q, k, v)
    assert max_abs_error(o, want) < 1e-5

    cfg = ModelConfig(vocab=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, ffn_block=8)
    params = init_params(jax.random.key(0), cfg)
    tokens = np.arange(64, dtype=np.int32).reshape(2, 32) % 16
    pos = np.broadcast_to(np.arange(32, dtype=np.int32), (2, 32))
    want_logits = sharded_forward(params, tokens, pos, cfg, rf.make_mesh(4))
    assert max_abs_error(sharded_forward(params, tokens, pos, cfg, mesh), want_logits) < 1e-4

    cache = rf.init_cache(2, 64, 2, 8, mesh=mesh)
    o, cache = rf.prefill(q[:, :20], k[:, :20], v[:, :20], cache, lengths=jnp.array([20, 7]))
    o1, cache = rf.decode_step(q[:, 20:21], k[:, 20:21], v[:, 20:21], cache)
    assert cache.lengths.tolist() == [21, 8]
    full = ref.attention(np.concatenate([q[:1, :20], q[:1, 20:21]], 1), np.concatenate([k[:1, :20], k[:1, 20:21]], 1),
                         np.concatenate([v[:1, :20], v[:1, 20:21]], 1), causal=True)
    assert max_abs_error(o1[:1, 0], full[:, -1]) < 1e-5


SHARD_FNS = {"ring": rf.ring_attention_shard, "allgather": rf.allgather_attention_shard,
             "ulysses": rf.ulysses_attention_shard}


@pytest.mark.parametrize("name", SHARD_FNS)
def test_every_shard_function_inside_shard_map_over_an_explicit_mesh(name):
    """The ``*_shard`` functions called in the user's own ``jax.shard_map`` over a ``jax.make_mesh`` mesh
    (Explicit axes), forward and gradient: the float64 oracle's answer."""
    q, k, v = random_qkv(1, 32, 4, 2, 8, seed=6)
    mesh, spec = explicit_mesh(), jax.P(None, "sp")
    ring = jax.shard_map(lambda q, k, v: SHARD_FNS[name](q, k, v, axis_name="sp", causal=True), mesh=mesh,
                         in_specs=(spec,) * 3, out_specs=spec)
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec))  # noqa: E731
    o = jax.jit(ring)(put(q), put(k), put(v))
    assert max_abs_error(o, ref.attention(q, k, v, causal=True)) < 1e-5
    dq = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum()))(put(q), put(k), put(v))
    dq_auto = jax.grad(lambda q: rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), causal=True).sum())(q)
    assert max_abs_error(dq, dq_auto) < 1e-5


def test_twin_and_inference_under_set_mesh_with_no_mesh_argument():
    """``mesh=None`` under ``jax.set_mesh(jax.make_mesh(...))``: the twin and a cache made there use that
    mesh (Explicit axes), jitted and eager."""
    mesh = explicit_mesh()
    q, k, v = random_qkv(2, 32, 4, 2, 8, seed=7)
    with jax.set_mesh(mesh):
        o = jax.jit(lambda q, k, v: rf.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
        cache = rf.init_cache(2, 64, 2, 8)
        o_pre, cache = rf.prefill(q[:, :8], k[:, :8], v[:, :8], cache)
        o_dec, cache = rf.decode_step(q[:, 8:9], k[:, 8:9], v[:, 8:9], cache)
    assert max_abs_error(o, jax.nn.dot_product_attention(q, k, v, is_causal=True)) < 1e-5
    assert cache.mesh.shape == mesh.shape and cache.lengths.tolist() == [9, 9]
    want = ref.attention(q[:, :9], k[:, :9], v[:, :9], causal=True)
    assert max_abs_error(o_pre, want[:, :8]) < 1e-5 and max_abs_error(o_dec[:, 0], want[:, 8]) < 1e-5


def test_the_cache_remembers_its_mesh():
    """A cache made on a 4-device mesh is used there with ``mesh=None`` (it used to resolve the default
    8-device mesh and fail); another mesh is a ValueError naming ``mesh``, the cache untouched."""
    mesh4 = rf.make_mesh(4)
    cache = rf.init_cache(1, 32, 1, 8, mesh=mesh4)
    assert cache.mesh == mesh4
    q, k, v = random_qkv(1, 6, 2, 1, 8, seed=3)
    o, new = rf.prefill(q, k, v, cache)
    assert new.mesh == mesh4 and new.lengths.tolist() == [6]
    assert max_abs_error(o, ref.attention(q, k, v, causal=True)) < 1e-5
    with pytest.raises(ValueError, match=r"mesh must be the mesh the cache lives on"):
        rf.decode_step(q[:, :1], k[:, :1], v[:, :1], new, mesh=rf.make_mesh(8))
    assert new.lengths.tolist() == [6]
    o, again = rf.decode_step(q[:, :1], k[:, :1], v[:, :1], new, mesh=mesh4)  # the same mesh: fine
    assert again.lengths.tolist() == [7]


def test_a_repeated_eager_prefill_and_decode_compile_nothing():
    """Eager prefill / decode_step run one jitted shard_map per static configuration (each call
    compiled its body again before: 5-8 s here); checked to fail with ``front.cached`` bypassed."""
    mesh = rf.make_mesh(2)
    q, k, v = random_qkv(1, 4, 2, 1, 8, seed=4)
    events = []
    listener = lambda event, secs, **kw: events.append(event)  # noqa: E731

    def run():
        cache = rf.init_cache(1, 16, 1, 8, mesh=mesh)
        o, cache = rf.prefill(q, k, v, cache)
        return rf.decode_step(q[:, :1], k[:, :1], v[:, :1], cache)[0]

    first = np.asarray(run())
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = np.asarray(run())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not [e for e in events if "jaxpr_trace" in e or "backend_compile" in e], events
    np.testing.assert_array_equal(again, first)


BAD_CALLS = {
    "scale": dict(scale=-1.0),
    "causal": dict(causal="yes"),
    "block_q": dict(block_q=5),
    "impl": dict(impl="cuda"),
    "comm_dtype": dict(comm_dtype="int8"),
    "dropout_rate": dict(dropout_rate=0.5),  # no key
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_is_one_value_error_raised_before_tracing(name, monkeypatch):
    """Each bad argument is a ValueError naming it, raised by the front door's one round of checks
    (``check_settings`` runs once per call) before JAX traces anything: no frame of the traceback is
    inside jax, and the public function is the outermost library frame."""
    q, k, v = random_qkv(1, 16, 2, 2, 8, seed=5)
    runs = []
    monkeypatch.setattr(front, "check_settings", lambda *a, _f=front.check_settings, **kw: runs.append(1) or _f(*a, **kw))
    with pytest.raises(ValueError, match=name) as err:
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), **BAD_CALLS[name])
    files = [frame.filename for frame in traceback.extract_tb(err.value.__traceback__)]
    assert not [f for f in files if os.sep + "jax" + os.sep in f], files
    assert files[1].endswith(os.path.join("ringattn_fast", "ring.py")), files  # test -> ring_attention -> ...
    assert len(runs) <= 1
    runs.clear()
    rf.ring_attention(q, k, v, mesh=rf.make_mesh(2), causal=True)
    assert len(runs) == 1  # one round of checks per call, none again per host


PUBLIC = {"ring_attention": (rf.ring_attention, "ring.py"),
          "allgather_attention": (rf.allgather_attention, "allgather.py"),
          "ulysses_attention": (rf.ulysses_attention, "ulysses.py")}


@pytest.mark.parametrize("fn", PUBLIC)
@pytest.mark.parametrize("name", ["scale", "causal", "block_q", "impl"])
def test_every_strategy_raises_once_from_its_own_frame(fn, name, monkeypatch):
    """As above for the all-gather and Ulysses too: one ValueError naming the argument, one round of
    checks, no jax frame, the public function's module the outermost library frame."""
    q, k, v = random_qkv(1, 16, 2, 2, 8, seed=5)
    runs = []
    counted = lambda *a, _f=front.check_settings, **kw: runs.append(1) or _f(*a, **kw)  # noqa: E731
    monkeypatch.setattr(front, "check_settings", counted)
    call, module = PUBLIC[fn]
    with pytest.raises(ValueError, match=name) as err:
        call(q, k, v, mesh=rf.make_mesh(2), **BAD_CALLS[name])
    files = [frame.filename for frame in traceback.extract_tb(err.value.__traceback__)]
    assert not [f for f in files if os.sep + "jax" + os.sep in f], files
    assert files[1].endswith(os.path.join("ringattn_fast", module)), files
    assert len(runs) <= 1


def test_importing_the_package_imports_no_pallas():
    """The kernels are imported when an impl is first used (``dispatch.kernels_for``)."""
    code = ("import sys, ringattn_fast, ringattn_ref; "
            "print(sorted(m for m in sys.modules if 'pallas' in m or m.startswith('ringattn_fast.kernels.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
