"""Cross-lowering: every Pallas kernel lowered for the chips it targets, on a CPU host.

Inside ``jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice(device_kind=...,
platform=...)))`` ``jax.jit(f).trace(*structs).lower()`` runs Pallas' Mosaic (TPU) or Triton (GPU)
lowering and Mosaic's op verifier for a chip that is not here; nothing is compiled or run, so this
proves the kernels *lower* (block shapes, dtypes, ops the chip's dialect accepts), and, through
``kernels/budgets.py``, that their estimated VMEM / shared memory fits, not that they compile or how
fast they are (docs/hardware.md). Each lowering must hold the real kernel's custom call, and no
host callback (an interpreted kernel would be one).

The matrix: impl x chip x dtype x mask configuration, each case one forward+backward lowering
(``value_and_grad``, so the forward kernel and every backward kernel are in it) at per-device shapes
of 1K-8K tokens and the default tiles; the three configurations are causal + GQA (d = 128);
window + segment ids + MQA + zigzag (d = 64); causal + segment ids (d = 256). Forward-only programs
per impl x dtype, and ``ring_attention`` on global arrays per impl, beside it. The kernels take no
bias: a key-only bias makes ``impl="auto"`` lower the XLA hop. Programmable attention (soft-cap,
``mask_fn``, ``score_fn``, d_v != d) lowers in every kernel, once per impl; a user function that indexes
an array (a gather) does not, and ``impl="auto"`` lowers the XLA hop for it.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from ringattn_fast import ring_attention, ring_attention_shard
from ringattn_fast.kernels import budgets
from ringattn_fast.kernels import pallas_tpu_fused as fused
from ringattn_fast.schedule import HopConfig, KVShard, QShard
from ringattn_ref import variants

from helpers import alibi_from_head

pytestmark = pytest.mark.slow  # 126 cross-lowerings, ~1 min: CI runs them, the quick loop does not

TPU = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "v4": "TPU v4"}
GPU = {"A100": "NVIDIA A100-SXM4-80GB", "H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
DTYPES = ("bfloat16", "float16", "float32")
KERNELS = {"pallas_tpu": ("ring_hop_fwd_tpu", "ring_hop_bwd_dq_tpu", "ring_hop_bwd_dkv_tpu"),
           "pallas_tpu_fused": ("ring_fused_fwd_tpu", "ring_fused_bwd_tpu"),
           "pallas_gpu": ("ring_hop_fwd", "ring_hop_bwd_dq", "ring_hop_bwd_dkv")}
# (devices, s_local, heads, kv_heads, dim, mask keywords, segment ids?)
CONFIGS = (
    dict(n=4, s=2048, h=8, hk=2, d=128, mask=dict(causal=True)),
    dict(n=8, s=1024, h=8, hk=1, d=64, mask=dict(window=(256, 0), layout="zigzag"), seg=True),
    dict(n=4, s=8192, h=4, hk=4, d=256, mask=dict(causal=True), seg=True),
)


def abstract_mesh(kind, n, axis="sp"):
    platform = "tpu" if kind.startswith("TPU") else "cuda"
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return AbstractMesh((n,), (axis,), (AxisType.Explicit,), abstract_device=device)


def structs(mesh, b, s, h, hk, d, dtype, seg, d_v=None, s_kv=None):
    """Global ShapeDtypeStructs sharded like the ring's inputs (Explicit axes need the sharding); v is
    ``d_v`` wide (None: d); k, v hold ``s_kv`` tokens (None: s, the queries')."""
    sharding = jax.NamedSharding(mesh, jax.P(None, "sp"))
    shard = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    sk = s if s_kv is None else s_kv
    out = [shard((b, s, h, d), dtype), shard((b, sk, hk, d), dtype), shard((b, sk, hk, d if d_v is None else d_v), dtype)]
    return out + ([shard((b, s), jnp.int32)] if seg else [])


def lower_shard(kind, impl, dtype, *, n, s, h, hk, d, mask, seg=False, backward=True, d_v=None, s_kv=None, **kw):
    """The text of ``ring_attention_shard`` in a shard_map over an abstract mesh of ``kind``, lowered
    (forward, or forward+backward through ``value_and_grad``); ``s_kv``: the keys' tokens per device
    (cross-attention; None: s)."""
    mesh = abstract_mesh(kind, n)

    def per_host(q, k, v, *segment_ids):
        return ring_attention_shard(q, k, v, axis_name="sp", impl=impl, segment_ids=segment_ids[0] if seg else None,
                                    **mask, **kw)

    spec = jax.P(None, "sp")
    ring = jax.shard_map(per_host, mesh=mesh, in_specs=(spec,) * (4 if seg else 3), out_specs=spec)
    loss = lambda q, k, v, *rest: ring(q, k, v, *rest).astype(jnp.float32).sum()  # noqa: E731
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2)) if backward else ring
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*structs(mesh, 1, n * s, h, hk, d, jnp.dtype(dtype), seg, d_v,
                                                None if s_kv is None else n * s_kv)).lower().as_text()


