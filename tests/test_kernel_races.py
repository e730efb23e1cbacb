"""ringattn_fast.kernels.races: the one reader of the TPU interpreter's private race verdict."""
from types import SimpleNamespace

import jax
import pytest

from ringattn_fast.kernels import races

state = races._interpreter_state()  # the private module races.py wraps (no second jax._src import)


def test_reads_the_verdict_and_refuses_when_no_detector_ran(monkeypatch):
    monkeypatch.setattr(state, "races", None)
    with pytest.raises(RuntimeError, match="detect_races=True"):
        races.races_found()
    monkeypatch.setattr(state, "races", SimpleNamespace(races_found=True))
    assert races.races_found() is True
    monkeypatch.setattr(state, "races", SimpleNamespace(races_found=False))
    assert races.races_found() is False


def test_warns_once_outside_the_tested_versions(monkeypatch):
    monkeypatch.setattr(state, "races", SimpleNamespace(races_found=False))
    monkeypatch.setattr(races, "_warned", False)
    monkeypatch.setattr(jax, "__version_info__", (99, 0, 0))
    with pytest.warns(RuntimeWarning, match="private JAX state"):
        races.races_found()
    monkeypatch.setattr(state, "races", SimpleNamespace())  # a moved attribute: a clear error, not a guess
    with pytest.raises(RuntimeError, match="races_found"):
        races.races_found()
