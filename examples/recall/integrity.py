"""Whether a saved checkpoint step is intact: a digest of every file, and a one-line verdict when not.

Orbax renames a step into place only when it is complete, but nothing checks the step's files when
it is read back: a bit flipped on disk, a file cut short or a missing item surfaced as a 30–138-line
traceback from deep inside the reader (``DATA_LOSS ... zarr``, ``Event loop is closed``,
``KeyError: 'meta'``), or worse, as a quietly wrong array (a flip in uncompressed bytes). So, after
each save, :func:`seal` writes the SHA-256 of every file of the step to ``SUMS/<step>.json`` beside
the manager's folder, and before a restore :func:`problem` compares them: the first difference is the
verdict (``file state/d/ab12 changed``, ``... is missing``, ``missing its 'meta' item``). A step
saved before digests existed is only checked for its items; whatever the reader still finds wrong
is reported by :func:`describe` in one line.
"""
from __future__ import annotations

import hashlib
import json
import os

ITEMS = ("state", "meta")  # what every step holds (checkpoint.py's Composite)


def _files(folder):
    """Every file under ``folder``, as sorted paths relative to it."""
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(step_dir, sums_file):
    """Write the digests of every file of ``step_dir`` to ``sums_file`` (replaced whole)."""
    sums = {rel: _digest(os.path.join(step_dir, rel)) for rel in _files(step_dir)}
    os.makedirs(os.path.dirname(sums_file), exist_ok=True)
    with open(sums_file + ".tmp", "w") as f:
        json.dump(sums, f)
    os.replace(sums_file + ".tmp", sums_file)


def problem(step_dir, sums_file):
    """What is wrong with the step in ``step_dir`` (a short phrase), or None when it is intact."""
    missing = [item for item in ITEMS if not os.path.isdir(os.path.join(step_dir, item))]
    if missing:
        return f"missing its {' and '.join(map(repr, missing))} item{'s' * (len(missing) > 1)}"
    if not os.path.exists(sums_file):
        return None  # saved before digests: the reader is the only check
    try:
        with open(sums_file) as f:
            sums = json.load(f)
    except (OSError, ValueError) as err:
        return f"its digest file {sums_file} is unreadable ({type(err).__name__})"
    if not isinstance(sums, dict):
        return f"its digest file {sums_file} is not a map of files to digests (a JSON {type(sums).__name__})"
    for rel, want in sums.items():
        path = os.path.join(step_dir, rel)
        if not os.path.exists(path):
            return f"file {rel} is missing"
        if _digest(path) != want:
            return f"file {rel} changed since it was saved (corrupt or truncated: {os.path.getsize(path)} bytes)"
    return None


def describe(err):
    """An exception from the checkpoint reader as one short line: its type and its message's first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