def kernels_in(text):
    """Names of the Pallas kernels (TPU ``kernel_name``, Triton ``name``) in a lowered module."""
    tpu = re.findall(r'kernel_name = "([A-Za-z0-9_]+)"', text)
    gpu = re.findall(r'name = "(ring_[A-Za-z0-9_]+)"', text) if "__gpu$xla.gpu.triton" in text else []
    return set(tpu) | set(gpu)


FUSED_BACKWARD = "ring_hop_bwd_fused_tpu"  # pallas_tpu's one-kernel backward, where it applies and fits
ONE_PASS = "ring_fused_bwd_one_pass_tpu"  # pallas_tpu_fused's one-pass backward, where it applies and fits


def assert_real_kernels(text, impl, backward=True):
    want, have = set(KERNELS[impl]) if backward else {KERNELS[impl][0]}, kernels_in(text)
    if impl == "pallas_tpu" and FUSED_BACKWARD in have:  # the fused backward replaces the dQ and dK/dV kernels
        want = {KERNELS[impl][0], FUSED_BACKWARD}
    if impl == "pallas_tpu_fused" and ONE_PASS in have:  # the one-pass backward replaces the two-pass one
        want = {KERNELS[impl][0], ONE_PASS}
    assert want <= have, (impl, sorted(have))
    assert ("tpu_custom_call" if impl.startswith("pallas_tpu") else "__gpu$xla.gpu.triton") in text
    assert "callback" not in text  # an interpreted kernel lowers to host callbacks


MATRIX = ([(impl, chip, dt, c) for impl in ("pallas_tpu", "pallas_tpu_fused") for chip in TPU for dt in DTYPES
           for c in range(len(CONFIGS))]
          + [("pallas_gpu", chip, dt, c) for chip in GPU for dt in DTYPES for c in range(len(CONFIGS))])


@pytest.mark.parametrize("impl, chip, dtype, config", MATRIX)
def test_kernel_lowers_for_its_chip(impl, chip, dtype, config):
    text = lower_shard({**TPU, **GPU}[chip], impl, dtype, **CONFIGS[config])
    assert_real_kernels(text, impl)


FORWARD_CHIP = {"pallas_tpu": TPU["v5e"], "pallas_tpu_fused": TPU["v6e"], "pallas_gpu": GPU["H100"]}


@pytest.mark.parametrize("impl, dtype", [(impl, dt) for impl in FORWARD_CHIP for dt in DTYPES])
def test_forward_only_lowers_the_forward_kernel(impl, dtype):
    """A forward-only program (no residuals kept for a backward) lowers only the forward kernel."""
    config = CONFIGS[DTYPES.index(dtype) % len(CONFIGS)]
    text = lower_shard(FORWARD_CHIP[impl], impl, dtype, backward=False, **config)
    assert_real_kernels(text, impl, backward=False)
    assert not set(KERNELS[impl][1:]) & kernels_in(text)


@pytest.mark.parametrize("impl", list(FORWARD_CHIP))
def test_global_arrays_lower_every_explicit_impl(impl):
    """``ring_attention`` on global arrays over the abstract mesh with the impl named: the same kernels as
    through ``ring_attention_shard`` (the front door pads, permutes and shards, then calls them)."""
    mesh = abstract_mesh(FORWARD_CHIP[impl], 4)
    q, k, v = structs(mesh, 1, 4 * 2048, 8, 2, 128, jnp.bfloat16, False)

    def loss(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, causal=True, layout="zigzag", impl=impl).astype(jnp.float32).sum()

    with use_abstract_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()
    assert_real_kernels(text, impl)


