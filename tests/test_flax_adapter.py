"""``flax_attention_fn`` in Flax's attention modules equals their stock attention, on 8 simulated devices.

nnx.MultiHeadAttention (causal and not, GQA, a padding mask, two batch dimensions) and linen's
MultiHeadDotProductAttention (once): outputs and parameter gradients; with dropout on, the module
equals its projections around ``ring_attention(..., dropout_rate=, dropout_key=)`` (Flax's
``dropout_rng`` is the key) and the attention_fn equals the float64 oracle's dropout; and the clear
errors for what the ring cannot honour (sown weights, precision, RoPE positions, cross-attention,
decode mode, dropout without an rng). The training recipe of ``docs/flax.md`` runs as written in a
fresh process, and its second step traces and compiles nothing.
"""
from functools import partial
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ringattn_fast as rf
from helpers import assert_close
import ringattn_ref as ref

TOL = 2e-5  # float32, relative to max(1, max |stock value|)
MESH = rf.make_mesh(8)
# RoPE positions (``input_positions=``) came to nnx.MultiHeadAttention after flax 0.12.8, the flax the
# oldest supported JAX gets here (scripts/test-oldest.sh): with an older flax there is nothing to refuse.
FLAX_HAS_INPUT_POSITIONS = "input_positions" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters


close = partial(assert_close, tol=TOL)  # relative to max(1, max |want|)



def nnx_mha(attention_fn=nnx.dot_product_attention, **kw):
    """The same parameters (seed 0) whatever the attention_fn."""
    kw = dict(num_heads=4, in_features=16, qkv_features=32, decode=False, rngs=nnx.Rngs(0), **kw)
    return nnx.MultiHeadAttention(attention_fn=attention_fn, **kw)


def nnx_value_and_grads(model, x, **call):
    @nnx.jit
    def run(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, **call))))(model)

    loss, grads = run(model, x)
    return loss, jax.tree.leaves(nnx.state(grads, nnx.Param))


@pytest.mark.parametrize("case", ["causal", "is_causal", "padding mask, GQA", "two batch dims"])
def test_nnx_multi_head_attention_equals_stock(case):
    x = jax.random.normal(jax.random.key(1), (2, 32, 16))
    ours_fn, call, kw = rf.flax_attention_fn(mesh=MESH, causal=case == "causal"), {}, {}
    stock_call = {"is_causal": True} if case in ("causal", "is_causal") else {}
    if case == "is_causal":
        call = {"is_causal": True}
    if case == "padding mask, GQA":
        lengths = jnp.array([32, 19])
        keep = jnp.arange(32) < lengths[:, None]  # [batch, seq]
        call = stock_call = {"mask": nnx.make_attention_mask(keep, keep)}  # [batch, 1, T, S]
        kw = {"num_kv_heads": 2}
    if case == "two batch dims":  # and a dropout rate, off while deterministic
        x = x.reshape(2, 1, 32, 16).repeat(3, axis=1)  # [2, 3, seq, features]
        call = stock_call = {"deterministic": True}
        kw = {"dropout_rate": 0.1}
    loss, grads = nnx_value_and_grads(nnx_mha(ours_fn, **kw), x, **call)
    loss_want, grads_want = nnx_value_and_grads(nnx_mha(**kw), x, **stock_call)
    close(loss, loss_want, "loss")
    assert len(grads) == len(grads_want) == 8  # q, k, v, out: kernel and bias
    for i, (g, w) in enumerate(zip(grads, grads_want)):
        close(g, w, f"param grad {i}")


@pytest.mark.slow
def test_linen_multi_head_dot_product_attention_equals_stock():
    x = jax.random.normal(jax.random.key(2), (2, 16, 16))
    mask = nn.make_causal_mask(jnp.ones((2, 16)))  # a dense mask: honoured (as a bias)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, attention_fn=rf.flax_attention_fn(mesh=MESH))
    stock = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
    params = stock.init(jax.random.key(0), x, mask=mask)

    def value_and_grads(module):
        loss = lambda p: jnp.sum(jnp.sin(module.apply(p, x, mask=mask)))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    (loss, grads), (loss_want, grads_want) = value_and_grads(ours), value_and_grads(stock)
    close(loss, loss_want, "loss")
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want), strict=True):
        close(g, w, "param grad")


