"""Test set-up: 8 simulated CPU devices before any JAX op, hypothesis profiles.

Profiles (choose with ``RINGATTN_HYPOTHESIS_PROFILE``):
  ``ci``        default: deterministic (derandomized), no deadline, a modest number of examples.
  ``thorough``  >= 500 examples per property, for a long local run.
  ``oldest``    a quarter of ``ci``'s examples (at least one per property): scripts/test-oldest.sh, whose run
                checks that every path works on the oldest supported JAX; the properties' full counts run on
                the newest pair in the same CI run.
"""
import gc
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
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
settings.register_profile("oldest", parent=settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("RINGATTN_HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    return (f"jax {jax.__version__}, devices: {len(jax.devices())} x {jax.devices()[0].platform}, "
            f"hypothesis profile: {settings._current_profile}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's in-memory caches of traced and compiled programs (the on-disk
    compilation cache keeps them cheap to get back): the whole suite runs in one process, and CI's full run
    once aborted inside an XLA compile 45 % of the way through, after the compiled programs of every
    earlier module had piled up."""
    yield
    jax.clear_caches()
    gc.collect()
