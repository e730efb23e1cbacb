"""Flag types shared by the command lines (the benchmarks' and ``examples/recall``'s).

``dtype_flag(choices)``: a ``--dtype`` that takes a dtype however numpy spells it as text —
``float32``, ``f4``, ``single``, ``bfloat16``, ``float16``, ``half``, and the Python spellings pasted
as they are (``np.float32``, ``jnp.bfloat16``, ``numpy.float16``) — and gives the canonical name
(``float32``), so the rest of the program, its reports and its ``choices`` see one spelling. A dtype
outside ``choices`` or text that is no dtype is an argparse error naming the flag, what it got and
what it takes.
"""
from __future__ import annotations

import argparse

import numpy as np

PREFIXES = ("jax.numpy.", "jnp.", "numpy.", "np.", "ml_dtypes.")


def dtype_name(text):
    """The canonical name of the dtype ``text`` spells, or None when it spells none."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 names with numpy
    name = str(text).strip()
    for prefix in PREFIXES:
        name = name.removeprefix(prefix)
    try:
        return np.dtype(name).name
    except TypeError:
        return None


def dtype_flag(choices):
    """An argparse ``type`` for a dtype flag taking the dtypes named in ``choices`` (in any spelling)."""
    def dtype(text):
        name = dtype_name(text)
        if name not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)} (any numpy spelling: "
                                             f"'float32', 'f4', 'np.float32'); got {text!r}")
        return name
    return dtype


def dtype_list_flag(choices):
    """As :func:`dtype_flag`, for a comma list (``--dtypes bf16,float32``): a list of names."""
    one = dtype_flag(choices)
    return lambda text: [one(part) for part in text.split(",")]
