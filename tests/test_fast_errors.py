"""Bad inputs raise the documented ValueErrors: the shared ringattn_ref messages, plus mesh/axis errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast as rf
import ringattn_ref
from ringattn_fast.dispatch import resolve_impl

B, S, H, D = 2, 16, 4, 8


def arrays(q_shape=(B, S, H, D), kv_shape=(B, S, 2, D), dtype=np.float32):
    return (np.zeros(q_shape, dtype), np.zeros(kv_shape, dtype), np.zeros(kv_shape, dtype))


SHARED_CASES = {  # name -> (positional arrays, keywords): each must fail in both packages, same message
    "q not 4-D": (arrays(q_shape=(B, S, H)), {}),
    "int q": (arrays(dtype=np.int32), {}),
    "k/v shapes differ": ((np.zeros((B, S, H, D)), np.zeros((B, S, 2, D)), np.zeros((B, S, 1, D))), {}),
    "k/v seq differs": (arrays(kv_shape=(B, S // 2, 2, D)), {}),
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
    q3, k3, v3 = arrays(q_shape=(B, 12, H, D), kv_shape=(B, 12, 2, D))
    with pytest.raises(ValueError, match=r"seq \(12\) must be divisible by the size of mesh axis 'sp' \(8\)"):
        rf.ring_attention(q3, k3, v3, mesh=rf.make_mesh(8))
    with pytest.raises(ValueError, match=r"seq \(12\) must be divisible by 2 \* the size of mesh axis 'sp' \(4\)"):
        rf.ring_attention(q3, k3, v3, mesh=rf.make_mesh(4), layout="zigzag")
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
        resolve_impl("pallas_tpu", "gpu")
    with pytest.raises(ValueError, match="impl='pallas_gpu' cannot run on 'tpu' devices"):
        resolve_impl("pallas_gpu", "tpu")
    assert [resolve_impl("auto", p) for p in ("cpu", "gpu", "tpu")] == ["xla", "pallas_gpu", "pallas_tpu_fused"]
    assert resolve_impl("auto", "tpu", has_bias=True) == "xla"


def test_shard_errors_inside_shard_map():
    mesh = rf.make_mesh(4)
    q, k, v = (jnp.asarray(a) for a in arrays())
    spec = jax.P(None, "sp")

    def run(**kwargs):
        fn = lambda q, k, v: rf.ring_attention_shard(q, k, v, **kwargs)  # noqa: E731
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

    with pytest.raises(ValueError, match=r"bias \(per host\) must be \[batch\|1, heads\|1, 4\|1, 16\]"):
        run(bias=jnp.zeros((B, H, 4, 4)))  # a full bias must hold every key column
    with pytest.raises(ValueError, match=r"positions must be an int array \[batch, s_local\] = \(2, 4\)"):
        run(positions=jnp.zeros((B, S), jnp.int32))
    with pytest.raises(NameError):  # the axis must exist in the surrounding shard_map
        run(axis_name="ring")


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