@pytest.mark.slow
def test_nnx_dropout_is_the_rings_attention_dropout():
    """dropout_rate > 0, deterministic=False: the module is its own projections around the ring with
    ``dropout_rate`` and Flax's ``dropout_rng`` as ``dropout_key``, forward and parameter gradients;
    deterministic=True is the ring without dropout."""
    x = jax.random.normal(jax.random.key(3), (2, 16, 16))
    mha = nnx_mha(rf.flax_attention_fn(mesh=MESH, causal=True), dropout_rate=0.25)
    key = nnx.Rngs(dropout=7).dropout()  # what the module draws from rngs=nnx.Rngs(dropout=7)

    def by_hand(m, **drop):
        return m.out(rf.ring_attention(m.query(x), m.key(x), m.value(x), mesh=MESH, causal=True, **drop))

    dropped = mha(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    close(dropped, by_hand(mha, dropout_rate=0.25, dropout_key=key), "dropout output")
    close(mha(x, deterministic=True), by_hand(mha), "deterministic output")
    assert np.abs(np.asarray(dropped) - np.asarray(mha(x, deterministic=True))).max() > 0.01  # dropout did act

    @nnx.jit
    def grads(m):
        def ours(m):
            return jnp.sum(jnp.sin(m(x, deterministic=False, rngs=nnx.Rngs(dropout=7))))

        def theirs(m):
            return jnp.sum(jnp.sin(by_hand(m, dropout_rate=0.25, dropout_key=nnx.Rngs(dropout=7).dropout())))

        return nnx.grad(ours)(m), nnx.grad(theirs)(m)

    got, want = (jax.tree.leaves(nnx.state(g, nnx.Param)) for g in grads(mha))
    assert len(got) == len(want) == 8 and all(np.abs(np.asarray(g)).max() > 0 for g in got)
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"param grad {i} with dropout")


