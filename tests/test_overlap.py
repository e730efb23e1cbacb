"""``benchmarks/overlap.py``'s reader of scheduled HLO, on small texts (no libtpu, no CUDA plugin): a transfer is
hidden when some compute (a Mosaic or Triton kernel, a matmul) runs between its ``collective-permute-start`` and
``-done``. The compiled ring's own transfers, on 8-chip TPU slices, are checked in tests/test_compile.py (issue
45); on 8 H100s and 8 A100s here, where the CUDA plugin is installed beside the venv
(``scripts/setup-cuda-plugin``): the test skips without it, unless ``RINGATTN_REQUIRE_CUDA_PLUGIN=1``.
"""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import overlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HLO = """HloModule m, is_scheduled=true

%kernel_body (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %k = f32[8] custom-call(%p), custom_call_target="tpu_custom_call"
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %s0 = (f32[8], f32[8]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %f = f32[8] fusion(%a), kind=kCustom, calls=%kernel_body
  %d0 = f32[8] collective-permute-done(%s0)
  %s1 = (f32[8], f32[8]) collective-permute-start(%f), source_target_pairs={{0,1},{1,0}}
  %d1 = f32[8] collective-permute-done(%s1)
  %c = f32[8] collective-permute(%d1), source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[8] add(%d0, %c)
}
"""

# as XLA:GPU prints a Pallas Triton kernel and an elementwise fusion (no compute) in a loop body
GPU_HLO = """HloModule g, is_scheduled=true

%fused_add (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  ROOT %y = f32[8] add(%x, %x)
}

ENTRY %main (a: bf16[8], b: f32[8]) -> f32[8] {
  %a = bf16[8] parameter(0)
  %b = f32[8] parameter(1)
  %s0 = (bf16[8], bf16[8]) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %pallas_call.1 = f32[8] custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", backend_config={}
  %d0 = bf16[8] collective-permute-done(%s0)
  %s1 = (f32[8], f32[8]) collective-permute-start(%b), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %loop_add_fusion = f32[8] fusion(%pallas_call.1), kind=kLoop, calls=%fused_add
  %d1 = f32[8] collective-permute-done(%s1)
  ROOT %r = f32[8] add(%loop_add_fusion, %d1)
}
"""


def test_the_parser_reads_hidden_exposed_and_synchronous_transfers():
    ts = {t.start: t for t in overlap.transfers(HLO)}
    assert ts["s0"].hidden and ts["s0"].between == ("f",)
    assert not ts["s1"].hidden and not ts["s1"].synchronous
    assert ts["c"].synchronous and not ts["c"].hidden
    assert overlap.summary(HLO)["hidden"] == 1


def test_the_schedule_keeps_kernels_and_transfers_in_order():
    """:func:`overlap.schedule`: per computation with a transfer, its events in schedule order, each transfer's
    array, bytes and hidden flag as :func:`overlap.transfers` reads them (what notebook 06 draws)."""
    sched = overlap.schedule(HLO)
    (main,) = sched["computations"]
    assert main["role"] == "entry" and sched["summary"] == overlap.summary(HLO)
    kinds = [e["kind"] for e in main["events"]]
    assert kinds == ["start", "compute", "done", "start", "done", "start", "done", "other"]
    s0, s1, c = (e for e in main["events"] if e["kind"] == "start")
    assert (s0["id"], s0["sends"], s0["bytes"], s0["hidden"]) == ("s0", "f32[8]", 32, True)
    assert not s1["hidden"] and c["synchronous"] and not c["hidden"]
    assert [e["id"] for e in main["events"] if e["kind"] == "done"] == ["s0", "s1", "c"]


def test_the_parser_counts_a_triton_kernel_and_not_an_elementwise_fusion():
    ts = {t.start: t for t in overlap.transfers(GPU_HLO)}
    assert ts["s0"].hidden and ts["s0"].between == ("pallas_call.1",)
    assert not ts["s1"].hidden  # an add fusion is no compute to hide behind