PROGRAMMED = dict(logit_softcap=30.0, mask_fn=variants.chunked_local(512), score_fn=alibi_from_head(8))


@pytest.mark.parametrize("impl", list(FORWARD_CHIP))
def test_programmable_attention_lowers(impl):
    """Soft-cap, a chunked-local ``mask_fn``, ALiBi as a ``score_fn`` and v of width 64 beside q, k of
    width 128, causal + GQA: every kernel of the impl lowers, forward and backward."""
    text = lower_shard(FORWARD_CHIP[impl], impl, "bfloat16", d_v=64, **dict(CONFIGS[0], s=1024), **PROGRAMMED)
    assert_real_kernels(text, impl)


@pytest.mark.parametrize("impl, dtype", [(impl, dt) for impl in FORWARD_CHIP for dt in DTYPES])
def test_cross_attention_lowers(impl, dtype):
    """Queries and keys of their own lengths (512 and 1024 tokens per device), causal, in every dtype the
    kernels take: every kernel of the impl lowers, forward and backward (the fused ring streams each at
    its own length)."""
    text = lower_shard(FORWARD_CHIP[impl], impl, dtype, **dict(CONFIGS[0], s=512), s_kv=1024)
    assert_real_kernels(text, impl)


@pytest.mark.parametrize("impl, config", [(impl, c) for impl in FORWARD_CHIP for c in (0, 1)])
def test_kernels_lower_with_x64_enabled(impl, config):
    """With ``jax_enable_x64`` on (users turn it on for other reasons), every kernel still lowers,
    forward and backward: indices inside the kernels stay 32-bit. Mosaic's ``tpu.memref_slice`` takes
    i32 only, and the fused ring's Python-int indices (``buf.at[0]``, ``sems.at[a, buf]``) became i64
    and failed its verifier."""
    jax.config.update("jax_enable_x64", True)
    try:
        text = lower_shard(FORWARD_CHIP[impl], impl, "bfloat16", **dict(CONFIGS[config], s=min(2048, CONFIGS[config]["s"])))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert_real_kernels(text, impl)


def test_a_gathering_score_fn_lowers_the_xla_hop_under_auto():
    """``variants.alibi`` indexes its slopes by head (a gather, which Mosaic and Triton do not lower): on a
    TPU mesh ``impl="auto"`` lowers the XLA hop for it, an explicit Pallas impl is a ValueError saying so."""
    alibi = dict(score_fn=variants.alibi(variants.alibi_slopes(8)))
    text = lower_shard(TPU["v5e"], "auto", "bfloat16", **dict(CONFIGS[0], s=1024), **alibi)
    assert not kernels_in(text) and "tpu_custom_call" not in text
    with pytest.raises(ValueError, match=r"impl='pallas_tpu': score_fn indexes an array \(a gather"):
        lower_shard(TPU["v5e"], "pallas_tpu", "bfloat16", **dict(CONFIGS[0], s=1024), **alibi)


@pytest.mark.parametrize("kind", ["NVIDIA L4", "TPU v9"])
def test_auto_on_a_chip_without_a_memory_row_lowers_the_xla_hop(kind):
    """"auto" picks a kernel only where ``kernels.budgets`` can check its tiles; elsewhere the XLA hop
    (an explicit Pallas impl there is a ValueError naming device_kind: the test below)."""
    mesh = abstract_mesh(kind, 4)
    q, k, v = structs(mesh, 1, 4 * 1024, 8, 2, 128, jnp.bfloat16, False)
    with use_abstract_mesh(mesh):
        text = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True)).trace(q, k, v).lower().as_text()
    assert not kernels_in(text) and "tpu_custom_call" not in text and "triton" not in text


