"""Which JAX this package runs on: the one place that compares JAX versions.

Supported: JAX >= 0.10 (a TPU machine's 0.10.2) through the newest (0.12 in CI's full run). The APIs
the package uses (``jax.shard_map``, ``jax.P``, ``jax.typeof(x).mat``, ``lax.pcast``,
``jax.sharding.AxisType`` / ``AbstractDevice`` / ``use_abstract_mesh``, ``pltpu.InterpretParams``,
``pltpu.CompilerParams``) all exist in 0.10, so no shims are needed; what differs is checked here:

- :func:`check_jax`: at ``import ringattn_fast``, an ImportError naming the version needed when JAX is
  older than :data:`MIN_JAX`.
- :func:`check_fused_interpreter`: the fused TPU ring (``impl="pallas_tpu_fused"``) interpreted on CPU
  needs :data:`FUSED_INTERPRETER_JAX`. jax 0.10.2's TPU interpreter was seen to hang on it (8 devices:
  10 minutes without progress); it does not hang every time (on a 2-core CPU host the slow fused tests
  finished), so rather than a hang that depends on the host, it raises a RuntimeError before anything
  runs. Compiled on a real TPU the fused kernel runs on every supported JAX, and that is never blocked.
"""
import re

import jax

MIN_JAX = (0, 10)
FUSED_INTERPRETER_JAX = (0, 12)


def jax_version():
    """The installed JAX's ``(major, minor)``, read from ``jax.__version__`` (every JAX has it)."""
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", jax.__version__).groups())


def _name(version):
    return ".".join(map(str, version))


def check_jax(version=None):
    """An ImportError naming the JAX needed (and the one installed) when it is older than `MIN_JAX`."""
    version = jax_version() if version is None else tuple(version[:2])
    if version < MIN_JAX:
        raise ImportError(f"ringattn needs jax >= {_name(MIN_JAX)}; this is jax {jax.__version__}. "
                          f"Upgrade it: pip install 'jax>={_name(MIN_JAX)}'")


def check_fused_interpreter(version=None):
    """A RuntimeError naming the JAX needed when the fused ring's CPU interpreter is too old to run."""
    version = jax_version() if version is None else tuple(version[:2])
    if version < FUSED_INTERPRETER_JAX:
        raise RuntimeError(f"impl='pallas_tpu_fused' interpreted on CPU needs jax >= "
                           f"{_name(FUSED_INTERPRETER_JAX)} (the TPU interpreter of jax {jax.__version__} can "
                           f"hang on the fused ring); upgrade jax, or use impl='pallas_tpu' or 'xla' on CPU. "
                           f"Compiled on a TPU, the fused ring runs on jax >= {_name(MIN_JAX)}")
