"""Issue 31, item 4: every argument that takes a dtype takes it in every spelling JAX users write —
numpy's scalar type (``np.float32``), jnp's (``jnp.bfloat16``), a string, ``np.dtype(...)`` and
``jnp.dtype(...)`` — and means the same by each (no recompile for an equal dtype spelled otherwise
where the spelling is part of a static configuration)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
from ringattn_fast import inference as fi
from ringattn_fast import model
from ringattn_ref import inference as ri

SPELLINGS = {  # name -> dtype -> that dtype spelled this way
    "np scalar type": {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16},
    "jnp scalar type": {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16},
    "str": {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"},
    "np.dtype": {"float32": np.dtype("float32"), "bfloat16": jnp.dtype("bfloat16"), "float16": np.dtype("float16")},
    "jnp.dtype": {"float32": jnp.dtype("float32"), "bfloat16": jnp.dtype("bfloat16"), "float16": jnp.dtype("float16")},
}
Q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 4, 8)), jnp.float32)


def _hybrid(q, **kw):
    mesh = jax.make_mesh((2, 2), ("sp", "ulysses"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    return rf.hybrid_attention(q, q, q, mesh=mesh, ring_axis="sp", ulysses_axis="ulysses", **kw)


STRATEGIES = {
    "ring": lambda q, **kw: rf.ring_attention(q, q, q, mesh=rf.make_mesh(4), causal=True, **kw),
    "allgather": lambda q, **kw: rf.allgather_attention(q, q, q, mesh=rf.make_mesh(4), causal=True, **kw),
    "hybrid": lambda q, **kw: _hybrid(q, causal=True, **kw),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_dtype_argument_takes_every_spelling(spelling):
    f32, bf16 = SPELLINGS[spelling]["float32"], SPELLINGS[spelling]["bfloat16"]
    mesh = rf.make_mesh(2)
    # init_cache, fast and ref (the ref is numpy: float32 only)
    assert fi.init_cache(1, 8, 1, 4, mesh=mesh, dtype=bf16).k.dtype == jnp.bfloat16
    assert ri.init_cache(1, 8, 1, 4, n_hosts=2, dtype=f32).k.dtype == np.float32
    # comm_dtype and grad_comm_dtype in each strategy: the same numbers as the string spelling
    for name, call in STRATEGIES.items():
        want = call(Q, comm_dtype="bfloat16")
        np.testing.assert_array_equal(np.asarray(call(Q, comm_dtype=bf16)), np.asarray(want), err_msg=name)
        grad = lambda x, c: jax.grad(lambda x: call(x, grad_comm_dtype=c).sum())(x)  # noqa: E731
        np.testing.assert_array_equal(np.asarray(grad(Q, bf16)), np.asarray(grad(Q, "bfloat16")), err_msg=name)
    # the Flax adapter's dtype (Flax passes its module's dtype)
    out = rf.flax_attention_fn(mesh=rf.make_mesh(4), causal=True)(Q, Q, Q, dtype=bf16)
    assert out.dtype == jnp.bfloat16
    # the model's compute dtype: normalised to its name (one static configuration, one compile)
    cfg = model.ModelConfig(vocab=16, compute_dtype=bf16)
    assert cfg.compute_dtype == "bfloat16" and cfg == model.ModelConfig(vocab=16, compute_dtype="bfloat16")
    assert hash(cfg) == hash(model.ModelConfig(vocab=16, compute_dtype="bfloat16"))


@pytest.mark.parametrize("bad", [np.int32, "int8", "not a dtype", object()])
def test_a_dtype_that_is_not_a_float_is_a_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match="comm_dtype"):
        rf.ring_attention(Q, Q, Q, mesh=rf.make_mesh(4), comm_dtype=bad)
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        rf.ring_attention(Q, Q, Q, mesh=rf.make_mesh(4), grad_comm_dtype=bad)
    with pytest.raises(ValueError, match="compute_dtype"):
        model.ModelConfig(vocab=16, compute_dtype=bad)


CLIS = ["balance", "masks", "strategies", "decode", "train", "bench_gpu", "bench_tpu", "tune_tpu", "recall"]
TEXT_SPELLINGS = {"float32": ("float32", "f4", "single", "np.float32", "numpy.float32", "jnp.float32"),
                  "bfloat16": ("bfloat16", "jnp.bfloat16", "jax.numpy.bfloat16", "ml_dtypes.bfloat16")}


@pytest.mark.parametrize("cli", CLIS)
def test_every_cli_dtype_flag_takes_every_spelling(cli, capsys):
    """Each command line's ``--dtype`` (``tune_tpu``'s ``--dtypes`` list) takes the dtype as numpy spells it in
    text, or as Python code names it, and hands the program its canonical name; a non-float is exit 2."""
    import importlib
    if cli == "recall":
        from examples.recall import cli as recall_cli
        parse, flag = recall_cli.parser().parse_args, "--dtype"
    else:
        parse = importlib.import_module(f"benchmarks.{cli}").parse_args
        flag = "--dtypes" if cli == "tune_tpu" else "--dtype"
    for name, texts in TEXT_SPELLINGS.items():
        for text in texts:
            got = getattr(parse([flag, text]), flag[2:])
            assert got == ([name] if cli == "tune_tpu" else name), (cli, text, got)
    with pytest.raises(SystemExit) as exit_:
        parse([flag, "int8"])
    assert exit_.value.code == 2 and f"argument {flag}: must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_the_kernels_tile_defaults_take_every_spelling(spelling):
    """``default_blocks`` (and the TPU backward's) of each kernel, for a chip named by its device kind: the
    same tiles for a dtype however it is spelled."""
    import types
    from ringattn_fast.kernels import pallas_gpu, pallas_tpu, pallas_tpu_fused
    tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    shape = (1, 4096, 8, 128)
    for name in ("float32", "bfloat16"):
        dtype = SPELLINGS[spelling][name]
        for fn, device in ((pallas_tpu.default_blocks, tpu), (pallas_tpu_fused.default_blocks, tpu),
                           (pallas_gpu.default_blocks, gpu)):
            assert fn(shape, shape, dtype, device, n=8) == fn(shape, shape, name, device, n=8), (fn, name)
        assert pallas_tpu.default_bwd_blocks(shape, shape, dtype, tpu) == \
            pallas_tpu.default_bwd_blocks(shape, shape, name, tpu)


@pytest.mark.parametrize("dtype", [np.int32, "int8", np.dtype(bool)])
def test_the_reference_cache_refuses_a_non_float_dtype(dtype):
    """``ringattn_ref.inference.init_cache`` refuses what the fast one refuses (an int cache was accepted)."""
    from ringattn_ref import inference as ref_inference
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype"):
        ref_inference.init_cache(1, 8, 1, 4, n_hosts=2, dtype=dtype)
