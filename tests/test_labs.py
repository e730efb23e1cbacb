"""The labs' grader (``notebooks/labs/grade.py``) passes every reference solution and fails, with
one clear line, every untouched skeleton, a deliberately wrong variant of each reference, and a
solution that does not import, lacks a function, raises, returns the wrong shape or dtype, or runs
past the time limit.

Each case is one ``grade.py`` run (a subprocess that starts its own child); they all run once, two
at a time, in a module fixture, and each test reads its result. Wrong variants are made here by
editing the reference source (the edit must match exactly once, so a changed reference cannot turn
a wrong-variant test into a no-op).
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about a minute of subprocesses (three JAX labs compile rings)

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "notebooks" / "labs"
SOLUTIONS = ROOT / "tests" / "lab_solutions"
sys.path.insert(0, str(LABS))
from grade import LABS as LAB_FILES  # noqa: E402

# lab -> (text in the reference, its wrong replacement, what the FAIL line must say)
WRONG = {
    "lab01": ("lse = np.logaddexp(lse1, lse2)", "lse = np.maximum(lse1, lse2)",
              "merging the oracle over two disjoint key sets"),
    "lab02": ("hosts[(host.my_idx + 1) % n].recv", "hosts[(host.my_idx - 1) % n].recv", "holds block"),
    "lab03": ("chunks[2 * n_hosts - 1 - r]", "chunks[n_hosts + r]", "every host gets the same causal work"),
    "lab04": ("counter = [(i, (i - 1) % n)", "counter = [(i, (i + 1) % n)", "K/V travel both ways"),
    "lab05": ("acc_ref[...] = alpha * acc_ref[...] +", "acc_ref[...] = acc_ref[...] +",
              "o matches the float64 hop oracle"),
}
RACY = ("    s = scale * jnp.dot(q_ref[...], k_ref[...].T,", """    def read_before_wait(buf, sem):
        copy = pltpu.make_async_copy(k_ref, buf, sem)
        copy.start()
        k = buf[...]  # the copy may still be writing buf: a race
        copy.wait()
        return k

    k = pl.run_scoped(read_before_wait, pltpu.VMEM(k_ref.shape, jnp.float32), pltpu.SemaphoreType.DMA)
    s = scale * jnp.dot(q_ref[...], k.T,""")

LAB01 = (SOLUTIONS / "lab01_online_softmax.py").read_text()
MERGE_RETURN = "    return _rows_to_o(w1) * o1 + _rows_to_o(w2) * o2, lse"
# name -> (lab, solution source or a path, extra arguments, what the FAIL line must say)
BROKEN = {
    "import_error": ("lab01", "import numpy as np\nimport no_such_module_for_lab01\n", (), "cannot import"),
    "syntax_error": ("lab01", "def merge(o1, lse1, o2, lse2)\n    return o1\n", (), "cannot import"),
    "missing_function": ("lab01", LAB01.replace("def merge(", "def merge_two("), (), "has no function 'merge'"),
    "raises": ("lab01", LAB01.replace(MERGE_RETURN, "    return 1 / 0"), (), "merge raised ZeroDivisionError"),
    "wrong_shape": ("lab01", LAB01.replace(MERGE_RETURN, MERGE_RETURN.replace(", lse", ", lse[:, :1]")), (),
                    "wrong shape"),
    "wrong_dtype": ("lab01", LAB01.replace(MERGE_RETURN, MERGE_RETURN + ".astype(np.float32)"), (), "wrong dtype"),
    "timeout": ("lab01", LAB01.replace("def online_update(m, l, o, s, v):\n",
                                       "def online_update(m, l, o, s, v):\n    while True:\n        pass\n"),
                ("--time-limit", "4"), "TIMEOUT"),
    # a solution that prints a look-alike verdict and leaves before the grader's own verdict
    "fake_pass": ("lab01", "import os\nprint('PASS lab01: every property holds', flush=True)\nos._exit(0)\n", (),
                  "died without a verdict"),
}


def _edit(source, old, new):
    assert source.count(old) == 1, f"the reference no longer contains {old!r} exactly once"
    return source.replace(old, new)


def _cases(tmp):
    """name -> (lab, solution path, extra args, expected substring or None for a pass)."""
    cases = {}
    for lab, (name, _, _) in LAB_FILES.items():
        cases[f"{lab}_reference"] = (lab, SOLUTIONS / name, (), None)
        cases[f"{lab}_skeleton"] = (lab, LABS / name, (), "NotImplementedError")
        old, new, expect = WRONG[lab]
        wrong = tmp / f"wrong_{name}"
        wrong.write_text(_edit((SOLUTIONS / name).read_text(), old, new))
        cases[f"{lab}_wrong"] = (lab, wrong, (), expect)
    racy = tmp / "racy_lab05_pallas_hop.py"
    racy.write_text(_edit((SOLUTIONS / "lab05_pallas_hop.py").read_text(), *RACY))
    cases["lab05_racy"] = ("lab05", racy, (), "the race detector reports nothing")
    for name, (lab, source, extra, expect) in BROKEN.items():
        path = tmp / f"{name}.py"
        path.write_text(source)
        cases[name] = (lab, path, extra, expect)
    return cases


def _grade(lab, path, extra):
    return subprocess.run([sys.executable, str(LABS / "grade.py"), lab, str(path), *extra], capture_output=True,
                          text=True, timeout=400)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """name -> (case, CompletedProcess) for every case, run two at a time (the CI machine has 2 cores)."""
    cases = _cases(tmp_path_factory.mktemp("labs"))
    order = sorted(cases, key=lambda n: not n.endswith(("reference", "racy")))  # the long runs first
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(order, pool.map(lambda n: _grade(*cases[n][:3]), order)))
    return {name: (cases[name], runs[name]) for name in cases}


def _verdict(proc):
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {proc.stderr[-2000:]}"
    return lines[-1]


@pytest.mark.parametrize("lab", list(LAB_FILES))
def test_reference_solution_passes(graded, lab):
    (_, _, _, _), proc = graded[f"{lab}_reference"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert _verdict(proc).startswith(f"PASS {lab}:")


def _assert_fails(graded, name):
    (lab, _, _, expect), proc = graded[name]
    verdict = _verdict(proc)
    assert proc.returncode != 0, proc.stdout
    assert verdict.startswith(f"FAIL {lab}:") and expect in verdict, proc.stdout + proc.stderr[-3000:]
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert fails == [verdict], f"exactly one FAIL line expected:\n{proc.stdout}"
    return verdict


@pytest.mark.parametrize("lab", list(LAB_FILES))
def test_untouched_skeleton_fails(graded, lab):
    _assert_fails(graded, f"{lab}_skeleton")


@pytest.mark.parametrize("lab", list(LAB_FILES))
def test_wrong_variant_fails_naming_the_property(graded, lab):
    verdict = _assert_fails(graded, f"{lab}_wrong")
    assert "property" in verdict and "example" in verdict, verdict


def test_pallas_race_is_reported(graded):
    _assert_fails(graded, "lab05_racy")


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_solution_gets_one_clear_line(graded, name):
    verdict = _assert_fails(graded, name)
    assert len(verdict) < 800, verdict


def test_timeout_exit_code(graded):
    (_, _, _, _), proc = graded["timeout"]
    assert proc.returncode == 3, proc.stdout


def test_bad_command_line():
    proc = subprocess.run([sys.executable, str(LABS / "grade.py"), "lab99", __file__], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no lab 'lab99'" in proc.stdout
