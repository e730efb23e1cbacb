"""What the recall experiment writes: strict JSON, files that are whole or absent, a progress line.

Every file goes to a temporary file beside its destination, is flushed to disk, and is renamed over
the destination (``os.replace``, atomic on POSIX): a run killed while writing leaves the previous file
or none, never a truncated one. JSON is strict (``allow_nan=False``): a NaN or infinite float is written
``null`` (a diverged loss, an empty accuracy bin), so every reader of the standard parses it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

from .plots import plot


def strict(obj):
    """``obj`` with numpy values as Python ones and every non-finite float as None (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [strict(v) for v in (obj.tolist() if isinstance(obj, np.ndarray) else obj)]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def atomic_write(path, write):
    """``write(f)`` into a temporary binary file beside ``path``, then rename it to ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path, obj):
    """``obj`` as strict, indented JSON at ``path``, atomically."""
    text = json.dumps(strict(obj), indent=1, allow_nan=False)
    atomic_write(path, lambda f: f.write(text.encode()))


def write_outputs(metrics, out, stream=None):
    """Write ``out/metrics.json`` and the figure ``out/training.png``; returns the paths written.

    Without matplotlib the figure is skipped with one line on ``stream`` (stderr): minutes of training
    must not end in an ImportError after the numbers are safe in metrics.json."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "metrics.json")]
    write_json(paths[0], metrics)
    png = os.path.join(out, "training.png")
    try:
        atomic_write(png, lambda f: plot(metrics, f))
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise
        print(f"matplotlib is not installed: {png} not drawn (pip install matplotlib; "
              f"{paths[0]} has every number)", file=sys.stderr if stream is None else stream)
    else:
        paths.append(png)
    return paths


class Progress:
    """A one-line progress bar on stderr: ``label [#####.....] step/total  key value ...  it/s``."""

    def __init__(self, total, label="", width=24, stream=None):
        self.total, self.label, self.width = total, label, width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()

    def update(self, step, **values):
        done = int(self.width * step / self.total)
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        shown = "  ".join(f"{k} {v:.3f}" for k, v in values.items())
        self.stream.write(f"\r{self.label} [{'#' * done}{'.' * (self.width - done)}] {step}/{self.total}  "
                          f"{shown}  {rate:.2f} it/s")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()