def test_the_gpu_target_config_is_the_text_the_plugin_embeds(tmp_path):
    """:func:`overlap.gpu_target_config` cuts the NUL-terminated text proto naming the GPU out of the plugin's
    library (here a stand-in file); a GPU it does not embed is an error naming it."""
    spec = '# proto-message: stream_executor.GpuTargetConfigProto\ngpu_device_info {\n  core_count: 132\n}\n' \
           'platform_name: "CUDA"\ndevice_description_str: "NVIDIA H100 80GB HBM3"\n'
    lib = tmp_path / "xla_cuda_plugin.so"
    lib.write_bytes(b"\x7fELF\0other\0" + spec.encode() + b"\0\0# next spec\0")
    assert overlap.gpu_target_config("h100", library=lib) == spec
    with pytest.raises(RuntimeError, match="A100-SXM4-80GB"):
        overlap.gpu_target_config("a100", library=lib)


def test_the_cli_rejects_an_unknown_target():
    with pytest.raises(SystemExit):
        overlap.main(["--targets", "v5e,b200"])


def with_cuda_plugin(*argv):
    """The JSON rows ``python *argv`` prints (its exit status may be 1: a row that fails), run from the
    repository root with the CUDA plugin beside the venv on its PYTHONPATH; skips (fails under
    ``RINGATTN_REQUIRE_CUDA_PLUGIN=1``) where the plugin is not installed or no ptxas and libdevice are found
    (compiling then crashes the process)."""
    target = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "cudaplugin")
    plugin = any(os.path.isdir(os.path.join(target, "jax_plugins", p)) for p in ("xla_cuda13", "xla_cuda12"))
    cuda_dirs = ("/usr/local/cuda", *(os.path.join(target, "nvidia", v) for v in ("cu13", "cu12")))
    toolkit = any(os.path.exists(os.path.join(d, "bin", "ptxas"))
                  and os.path.isdir(os.path.join(d, "nvvm", "libdevice")) for d in cuda_dirs)
    if not (plugin and toolkit):
        why = (f"the CUDA plugin is not installed in {target}" if not plugin else
               "no CUDA toolkit (ptxas, libdevice) in /usr/local/cuda or beside the plugin")
        if os.environ.get("RINGATTN_REQUIRE_CUDA_PLUGIN") == "1":
            pytest.fail(f"{why} (scripts/setup-cuda-plugin)")
        pytest.skip(f"{why}: run scripts/setup-cuda-plugin {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    env["JAX_PLATFORMS"] = "cpu"  # the plugin registers its compile-only topologies without a CUDA runtime
    env["PYTHONPATH"] = os.pathsep.join([target, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def gpu_rows():
    """The documented flags' rows and controls (the default flags' rows are in docs/benchmarks.md: the check
    is on what the docs tell a user to run)."""
    return with_cuda_plugin("-m", "benchmarks.overlap", "--targets", "h100,a100", "--impls", "pallas_gpu,xla",
                            "--flags", "documented")


@pytest.mark.slow  # about 60 s of compiles on 2 cores
def test_every_gpu_ring_transfer_hidden_with_the_documented_flags(gpu_rows, record_property):
    """8 H100s and 8 A100s, 4096 tokens a GPU, 8 heads, d = 128, bfloat16, with the documented flags
    (``overlap.GPU_FLAGS``): every transfer of the ring, forward and backward, causal and not, of the Triton
    hop and of the XLA hop, has a kernel scheduled between its start and its done, and none is synchronous;
    the control's transfers are all exposed, so the reader can tell on XLA:GPU's schedules too."""
    record_property("gpu", [(r["target"], r["flags"], r["impl"], r["causal"], r["fwd"], r["bwd"]) for r in gpu_rows])
    controls = [r for r in gpu_rows if r["impl"] == "control"]
    assert controls and all(r["transfers"] > 0 and r["hidden"] == 0 for r in controls), controls
    rings = [r for r in gpu_rows if r["impl"] != "control"]
    assert {(r["target"], r["impl"], r["causal"]) for r in rings} == {
        (t, i, c) for t in overlap.GPU_TARGETS for i in ("pallas_gpu", "xla") for c in (False, True)}
    for r in rings:
        (fsent, fhidden), (bsent, bhidden) = r["fwd"], r["bwd"]
        assert r["flags"] == "documented" and r["synchronous"] == 0, r
        assert fsent >= 1 and fhidden == fsent and bsent >= 3 and bhidden == bsent, r
