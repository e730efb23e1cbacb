"""Did the TPU interpreter's race detector find a data race? One home for a private JAX import.

``pltpu.InterpretParams(detect_races=True)`` turns on the interpreter's happens-before race detector
(public API). With ``on_race="raise"`` a race raises inside the call, which needs no private access;
with ``on_race="warn"`` the interpreter reports and continues, and the only record of the verdict is
the module-level ``races`` state of ``jax._src.pallas.mosaic.interpret.interpret_pallas_call``
(``races.races_found``, documented in ``InterpretParams``' docstring). JAX has no public accessor for
it, so this module is the one place that reaches into ``jax._src``: when JAX moves it, only
:func:`races_found` needs changing, and the version check below says so instead of an AttributeError.
"""
from __future__ import annotations

import warnings

import jax

TESTED_JAX = ((0, 10), (0, 12))  # (oldest, newest) (major, minor) this private path was checked on
_warned = False


def _interpreter_state():
    """The private module holding the race verdict; a RuntimeError naming the JAX version if it moved."""
    global _warned
    version = tuple(jax.__version_info__[:2])
    if not TESTED_JAX[0] <= version <= TESTED_JAX[1] and not _warned:
        _warned = True
        warnings.warn(f"ringattn_fast.kernels.races reads private JAX state checked on jax "
                      f"{TESTED_JAX[0][0]}.{TESTED_JAX[0][1]}-{TESTED_JAX[1][0]}.{TESTED_JAX[1][1]}; "
                      f"this is jax {jax.__version__}", RuntimeWarning, stacklevel=3)
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as state
    except ImportError as err:
        raise RuntimeError(f"jax {jax.__version__} moved the TPU interpreter's race state "
                           f"(jax._src.pallas.mosaic.interpret.interpret_pallas_call); update "
                           f"ringattn_fast/kernels/races.py") from err
    if not hasattr(state, "races"):
        raise RuntimeError(f"jax {jax.__version__}: interpret_pallas_call has no 'races' state; "
                           f"update ringattn_fast/kernels/races.py")
    return state


def races_found():
    """True if the race detector reported a race since the interpreter state was last created.

    The state is created by the first kernel run with ``detect_races=True`` and survives it; before
    that there is no verdict to read, and this raises RuntimeError rather than answer False.
    """
    races = _interpreter_state().races  # read at call time: the interpreter rebinds it
    if races is None:
        raise RuntimeError("no kernel has run with pltpu.InterpretParams(detect_races=True) yet")
    if not hasattr(races, "races_found"):
        raise RuntimeError(f"jax {jax.__version__}: the interpreter's race state has no 'races_found'; "
                           f"update ringattn_fast/kernels/races.py")
    return bool(races.races_found)
