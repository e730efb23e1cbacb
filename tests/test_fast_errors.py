"""Bad inputs raise the documented ValueErrors: the shared ringattn_ref messages, plus mesh/axis errors."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
import ringattn_ref
from ringattn_fast import _compat
from ringattn_fast.dispatch import check_impl

B, S, H, D = 2, 16, 4, 8


def arrays(q_shape=(B, S, H, D), kv_shape=(B, S, 2, D), dtype=np.float32):
    return (np.zeros(q_shape, dtype), np.zeros(kv_shape, dtype), np.zeros(kv_shape, dtype))


SHARED_CASES = {  # name -> (positional arrays, keywords): each must fail in both packages, same message
    "q not 4-D": (arrays(q_shape=(B, S, H)), {}),
    "int q": (arrays(dtype=np.int32), {}),
    "k/v shapes differ": ((np.zeros((B, S, H, D)), np.zeros((B, S, 2, D)), np.zeros((B, S, 1, D))), {}),
    "heads not divisible": (arrays(kv_shape=(B, S, 3, D)), {}),
    "scale negative": (arrays(), {"scale": -1.0}),
    "scale not a number": (arrays(), {"scale": "big"}),
    "window not a pair": (arrays(), {"window": 3}),
    "window below -1": (arrays(), {"window": (-2, 0)}),
    "segment_ids shape": (arrays(), {"segment_ids": np.zeros((B, S + 1), np.int32)}),
    "segment_ids float": (arrays(), {"segment_ids": np.zeros((B, S))}),
    "bias shape": (arrays(), {"bias": np.zeros((B, H, S, 3), np.float32)}),
    "bias 3-D": (arrays(), {"bias": np.zeros((H, S, S), np.float32)}),
    "bias int": (arrays(), {"bias": np.zeros((1, 1, S, S), np.int32)}),
    "layout name": (arrays(), {"layout": "spiral"}),
    "layout not a permutation": (arrays(), {"layout": np.zeros(S, np.int64)}),
    "layout wrong length": (arrays(), {"layout": np.arange(S - 1)}),
    "block_q does not divide shard": (arrays(), {"block_q": 3}),
    "block_kv not positive": (arrays(), {"block_kv": 0}),
    # issue 8, defect 4: no silent coercion of flags and window bounds
    "causal a string": (arrays(), {"causal": "False"}),
    "causal an int": (arrays(), {"causal": 1}),
    "window floats": (arrays(), {"window": (1.7, 0.2)}),
    "window strings": (arrays(), {"window": ("3", "1")}),
    "window bools": (arrays(), {"window": (True, False)}),
    # defect 3: ids beyond int32 would wrap and merge documents
    "segment_ids beyond int32": (arrays(), {"segment_ids": np.where(np.arange(S) < S // 2, 0, 2**32)[None]
                                            .repeat(B, 0).astype(np.int64)}),
    # defect 7: a zero-length sequence
    "empty sequence": (arrays(q_shape=(B, 0, H, D), kv_shape=(B, 0, 2, D)), {}),
}


@pytest.mark.parametrize("case", sorted(SHARED_CASES))
def test_same_message_as_ringattn_ref(case):
    args, kwargs = SHARED_CASES[case]
    with pytest.raises(ValueError) as ref_error:
        ringattn_ref.ring_attention(*args, n_hosts=4, **kwargs)
    with pytest.raises(ValueError) as fast_error:
        rf.ring_attention(*(jnp.asarray(a) for a in args), mesh=rf.make_mesh(4), **kwargs)
    assert str(fast_error.value) == str(ref_error.value)


def test_mesh_axis_errors():
    q, k, v = arrays()
    missing = r"axis_name 'seq' is not an axis of the mesh; the mesh has axes \('sp',\)"
    with pytest.raises(ValueError, match=missing):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), axis_name="seq")
    mesh3 = jax.make_mesh((2, 2, 2), ("data", "sp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    q1, k1, v1 = arrays(kv_shape=(B, S, 1, D))
    with pytest.raises(ValueError, match=r"heads \(4\) and kv_heads \(1\) must be divisible by the size of mesh axis 'tp'"):
        rf.ring_attention(q1, k1, v1, mesh=mesh3, head_axis="tp")
    with pytest.raises(ValueError, match="axis_name, batch_axes and head_axis must be different mesh axes"):
        rf.ring_attention(q, k, v, mesh=mesh3, head_axis="data")
    with pytest.raises(ValueError, match="batch_axes / head_axis must name axes of the mesh"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), head_axis="tp")
    q1, k1, v1 = arrays(q_shape=(3, S, H, D), kv_shape=(3, S, 2, D))
    with pytest.raises(ValueError, match=r"batch \(3\) must be divisible by the size of mesh axis 'data' \(2\)"):
        rf.ring_attention(q1, k1, v1, mesh=rf.make_mesh(8, data=2))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        rf.ring_attention(q, k, v, mesh="sp")


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"n_devices must be an int in \[1, 8\]"):
        rf.make_mesh(9)
    with pytest.raises(ValueError, match="data must be a positive int dividing n_devices = 8; got 3"):
        rf.make_mesh(8, data=3)
    with pytest.raises(ValueError, match="axis_name must differ from 'data'"):
        rf.make_mesh(8, axis_name="data", data=2)
    assert rf.make_mesh(8, data=2).axis_names == ("data", "sp")
    assert dict(rf.make_mesh(6, "ring").shape) == {"ring": 6}


def test_impl_errors():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'xla', 'pallas_gpu'"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), impl="cuda")
    with pytest.raises(ValueError, match="impl='pallas_gpu' does not support bias"):
        rf.ring_attention(q, k, v, mesh=rf.make_mesh(4), impl="pallas_gpu",
                          bias=np.zeros((1, 1, S, S), np.float32))
    with pytest.raises(ValueError, match="impl='pallas_tpu' cannot run on 'gpu' devices"):
        check_impl("pallas_tpu", "gpu", q, k, v)
    with pytest.raises(ValueError, match="impl='pallas_gpu' cannot run on 'tpu' devices"):
        check_impl("pallas_gpu", "tpu", q, k, v)
    assert [check_impl("auto", p, q, k, v) for p in ("cpu", "gpu", "tpu")] == ["xla", "pallas_gpu", "pallas_tpu_fused"]
    assert check_impl("auto", "tpu", q, k, v, has_bias=True) == "xla"
    q64 = q.astype(np.float64)
    assert check_impl("auto", "gpu", q64, q64, q64) == "xla"  # the kernels compute in float32


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "pallas_tpu_fused"])
def test_kernel_dtypes_are_named(impl):
    """Issue 8, defect 6: float64 (crashed, or came back float64 at float32 accuracy) and mixed q/k/v
    dtypes (pallas_gpu lost 1e-3) are rejected with the impl and the dtypes named."""
    q, k, v = arrays()
    with pytest.raises(ValueError, match=rf"impl='{impl}'.*float64"):
        check_impl(impl, "cpu", q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match=rf"impl='{impl}'.*bfloat16"):
        check_impl(impl, "cpu", q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert check_impl(impl, "cpu", q, k, v) == impl


def test_shard_errors_inside_shard_map():
    mesh = rf.make_mesh(4)
    q, k, v = (jnp.asarray(a) for a in arrays())
    spec = jax.P(None, "sp")

    def run(**kwargs):
        fn = lambda q, k, v: rf.ring_attention_shard(q, k, v, **kwargs)  # noqa: E731
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

    with pytest.raises(ValueError, match=r"bias \(per host\) must be \[batch\|1, heads\|1, 4\|1, 16\]"):
        run(bias=jnp.zeros((B, H, 4, 4)))  # a full bias must hold every key column
    with pytest.raises(ValueError, match=r"positions must have shape \[batch, seq\] = \(2, 4\); got \(2, 16\)"):
        run(positions=jnp.zeros((B, S), jnp.int32))
    for impl in ("xla", "pallas_gpu", "pallas_tpu", "pallas_tpu_fused"):  # defect 7: name the axis, every impl
        with pytest.raises(ValueError, match="axis_name 'ring' must name a mesh axis of an enclosing jax.shard_map"):
            run(axis_name="ring", impl=impl)


def test_positions_and_ids_outside_int32_are_rejected():
    """Issue 8, defect 3: ids 0 and 2**32 used to attend to each other (error 0.6, no warning)."""
    with pytest.raises(ValueError, match=r"qs.pos must lie in \[0, 2147483647\]"):
        q, k, v = arrays()
        ringattn_ref.hop_attention(ringattn_ref.QShard(q, np.full((B, S), -1)), ringattn_ref.KVShard(k, v, np.arange(S)))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 2147483647\]"):
        from ringattn_ref.validation import check_positions
        check_positions(np.full((B, S), 2**31), B, S)
    seg = np.zeros((B, S), np.int64)
    seg[:, S // 2:] = 2**32
    with pytest.raises(ValueError, match=r"segment_ids must lie in \[-2147483646, 2147483647\]"):
        rf.ring_attention(*arrays(), mesh=rf.make_mesh(4), segment_ids=seg)


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu", "pallas_tpu_fused"])
def test_shard_outside_shard_map_names_axis_name(impl):
    """Issue 8, defect 7: outside shard_map every impl says what axis_name must name (was NameError)."""
    q, k, v = (jnp.asarray(a) for a in arrays())
    with pytest.raises(ValueError, match="axis_name 'sp' must name a mesh axis of an enclosing jax.shard_map"):
        rf.ring_attention_shard(q, k, v, impl=impl)


def test_layout_errors():
    x = jnp.zeros((B, S, H, D))
    with pytest.raises(ValueError) as fast_error:
        rf.to_layout(x, "zigzag", 3)
    with pytest.raises(ValueError) as ref_error:
        ringattn_ref.to_layout(np.zeros((B, S, H, D)), "zigzag", 3)
    assert str(fast_error.value) == str(ref_error.value)
    with pytest.raises(ValueError, match=r"positions must have shape \[batch, seq\] = \(2, 16\); got \(16,\)"):
        rf.to_layout(x, positions=jnp.arange(S))
    with pytest.raises(ValueError, match="positions must be an integer array; got dtype float32"):
        rf.from_layout(x, positions=jnp.zeros((B, S), jnp.float32))


def test_a_jax_older_than_supported_is_an_import_error_naming_the_version():
    """``import ringattn_fast`` on a JAX older than 0.10 (faked in a fresh process: jax.__version__ set before
    the import) is an ImportError naming the version needed and the one installed."""
    code = "import jax\njax.__version__ = '0.9.3'\nimport ringattn_fast"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).resolve().parents[1], env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode != 0
    assert "ImportError: ringattn needs jax >= 0.10; this is jax 0.9.3" in run.stderr, run.stderr[-2000:]
    for ok in ("0.10.0", "0.10.2", "0.12.0.1", "1.0.0"):
        _compat.check_jax(tuple(int(x) for x in ok.split(".")))
    with pytest.raises(ImportError, match=r"needs jax >= 0.10"):
        _compat.check_jax((0, 9))


def test_fused_interpreter_on_a_jax_too_old_for_it_is_an_error_naming_the_version(monkeypatch):
    """impl='pallas_tpu_fused' interpreted on CPU with a JAX older than the fused interpreter needs (the
    installed one, or faked here) raises before anything runs, naming the version, instead of hanging."""
    monkeypatch.setattr(_compat, "jax_version", lambda: (0, 10))
    q = jnp.zeros((1, 24, 2, 8))  # a shape no other test traces: the error comes at trace time
    with pytest.raises(RuntimeError, match=r"impl='pallas_tpu_fused' interpreted on CPU needs jax >= 0\.12 "
                                           r"\(the TPU interpreter of jax .* can hang"):
        rf.ring_attention(q, q, q, mesh=rf.make_mesh(2), impl="pallas_tpu_fused")
