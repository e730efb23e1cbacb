"""Test set-up: 8 simulated CPU devices before any JAX op, hypothesis profiles.

Profiles (choose with ``RINGATTN_HYPOTHESIS_PROFILE``):
  ``ci``        default: deterministic (derandomized), no deadline, a modest number of examples.
  ``thorough``  >= 500 examples per property, for a long local run.
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
_subprocess_flags = os.environ["XLA_FLAGS"]
# This process only: XLA:CPU's LLVM backend at -O0. The suite is mostly compiles of tiny programs, and
# this halves each compile; the optimized HLO, its buffer assignment and memory_analysis() are the same
# (the flag reaches only LLVM's code generation: checked on the strategies' programs, fwd and grad),
# so every structural and numerical test proves what it did. XLA reads XLA_FLAGS once, when the backend
# starts (jax.devices() below); subprocesses (notebooks, the labs' grader, several processes, the
# training CLI) get the flags as they were, and run optimized code at its usual speed.
if "--xla_backend_optimization_level" not in _subprocess_flags:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.devices()
os.environ["XLA_FLAGS"] = _subprocess_flags
_cache = os.environ.get("RINGATTN_JAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=500,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("RINGATTN_HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    return (f"jax {jax.__version__}, devices: {len(jax.devices())} x {jax.devices()[0].platform}, "
            f"hypothesis profile: {settings._current_profile}")
