"""The notebooks' exercise self-checks accept the hidden answer and reject a wrong one.

For every exercise cell ``x = None ...; exercises.check_NAME(x)`` in ``notebooks/NN_*.md``, the
``<details class="answer">`` block that follows it holds the answer as a ```` ```python ```` block.
The answer is run after the notebook's first code cell (its imports: answers may use only those),
then ``check_NAME`` (of the ``exercises`` module the notebook imports, ``ringattn_course.exercises``)
must return True on it, False on the placeholder ``None``, and raise ``AssertionError`` on a slightly
wrong answer (numbers shifted, functions' outputs shifted).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ringattn_course import exercises

jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parent.parent
CHECK_CALL = re.compile(r"exercises\.(check_\w+)\((\w+)\)")
ANSWER = re.compile(r'<details class="answer">(.*?)</details>', re.S)
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _cases():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.md")):
        nb = jupytext.read(path)
        preamble = "\n".join(line for line in nb.cells[[c.cell_type for c in nb.cells].index("code")].source
                             .splitlines() if "jax_num_cpu_devices" not in line)
        pending = None
        for cell in nb.cells:
            if cell.cell_type == "code" and (match := CHECK_CALL.search(cell.source)):
                pending = match.groups()
            elif cell.cell_type == "markdown" and pending and (answer := ANSWER.search(cell.source)):
                code = "\n".join(PYTHON_BLOCK.findall(answer.group(1)))
                yield pytest.param(path.name, preamble, code, *pending, id=f"{path.stem[:2]}-{pending[0]}")
                pending = None


CASES = list(_cases())


def _shift(x):
    if isinstance(x, tuple):
        return tuple(_shift(y) for y in x)
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return x + 1
    return np.asarray(x) * 1.01 + 1e-3


def _wrong(answer):
    if callable(answer):
        return lambda *args, **kwargs: _shift(answer(*args, **kwargs))
    return _shift(answer)


def test_every_notebook_exercise_has_a_checked_answer():
    names = {case.values[0] for case in CASES}
    notebooks = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.md")}
    assert names == notebooks, f"notebooks without a checked exercise: {sorted(notebooks - names)}"


@pytest.mark.parametrize("notebook, preamble, code, check, var", CASES)
def test_answer_passes_and_wrong_answer_fails(notebook, preamble, code, check, var, capsys):
    assert code.strip(), f"{notebook}: the answer to {check} has no ```python block"
    namespace = {}
    exec(compile(preamble, f"{notebook}:preamble", "exec"), namespace)
    exec(compile(code, f"{notebook}:answer", "exec"), namespace)
    checker = getattr(namespace.get("exercises", exercises), check)  # the module the notebook imports
    assert checker(None) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker(namespace[var]) is True
    with pytest.raises(AssertionError):
        checker(_wrong(namespace[var]))


def test_backward_checks_follow_the_measured_factors(monkeypatch, capsys):
    """The backward bounds come from the traces (``ringattn_ref.backward_factors``), not from a constant:
    change what the traces say and the expected answers move with it."""
    from ringattn_ref import backward, cost

    nvlink, v5e = cost.HARDWARE["A100 NVLink"], cost.HARDWARE["TPU v5e"]
    f_b = nvlink.flops_per_s / nvlink.bandwidth_bytes_per_s
    assert exercises.check_backward_min_block(1.2 * f_b) is True
    assert exercises.check_backward_bytes_ratio(3.0) is True
    monkeypatch.setattr(backward, "backward_factors", lambda itemsize=2, **kw: (2.5, 2.0))
    with pytest.raises(AssertionError):
        exercises.check_backward_min_block(1.2 * f_b)
    assert exercises.check_backward_min_block(0.8 * f_b) is True
    causal = 0.8 * cost.min_block_size(v5e.flops_per_s, v5e.bandwidth_bytes_per_s, heads=32, kv_heads=8, fill=0.5)
    assert exercises.check_min_block_backward_causal(causal) is True


def test_ffn_peak_is_measured_on_the_blockwise_feedforward():
    """The expected peak is what ``blockwise_feedforward`` hands the FFN per call, so other sizes follow."""
    assert exercises._ffn_peak_elements(2, 4096, 256, 1024, 512) == (2 * 512 * 1024, 8)
    assert exercises.check_ffn_peak_elements(3 * 128 * 64, batch=3, seq=512, hidden=16, ffn_hidden=64, block=128)
    with pytest.raises(AssertionError):
        exercises.check_ffn_peak_elements(3 * 512 * 64, batch=3, seq=512, hidden=16, ffn_hidden=64, block=128)


def test_fused_ring_checks_follow_the_kernel_protocol(monkeypatch, capsys):
    """09's checks replay the fused kernel's own protocol (``fused_ring.remote_sends``, ``signal_cap``,
    ``last_send``): the slots alternate as the kernel writes them, and a kernel that sent one step more
    would move the expected copies and signals with it."""
    from ringattn_fast.kernels import fused_ring

    proto = exercises._fused_forward_protocol(4)
    assert proto["recv"] == [1, 0, 1, 0] and sum(proto["sends"]) == 3 and sum(proto["signals"]) == 2
    monkeypatch.setattr(fused_ring, "last_send", lambda n, backward=False: n - 1)  # a send after the last hop
    with pytest.raises(AssertionError):
        exercises.check_remote_copies(lambda n: n - 1)
    assert exercises.check_remote_copies(lambda n: n if n > 1 else 0)
    assert exercises.check_handshake_signals(lambda n: max(n - 1, 0))
