"""Compiled for TPU slices no one here has: the real XLA:TPU and Mosaic compilers, no chip.

``tests/_tpu_compile.py`` (a subprocess with libtpu, installed beside the venv by ``scripts/setup-libtpu``,
on its PYTHONPATH: in this process libtpu would make every JAX backend query try a TPU) compiles
``ring_attention`` forward+backward at its default tiles, per-hop kernel and fused ring, for 8-chip
v5e, v6e (``chip_config_name="default"``), v4 and v5p (``"megacore"``) slices, and the default call on one
v5e chip, which is how a real v5e first showed a bug no lowering could (the fused ring's collective id
without a barrier at N = 1). Lowering (tests/test_lowering.py) stops at Mosaic's verifier; compiling also
allocates VMEM, and a control kernel that cannot fit it must be rejected. The same compile reads the
forward+backward's temp memory on one v5e chip, held here at most 1.5x splash attention's (issue 30), and
(``benchmarks/schedule_tpu.py``) the kernels' static VLIW schedules. From the same compiled programs'
schedules (``benchmarks/overlap.py``, issue 45): every transfer of the ring, forward and backward, has compute
scheduled between its start and its done, on every slice, and a control ring whose transfer the kernel waits
for is reported exposed.
Without libtpu the test skips, unless ``RINGATTN_REQUIRE_LIBTPU=1`` (CI) makes that a failure.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # about 3 minutes of compiles on 2 cores
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICES = ("v5e", "v6e", "v4", "v5p")  # tests/_tpu_compile.py's 8-chip slices
MEMORY_RATIO = 1.5  # issue 30: forward+backward temp bytes <= 1.5x splash attention's at 16K and 32K


def with_libtpu(*argv, skip_on=None):
    """The JSON rows ``python *argv`` prints, run from the repository root with libtpu on its PYTHONPATH; skips
    (fails under ``RINGATTN_REQUIRE_LIBTPU=1``) where libtpu is not installed beside the venv, and where the
    command exits with ``skip_on``."""
    target = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "libtpu")
    if not os.path.isdir(os.path.join(target, "libtpu")):
        if os.environ.get("RINGATTN_REQUIRE_LIBTPU") == "1":
            pytest.fail(f"libtpu is not installed in {target} (scripts/setup-libtpu)")
        pytest.skip(f"libtpu is not installed in {target}: run scripts/setup-libtpu {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    env["PYTHONPATH"] = os.pathsep.join([target, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if skip_on is not None and proc.returncode == skip_on:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled():
    return with_libtpu(os.path.join(ROOT, "tests", "_tpu_compile.py"))


def test_the_ring_compiles_for_eight_chip_slices(compiled):
    rings = [r for r in compiled if r["case"] == "ring"]
    assert {(r["chip"], r["impl"]) for r in rings} == {(c, i) for c in SLICES for i in ("pallas_tpu", "pallas_tpu_fused")}
    for r in rings:
        assert r["ok"], r
        # the fused backward in one pass where a kv head's K/V and dK/dV of the 4K-token shard fit VMEM; on a v4
        # (16 MiB) they and its 1024 x 256 tiles need an estimated 12.5 MiB, over its budget: two passes there
        one_pass = "ring_fused_bwd_tpu" if r["chip"] == "v4" else "ring_fused_bwd_one_pass_tpu"
        want = ({"ring_fused_fwd_tpu", one_pass} if r["impl"] == "pallas_tpu_fused" else
                {"ring_hop_fwd_tpu", "ring_hop_bwd_fused_tpu"} if "ring_hop_bwd_fused_tpu" in r["kernels"] else
                {"ring_hop_fwd_tpu", "ring_hop_bwd_dq_tpu", "ring_hop_bwd_dkv_tpu"})
        assert want == set(r["kernels"]), r


def _hiding_rows(compiled):
    """(target, impl, causal, row) of every per-hop ring compiled: the causal GQA ``ring`` rows and ``hiding``'s."""
    rows = [(r["chip"], r["impl"], True, r) for r in compiled if r["case"] == "ring" and r["impl"] != "pallas_tpu_fused"]
    return rows + [(r["target"], r["impl"], r["causal"], r) for r in compiled if r["case"] == "hiding"]