@pytest.mark.parametrize("kind, want", [(TPU["v5e"], "pallas_tpu_fused"), (GPU["A100"], "pallas_gpu")])
def test_global_arrays_and_auto_follow_the_mesh(kind, want):
    """``ring_attention`` on global arrays over the abstract mesh, impl="auto": the mesh's platform
    picks the kernel (no monkeypatching, whatever ``jax.default_backend()`` says); a key-only bias
    (which no kernel takes) makes "auto" lower the XLA hop instead."""
    mesh = abstract_mesh(kind, 4)
    q, k, v = structs(mesh, 2, 4 * 1024, 8, 2, 128, jnp.bfloat16, False)
    bias = jax.ShapeDtypeStruct((2, 1, 1, 4 * 1024), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P()))

    def loss(q, k, v, *bias):
        o = ring_attention(q, k, v, mesh=mesh, causal=True, bias=bias[0] if bias else None)
        return o.astype(jnp.float32).sum()

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    with use_abstract_mesh(mesh):
        text = jax.jit(grad).trace(q, k, v).lower().as_text()
        with_bias = jax.jit(grad).trace(q, k, v, bias).lower().as_text()
    assert jax.default_backend() == "cpu"
    assert_real_kernels(text, want)
    assert not kernels_in(with_bias) and "tpu_custom_call" not in with_bias


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("impl", ["auto", "pallas_tpu", "pallas_tpu_fused"])
def test_a_ring_of_one_chip_lowers(impl, dtype):
    """A ring of one TPU chip (``make_mesh(1)``; what a one-chip machine gives): every TPU impl and the
    default, forward and backward, on global arrays and through ``ring_attention_shard``. The fused
    ring's kernel has no barrier at N = 1, and Mosaic refuses a collective id without one (it raised on
    a real v5e); ``ring_attention`` runs a ring of one as one hop of the per-hop kernels."""
    mesh = abstract_mesh(TPU["v5e"], 1)
    q, k, v = structs(mesh, 1, 4096, 8, 2, 128, jnp.dtype(dtype), False)

    def loss(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, causal=True, impl=impl).astype(jnp.float32).sum()

    with use_abstract_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()
    assert_real_kernels(text, "pallas_tpu")  # N = 1: the per-hop kernels are the ring
    if impl == "pallas_tpu_fused":  # the fused kernel itself, called inside shard_map on one device
        assert_real_kernels(lower_fused_alone(mesh, q, k, v), impl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("fused_bwd", [True, False])
def test_the_opt_in_forms_lower_on_one_chip(fused_bwd, dtype, monkeypatch):
    """The opt-in forms, ``pallas_tpu.EXP2`` (base-2 logits: ``exp2`` in Mosaic) and ``FULL_TILE_WHERE`` (dS
    zeroed on full tiles too), lower for a ring of one v5e in every dtype, forward and either backward (fused;
    key-major dK/dV beside dQ)."""
    from ringattn_fast.kernels import pallas_tpu
    for name, value in dict(EXP2=True, FULL_TILE_WHERE=True, FUSED_BWD=fused_bwd, KEY_MAJOR_DKV=True).items():
        monkeypatch.setattr(pallas_tpu, name, value)
    mesh = abstract_mesh(TPU["v5e"], 1)
    q, k, v = structs(mesh, 1, 4096, 8, 2, 128, jnp.dtype(dtype), False)

    def loss(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, causal=True, impl="pallas_tpu").astype(jnp.float32).sum()

    jax.clear_caches()  # the module flags are read while tracing: no trace of another setting may be reused
    try:
        with use_abstract_mesh(mesh):
            text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()
    finally:
        jax.clear_caches()
    assert_real_kernels(text, "pallas_tpu")
    assert ("ring_hop_bwd_fused_tpu" in text) == fused_bwd


def lower_fused_alone(mesh, q, k, v):
    """``fused_ring_attention_shard`` itself (no front door) in a shard_map over ``mesh``, fwd+bwd, lowered."""
    def per_host(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32)[None], q.shape[:2])
        return fused.fused_ring_attention_shard(QShard(q, pos), KVShard(k, v, pos), HopConfig(causal=True),
                                                axis_name="sp")

    ring = jax.shard_map(per_host, mesh=mesh, in_specs=(jax.P(None, "sp"),) * 3, out_specs=jax.P(None, "sp"))
    loss = lambda q, k, v: ring(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    with use_abstract_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().as_text()


@pytest.mark.parametrize("kind", [TPU["v5e"], TPU["v6e"]])
def test_fused_ring_lowers_at_32k_tokens_per_device(kind):
    """The fused ring streams from HBM: 32K tokens per device, d = 128, bfloat16, default tiles; its
    VMEM estimate is the same as at 1K (it does not grow with s_local) and fits the default limit."""
    text = lower_shard(kind, "pallas_tpu_fused", "bfloat16", n=4, s=32768, h=8, hk=2, d=128, mask=dict(causal=True))
    assert_real_kernels(text, "pallas_tpu_fused")
    hop = HopConfig(block_q=128, block_kv=128)
    at = lambda s: [f.vmem for f in fused.footprints(hop, (1, s, 8, 128), (1, s, 2, 128),  # noqa: E731
                                                     jnp.bfloat16, n=4)]
    assert at(1024) == at(32768) and max(at(32768)) < budgets.HEADROOM * budgets.chip(kind).default_limit


def test_fused_backward_runs_in_one_pass_where_it_fits():
    """The fused ring's backward runs in one pass (`fused_ring_bwd`, a kv head's dK/dV of the shard in VMEM)
    where that fits the chip, with the vmem limit it needs, and in two passes otherwise: a shard too long
    for VMEM, a program (its tables are query-major, the one-pass tile key-major), a block_q that is not a
    multiple of 128 lanes; interpreted (no chip) always in one pass, unless ``ONE_PASS`` is off."""
    from ringattn_fast.kernels import fused_ring_bwd
    v5e, hop = budgets.chip(TPU["v5e"]), HopConfig(block_q=1024, block_kv=1024)
    form = lambda hop, s, chip=v5e: fused._one_pass(hop, (1, s, 8, 128), (1, s, 8, 128), jnp.bfloat16,  # noqa: E731
                                                    n=1, has_seg=False, chip=chip)
    one, limit = form(hop, 16384)
    assert one and limit is not None and limit > v5e.default_limit  # 16 MiB of dK/dV: over the default
    assert form(hop, 1 << 20) == (False, None)                     # 1 GiB of dK/dV: two passes
    assert form(HopConfig(block_q=1024, block_kv=1024, logit_softcap=30.0), 16384) == (False, None)
    assert form(HopConfig(block_q=8, block_kv=1024), 16384) == (False, None)
    assert form(HopConfig(block_q=8, block_kv=8), 1 << 20, chip=None) == (True, None)
    try:
        fused_ring_bwd.ONE_PASS = False
        assert form(hop, 16384) == (False, None)
    finally:
        fused_ring_bwd.ONE_PASS = True


def test_fused_forward_holds_kv_whole_where_it_fits(monkeypatch):
    """The fused ring's forward holds a kv head's K/V of the shard in VMEM where that fits the chip (with the
    vmem limit it needs), streams K/V tiles otherwise (interpreted: always whole, unless ``WHOLE_KV`` is
    off); with both whole-shard forms off, the streaming forward and the two-pass backward lower for a v5e."""
    from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd
    v5e, hop = budgets.chip(TPU["v5e"]), HopConfig(block_q=1024, block_kv=1024)
    form = lambda s, chip=v5e, h=32: fused._whole_kv(hop, (1, s, h, 128), (1, s, 8, 128), jnp.bfloat16,  # noqa: E731
                                                     n=1, has_seg=False, chip=chip)
    whole, limit = form(16384)
    assert whole and limit is not None and limit > v5e.default_limit  # 8 MiB of K/V and 1024-wide tiles
    assert form(1 << 20) == (False, None)                           # 512 MiB of K/V: streamed
    assert form(1 << 20, chip=None) == (True, None)
    assert form(16384, h=8)[0] and form(16384, h=8, chip=None) == (True, None)  # no GQA: whole too
    monkeypatch.setattr(fused_ring_fwd, "WHOLE_KV", False)
    monkeypatch.setattr(fused_ring_bwd, "ONE_PASS", False)
    assert form(16384) == (False, None)
    text = lower_shard(TPU["v5e"], "pallas_tpu_fused", "bfloat16", **CONFIGS[0])
    assert kernels_in(text) == set(KERNELS["pallas_tpu_fused"])


def test_vmem_limit_is_raised_where_the_default_is_too_small():
    """1024 x 1024 tiles of the per-hop kernel on a v5e: over the 16 MiB default scoped limit, within
    the chip's 128 MiB, so each kernel is compiled with vmem_limit_bytes (its custom call's
    ``scoped_memory_configs``, memory space 1 = VMEM: the forward and the fused backward, whose dK/dV of
    the whole shard sit in VMEM); a forward of 128 x 128 tiles needs no such setting."""
    config = dict(CONFIGS[0], s=4096)
    text = lower_shard(TPU["v5e"], "pallas_tpu", "float32", block_q=1024, block_kv=1024, **config)
    assert_real_kernels(text, "pallas_tpu")
    sizes = [int(x) for x in re.findall(r'scoped_memory_configs\\22: \[\{\\22memory_space\\22:1, '
                                        r'\\22offset\\22: 0, \\22size\\22: (\d+)', text)]
    # one per kernel function: the forward, the fused backward, and the fused backward of the own hop's two
    # halves of query rows (its own shape: ringattn_fast.backward.row_halves)
    assert len(sizes) == 3 and len(kernels_in(text)) == 2, sizes
    assert all(16 * budgets.MiB < x <= budgets.chip(TPU["v5e"]).max_limit for x in sizes), sizes
    assert "scoped_memory_configs" not in lower_shard(TPU["v5e"], "pallas_tpu", "float32", block_q=128, block_kv=128,
                                                      backward=False, **config)


def test_over_budget_is_a_value_error_naming_the_blocks():
    """On a v4 (16 MiB of VMEM) 4096 x 4096 tiles cannot fit: a ValueError before lowering, naming
    block_q / block_kv, the estimate and tiles that fit."""
    with pytest.raises(ValueError, match=r"impl='pallas_tpu': block_q=4096, block_kv=4096 do not fit a v4: "
                                         r"ring_hop_fwd_tpu needs an estimated [0-9.]+ MiB of VMEM.*block_q=\d+, "
                                         r"block_kv=\d+ fit"):
        lower_shard(TPU["v4"], "pallas_tpu", "float32", block_q=4096, block_kv=4096, **dict(CONFIGS[0], s=8192))
    with pytest.raises(ValueError, match=r"impl='pallas_gpu': block_q=256, block_kv=256 do not fit a A100: .*shared "
                                         r"memory.*fit"):
        lower_shard(GPU["A100"], "pallas_gpu", "float32", block_q=256, block_kv=256, **CONFIGS[0])
    with pytest.raises(ValueError, match=r"impl='pallas_tpu_fused': block_q=2048, block_kv=2048 do not fit a v4: "
                                         r"the fused forward needs an estimated [0-9.]+ MiB of VMEM.*fit"):
        lower_shard(TPU["v4"], "pallas_tpu_fused", "float32", block_q=2048, block_kv=2048, **CONFIGS[0])


HINTS = [(TPU["v4"], "pallas_tpu", "float32", 4096, dict(CONFIGS[0], s=8192)),
         (TPU["v4"], "pallas_tpu_fused", "float32", 2048, CONFIGS[0]),
         (GPU["A100"], "pallas_gpu", "float32", 256, CONFIGS[0]),
         (GPU["A100"], "pallas_gpu", "bfloat16", 256, dict(CONFIGS[2], s=2048))]


@pytest.mark.parametrize("kind, impl, dtype, block, config", HINTS)
def test_a_budget_errors_suggestion_fed_back_lowers(kind, impl, dtype, block, config):
    """A budget error suggests only tiles that the same estimate accepts for the forward and every backward
    kernel: fed back, forward and backward lower (a forward-only hint was once refused by the backward's
    check: v4, 4096 x 4096 -> 1024 x 512, refused; A100 with d = 256 likewise)."""
    with pytest.raises(ValueError, match=r"do not fit") as err:
        lower_shard(kind, impl, dtype, block_q=block, block_kv=block, **config)
    hint = re.search(r"block_q=(\d+), block_kv=(\d+) fit, forward and backward", str(err.value))
    assert hint, str(err.value)
    text = lower_shard(kind, impl, dtype, block_q=int(hint[1]), block_kv=int(hint[2]), **config)
    assert_real_kernels(text, impl)


def test_budget_arithmetic():
    """The pieces the estimates are made of: Mosaic's tile padding, the chip lookup, the tile candidates."""
    assert budgets.tile_bytes((128, 1), jnp.float32) == 128 * 128 * 4      # a column costs 128 lanes
    assert budgets.tile_bytes((2, 8, 100), jnp.bfloat16) == 2 * 16 * 128 * 2  # bf16 rows come in 16s
    assert budgets.tpu_vmem_bytes(blocks=[((8, 128), jnp.float32)], scratch=[((8, 128), jnp.float32)]) == 3 * 4096
    assert budgets.chip("NVIDIA A100-SXM4-40GB").name == "A100" and budgets.chip("TPU v5e").name == "v5e"
    with pytest.raises(ValueError, match="device_kind 'NVIDIA GH200 480GB' is not in"):
        budgets.chip("NVIDIA GH200 480GB")
    assert budgets.candidate_blocks(96, multiple=8, top=128) == [96, 32, 16, 8]  # the shard, then powers of two
    assert budgets.candidate_blocks(4096, multiple=128, top=1024) == [1024, 512, 256, 128]
    v5e = budgets.chip("TPU v5 lite")
    assert budgets.vmem_limit(v5e, [budgets.Footprint(8 * budgets.MiB)]) is None
    assert budgets.vmem_limit(v5e, [budgets.Footprint(40 * budgets.MiB)]) == 50 * budgets.MiB


@pytest.mark.parametrize("impl, kind, platform", [("pallas_tpu", GPU["H100"], "cuda"),
                                                  ("pallas_tpu_fused", GPU["A100"], "cuda"),
                                                  ("pallas_gpu", TPU["v5e"], "tpu")])
def test_an_impl_on_the_wrong_platform_is_a_value_error(impl, kind, platform):
    with pytest.raises(ValueError, match=f"impl='{impl}' cannot run on '{platform}' devices"):
        lower_shard(kind, impl, "bfloat16", **CONFIGS[0])


def test_an_unknown_chip_is_a_value_error_naming_device_kind():
    with pytest.raises(ValueError, match=r"device_kind 'TPU v9' is not in the kernels' memory table.*known: "
                                         r"\['TPU v4'"):
        lower_shard("TPU v9", "pallas_tpu", "bfloat16", **CONFIGS[0])


def test_default_tiles_fit_every_target_at_32k():
    """The kernels' default tiles at s_local = 32K, d = 128 fit every chip in the table, forward and
    backward, in every dtype (A100 float32 gets the smallest: the dK/dV program streams two Q tiles)."""
    from ringattn_fast.kernels import pallas_gpu, pallas_tpu

    q, k = (1, 32768, 8, 128), (1, 32768, 2, 128)
    for kind in list(TPU.values()) + list(GPU.values()):
        device = AbstractDevice(device_kind=kind, num_cores=1, platform="tpu" if kind.startswith("TPU") else "cuda")
        chip = budgets.chip(kind)
        for dtype in DTYPES:
            dt = jnp.dtype(dtype)
            if chip.platform == "tpu":
                bq, bk = fused.default_blocks(q, k, dt, device, n=8)
                assert 128 <= min(bq, bk) and max(bq, bk) <= fused.TUNED, (kind, dtype, bq, bk)
                if chip.name in ("v5e", "v6e"):  # the chip-measured target itself
                    assert (bq, bk) == (fused.TUNED, fused.TUNED), (kind, dtype, bq, bk)
                assert all(budgets.fits(chip, f) for f in fused.footprints(HopConfig(block_q=bq, block_kv=bk), q, k,
                                                                            dt, n=8))
                # the per-hop kernel: the chip-measured targets (pallas_tpu.TUNED), shrunk to fit
                for backward, blocks in ((False, pallas_tpu.default_blocks(q, k, dt, device, n=8)),
                                         (True, pallas_tpu.default_bwd_blocks(q, k, dt, device))):
                    top = pallas_tpu.TUNED["bwd" if backward else "fwd"]
                    assert 128 <= min(blocks) and max(blocks) <= top, (kind, dtype, backward, blocks)
                    cfg = HopConfig(block_q=blocks[0], block_kv=blocks[1])
                    assert all(budgets.fits(chip, f) for f in pallas_tpu.footprints(cfg, q, k, dt, backward))
                    if chip.name in ("v5e", "v6e"):  # 128 MiB of VMEM: the targets themselves
                        assert blocks == (top, top), (kind, dtype, backward, blocks)
            else:
                bq, bk = pallas_gpu.default_blocks(q, k, dt, device)
                est = pallas_gpu.footprints(HopConfig(block_q=bq, block_kv=bk), q, k, dt, False)
                est += pallas_gpu.footprints(HopConfig(block_q=bq, block_kv=bk), q, k, dt, True)
                assert bq >= 16 and bk >= 16 and all(budgets.fits(chip, f) for f in est), (kind, dtype)


def test_the_hardware_page_example_runs_as_written():
    """docs/hardware.md's example (lower the fused ring for an absent v5e) runs as written."""
    import pathlib
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "hardware.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    exec(compile(block, "docs/hardware.md", "exec"), {})


def test_default_forward_tiles_of_wide_heads():
    """Past d = 128 the forward's target is ``TUNED["fwd_wide"]`` (on a v5e its 2048 x 2048 tile was 2.2x
    slower than 1024 x 1024 at d = 256, causal, 16K tokens); the backward's is the same for every width."""
    from ringattn_fast.kernels import pallas_tpu

    device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    for d, fwd in ((64, "fwd"), (128, "fwd"), (256, "fwd_wide")):
        q, k = (1, 16384, 8, d), (1, 16384, 8, d)
        top = pallas_tpu.TUNED[fwd]
        assert pallas_tpu.default_blocks(q, k, jnp.bfloat16, device) == (top, top), d
        assert pallas_tpu.default_bwd_blocks(q, k, jnp.bfloat16, device) == (pallas_tpu.TUNED["bwd"],) * 2, d


@pytest.mark.parametrize("chip_name, unit", [("H100", "KiB"), ("TPU v5e", "MiB")])
@pytest.mark.parametrize("shape, names_16_bit", [("head dim 1024, float32", True), ("head dim 1024, bfloat16", False)])
def test_a_budget_error_names_sizes_and_remedies_that_apply(chip_name, unit, shape, names_16_bit):
    """The chip's limit in a unit that shows it (a GPU's shared memory read "0 MiB"), and "a 16-bit dtype" as a
    remedy only when the inputs are not 16-bit already."""
    from ringattn_fast.kernels import budgets
    chip = budgets.chip(chip_name)
    too_big = lambda bq, bk: [budgets.Footprint(2 * chip.max_limit, 0, "kernel")]  # noqa: E731
    with pytest.raises(ValueError) as err:
        budgets.check_fit("pallas", chip, too_big, block_q=64, block_kv=64, q_blocks=[64], kv_blocks=[64],
                          shape=shape)
    message = str(err.value)
    assert re.search(rf"of the [0-9.]+ {unit} a kernel may use", message) and " 0 MiB" not in message, message
    assert ("16-bit dtype" in message) == names_16_bit, message


def test_float32_budgets_leave_room_for_full_precision_matmuls():
    """Under ``jax.default_matmul_precision("highest")`` Mosaic splits float32 matmul operands into bfloat16
    parts: the fused backward at 1024 x 1024 tiles (float32, a window and segment ids, 2K tokens) needed
    33.24 MiB of scoped VMEM on a v5e under JAX 0.10.2 and was planned 33 MiB, so the default call failed
    to compile on the chip. float32 footprints count those parts; 16-bit ones do not change."""
    from ringattn_fast.kernels import pallas_tpu
    chip = budgets.chip("TPU v5 lite")
    cfg = HopConfig(block_q=1024, block_kv=1024, window=(384, 0))
    shape = (1, 2048, 8, 128)
    limit = lambda dt: budgets.vmem_limit(chip, [pallas_tpu._fused_footprint(cfg, shape, shape, dt, 128)])  # noqa: E731
    assert limit(jnp.float32) >= 36 * 2 ** 20  # 33.24 MiB needed, with room to spare
    assert pallas_tpu._split_temps(jnp.float32) == 2 and pallas_tpu._split_temps(jnp.bfloat16) == 0