def test_attention_fn_dropout_equals_the_oracle():
    """Two batch dims flattened into the ring's batch rows: the mask is the oracle's for those rows."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 16, h, 8)).astype(np.float32) for h in (4, 2, 2))  # [b1, b2, T, h, d]
    key = jax.random.key(11)
    o = rf.flax_attention_fn(mesh=MESH, causal=True)(q, k, v, dropout_rate=0.3, dropout_rng=key,
                                                      deterministic=False)
    flat = [x.reshape((6,) + x.shape[2:]).astype(np.float64) for x in (q, k, v)]
    want = ref.attention(*flat, causal=True, dropout_rate=0.3, dropout_key=np.asarray(jax.random.key_data(key)))
    close(o, want.reshape(o.shape), "attention with dropout vs the float64 oracle")
    with pytest.raises(ValueError, match="dropout_rng is required"):
        rf.flax_attention_fn(mesh=MESH)(q, k, v, dropout_rate=0.3, deterministic=False)


def test_decode_mode_points_at_the_rings_kv_cache():
    """nnx decode=True (one query against the cached keys): the error names the lengths and the ring's
    inference API."""
    mha = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=True, rngs=nnx.Rngs(0),
                                 attention_fn=rf.flax_attention_fn(mesh=MESH))
    mha.init_cache((1, 8, 16))
    with pytest.raises(ValueError, match=r"query length 1 must equal key length 8.*init_cache / prefill / decode_step"):
        mha(jnp.zeros((1, 1, 16)))


@pytest.mark.parametrize("build, call, match", [
    ({}, dict(sow_weights=True), "sow"),
    (dict(precision=jax.lax.Precision.HIGHEST), {}, "precision"),
    pytest.param({}, dict(input_positions=jnp.zeros((1, 8), jnp.int32)), "input_positions",
                 marks=pytest.mark.skipif(not FLAX_HAS_INPUT_POSITIONS, reason="this flax's MultiHeadAttention takes "
                                          "no input_positions (older than the flax that added RoPE positions)")),
    ({}, dict(inputs_k=jnp.zeros((1, 16, 16))), "must equal key length"),
])
def test_what_the_ring_cannot_honour_raises(build, call, match):
    model = nnx_mha(rf.flax_attention_fn(mesh=MESH), **build)
    with pytest.raises(ValueError, match=match):
        model(jnp.zeros((1, 8, 16)), **call)


def test_programmable_attention_bound_into_the_attention_fn_equals_the_oracle():
    """logit_softcap, sinks and a mask_fn (StreamingLLM) bound by flax_attention_fn: the nnx module is its
    projections around the float64 oracle with the same keywords; a mask_fn keeps Flax's mask and jax.nn's
    rows that see no key; bad keywords are a ValueError naming them."""
    x = jax.random.normal(jax.random.key(5), (2, 32, 16))
    kw = dict(logit_softcap=3.0, sinks=np.array([0.5, -1.0, 2.0, 0.0]), mask_fn=ref.variants.streaming(2, 8))
    mha = nnx_mha(rf.flax_attention_fn(mesh=MESH, **kw))
    f64 = lambda layer: np.asarray(layer(x), np.float64)  # noqa: E731
    o = ref.attention(f64(mha.query), f64(mha.key), f64(mha.value), **kw)
    close(mha(x), mha.out(jnp.asarray(o, jnp.float32)), "module output vs the oracle")
    rng = np.random.default_rng(6)  # with a mask_fn, Flax's mask and jax.nn's dead rows (the mean of V) still hold
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, h, 8)), jnp.float32) for h in (4, 2, 2))
    keep = jnp.arange(16) < jnp.array([16, 9])[:, None]  # row 1: queries 9.. see no key
    mask = nnx.make_attention_mask(keep, keep)
    everything = rf.flax_attention_fn(mesh=MESH, mask_fn=lambda qp, kp, qs, ks, h: kp >= 0)
    close(everything(q, k, v, mask=mask), rf.flax_attention_fn(mesh=MESH)(q, k, v, mask=mask), "mask_fn: every pair")
    q = jnp.zeros((1, 8, 4, 8))
    for bad, name in ((dict(logit_softcap=0.0), "logit_softcap"), (dict(mask_fn="causal"), "mask_fn"),
                      (dict(sinks=np.zeros(3)), "sinks"), (dict(score_fn=lambda s, qp, kp, h: s[..., :1]), "score_fn")):
        with pytest.raises(ValueError, match=name):
            rf.flax_attention_fn(mesh=MESH, **bad)(q, q, q)


ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs the recipe's two blocks (setup, loop) as written and prints, per step, the trace/compile events
# the step fired: the listener tags each event with len(losses), the steps finished when it fired.
RECIPE_HARNESS = """
import json, jax
events = []
jax.monitoring.register_event_duration_secs_listener(lambda e, s, **kw: events.append((e, len(ns.get("losses", [])))))
ns = {}
exec(compile(SETUP, "docs/flax.md (setup)", "exec"), ns)
del events[:]  # from here on, only what the loop's steps do
exec(compile(LOOP, "docs/flax.md (loop)", "exec"), ns)
print(json.dumps([[e, step] for e, step in events if "jaxpr_trace" in e or "backend_compile" in e]))
"""


@pytest.mark.slow
def test_docs_flax_recipe_runs_and_its_second_step_compiles_nothing():
    """The recipe places the model's and optimizer's state on the mesh before step 1; without that, step
    2 traces and compiles again (the state comes back placed on the mesh), which this test would see."""
    setup, loop = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "flax.md").read_text(), flags=re.S)
    assert setup.startswith('import jax\njax.config.update("jax_num_cpu_devices", 8)')
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")  # conftest's cache, shared
    # without conftest's device-count flag: the recipe's own line must make the 8 devices
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    run = subprocess.run([sys.executable, "-c", f"SETUP = {setup!r}\nLOOP = {loop!r}\n" + RECIPE_HARNESS],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    events = json.loads(run.stdout.strip().splitlines()[-1])
    assert any("jaxpr_trace" in e for e, step in events if step == 0), events  # step 1 traces: the listener hears
    assert not [e for e, step in events if step >= 1], events  # steps 2 and 3: nothing traced or compiled