def test_every_ring_transfer_hidden_and_the_control_exposed(compiled, record_property):
    """8 chips, 4096 tokens a chip: every collective-permute of the per-hop ring, forward (K and V stacked,
    positions) and backward (those, and the stacked float32 dK/dV accumulators), has a kernel scheduled between
    its start and its done and none is synchronous: GQA causal on every slice (v5e, v6e, v4, v5p), 8 heads not
    causal on v5e, and the XLA hop causal on v5e. Before issue 45's delayed accumulators none of the backward's
    was. The control ring's transfers are all exposed, so the reader can tell."""
    rows = _hiding_rows(compiled)
    record_property("hiding", [(t, i, c, r["fwd"], r["bwd"], r["temp_mib"]) for t, i, c, r in rows])
    (control,) = [r for t, i, c, r in rows if i == "control"]
    assert control["transfers"] > 0 and control["hidden"] == 0, control
    assert {t for t, i, c, r in rows if i == "pallas_tpu"} == set(SLICES), rows
    for t, i, c, r in rows:
        if i != "control":
            (fsent, fhidden), (bsent, bhidden) = r["fwd"], r["bwd"]
            assert r["synchronous"] == 0 and fsent >= 2 and fhidden == fsent, (t, i, c, r)
            assert bsent >= 7 and bhidden == bsent, (t, i, c, r)


def test_the_default_call_compiles_on_one_chip(compiled):
    (row,) = [r for r in compiled if r["case"] == "one_chip"]
    assert row["ok"] and "ring_hop_fwd_tpu" in row["kernels"], row


def test_memory_within_splash_attentions(compiled):
    rows = {r["seq"]: r for r in compiled if r["case"] == "memory"}
    assert set(rows) == {16384, 32768}
    for r in rows.values():
        assert r["ratio"] <= MEMORY_RATIO, r


def test_a_kernel_that_overflows_vmem_is_rejected(compiled):
    (row,) = [r for r in compiled if r["case"] == "control"]
    assert row["rejected"] and "vmem" in row["error"].lower(), row


def test_static_schedules_of_the_kernels():
    """``benchmarks/schedule_tpu.py`` reads each kernel's VLIW bundles from a compile for a v5e with no chip:
    the backward's tile stretch holds the 5 matmuls of a 1024 x 1024 tile (2560 pushes of 16 x 128 x 128,
    as splash attention's dK/dV tile), the forward's the 2 of its 2048 x 2048 tile; and the forms do what
    `pallas_tpu` says they do: base-2 logits (``EXP2``, opt-in) take a multiply a logit out of the
    backward's tile (in ops: with the chunks its bundles are not fewer), the dS where on full tiles
    (``FULL_TILE_WHERE``, shipped off) adds compares and selects to it, and the tiles whole
    (``FWD_ROW_CHUNK``, ``BWD_KEY_CHUNK`` at 0) take more bundles than the chunks shipped in the backward
    and more stores in both (each chunk's logits are a fraction of the tile's)."""
    common = ["-m", "benchmarks.schedule_tpu", "--seq", "2048", "--heads", "2"]
    shipped = {r["kernel"]: r for r in with_libtpu(*common, skip_on=3)}  # 3: this libtpu dumps no bundles
    base2, where, whole = ({r["kernel"]: r for r in with_libtpu(*common, "--kinds", "ours", *form, skip_on=3)}
                           for form in (["--set", "EXP2=True"], ["--set", "FULL_TILE_WHERE=True"],
                                        ["--set", "FWD_ROW_CHUNK=0", "--set", "BWD_KEY_CHUNK=0"]))
    assert {"ring_hop_fwd_tpu", "ring_hop_bwd_fused_tpu", "splash_mha_fwd_residuals",
            "splash_mha_dkv_no_residuals"} <= set(shipped), sorted(shipped)
    tile = lambda rows, kernel: rows[kernel]["tiles"][0]  # noqa: E731  (the largest: non-causal has one path)
    assert tile(shipped, "ring_hop_bwd_fused_tpu")["vmatmul"] == tile(shipped, "splash_mha_dkv_no_residuals")["vmatmul"] \
        == 5 * 1024 * 1024 * 128 // (16 * 128 * 128)
    assert tile(shipped, "ring_hop_fwd_tpu")["vmatmul"] == 2 * 2048 * 2048 * 128 // (16 * 128 * 128)
    bwd = lambda rows: tile(rows, "ring_hop_bwd_fused_tpu")  # noqa: E731
    old, new = bwd(shipped)["ops"], bwd(base2)["ops"]
    assert old["vmul"] - new["vmul"] >= 1000 and old["vexp2"] == new["vexp2"] == 1024, (old, new)
    new = bwd(where)["ops"]
    assert new["vcmp"] - old.get("vcmp", 0) >= 1000 and new["vsel"] - old.get("vsel", 0) >= 1000, (old, new)
    assert bwd(where)["bundles"] > bwd(shipped)["bundles"]
    for kernel in ("ring_hop_fwd_tpu", "ring_hop_bwd_fused_tpu"):
        chunked, unchunked = tile(shipped, kernel), tile(whole, kernel)
        assert chunked["vmatmul"] == unchunked["vmatmul"], kernel
        assert unchunked["ops"]["vst"] > chunked["ops"]["vst"], kernel
    assert bwd(whole)["bundles"] > bwd(shipped)["bundles"]  # (the forward's too at 8K; with one tile a head, not)
