"""The labs' grader (``notebooks/labs/grade.py``) passes every reference solution and fails, with
one clear line, every untouched skeleton, a wrong variant for each loophole class (the files in
``tests/lab_solutions/wrong/``, each naming its lab and the property its FAIL line must name), edits
of the references, and solutions that do not import, lack a function, raise, return the wrong shape
or dtype, or run past the time limit. A handout built by ``scripts/build_handout.py`` holds no
reference solution and grades one there.

Each case is one ``grade.py`` run (a subprocess that starts its own child); they all run once, two
at a time, in a module fixture, and each test reads its result. Edited variants must match their
edit exactly once, so a changed reference cannot turn a wrong-variant test into a no-op.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a few minutes of subprocesses (the JAX labs compile rings, twice)

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "notebooks" / "labs"
SOLUTIONS = ROOT / "tests" / "lab_solutions"
WRONG_FILES = sorted((SOLUTIONS / "wrong").glob("lab*.py"))
sys.path.insert(0, str(LABS))
from grade import LABS as LAB_FILES  # noqa: E402

# lab -> (text in the reference, its wrong replacement, what the FAIL line must say)
WRONG = {
    "lab01": ("lse = np.logaddexp(lse1, lse2)", "lse = np.maximum(lse1, lse2)",
              "merging two partial results gives the oracle"),
    "lab02": ("hosts[(host.my_idx + 1) % n].recv", "hosts[(host.my_idx - 1) % n].recv", "holds shard"),
    "lab03": ("chunks[2 * n_hosts - 1 - r]", "chunks[n_hosts + r]", "every host gets the same causal work"),
    "lab04": ("counter = [(i, (i - 1) % n)", "counter = [(i, (i + 1) % n)", "each direction moves N - 1 half"),
    "lab05": ("acc_ref[...] = alpha * acc_ref[...] +", "acc_ref[...] = acc_ref[...] +",
              "o matches the float64 hop oracle"),
    "lab06": ("return dq, dk, dv", "return dq, dk * 0.5, dv", "dk is the oracle's"),
    "lab07": ("top = lax.pmax(lse, axis_name)", "top = lse", "is the oracle's over the row's"),
    "lab08": ("return fits[0], measured", "return fits[-1], measured", "the simplest strategy that fits"),
    "lab09": ("(k_pos - start < prefix)", "(k_pos - start <= prefix)", "the packed prefix-LM documents' mask"),
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
# name -> (lab, solution source, extra arguments, what the FAIL line must say)
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
    # a solution that prints a look-alike verdict and leaves before anything is checked
    "fake_pass": ("lab01", "import os\nprint('PASS lab01: every property holds', flush=True)\nos._exit(0)\n", (),
                  "died without a verdict"),
}
# wrong files that attack the grader itself, graded a second time with the source check off: the
# parent/child split alone must stop them
UNGUARDED = ("lab01_patch_grader.py", "lab01_steal_token.py")
UNGUARDED_EXPECT = {"lab01_patch_grader.py": "merging two partial results", "lab01_steal_token.py": "died without"}


def _edit(source, old, new):
    assert source.count(old) == 1, f"the reference no longer contains {old!r} exactly once"
    return source.replace(old, new)


def _declared(path):
    """(lab, expected substring) from a wrong file's docstring lines ``lab: ...`` and ``expect: ...``."""
    text = path.read_text()
    lab, expect = re.search(r"^lab: (\w+)$", text, re.M), re.search(r"^expect: (.+)$", text, re.M)
    assert lab and expect, f"{path.name} must declare 'lab:' and 'expect:' in its docstring"
    return lab.group(1), expect.group(1).strip()


def _cases(tmp):
    """name -> (lab, solution path, extra args, expected substring or None for a pass, env)."""
    cases = {}
    for lab, (name, _, _) in LAB_FILES.items():
        cases[f"{lab}_reference"] = (lab, SOLUTIONS / name, (), None, {})
        cases[f"{lab}_skeleton"] = (lab, LABS / name, (), "NotImplementedError", {})
        old, new, expect = WRONG[lab]
        wrong = tmp / f"edited_{name}"
        wrong.write_text(_edit((SOLUTIONS / name).read_text(), old, new))
        cases[f"{lab}_edited"] = (lab, wrong, (), expect, {})
    racy = tmp / "racy_lab05_pallas_hop.py"
    racy.write_text(_edit((SOLUTIONS / "lab05_pallas_hop.py").read_text(), *RACY))
    cases["lab05_racy"] = ("lab05", racy, (), "the race detector reports nothing", {})
    for path in WRONG_FILES:
        lab, expect = _declared(path)
        cases[f"wrong/{path.name}"] = (lab, path, (), expect, {})
    for name in UNGUARDED:
        cases[f"unguarded/{name}"] = ("lab01", SOLUTIONS / "wrong" / name, (), UNGUARDED_EXPECT[name],
                                      {"_RINGATTN_GRADER_TEST_SKIP_SOURCE_CHECK": "1"})
    for name, (lab, source, extra, expect) in BROKEN.items():
        path = tmp / f"{name}.py"
        path.write_text(source)
        cases[name] = (lab, path, extra, expect, {})
    return cases


def _cache_env():
    """The persistent compilation cache of this test run (``tests/conftest.py``), for both processes of a
    grade run: lab 8's grader compiles the same eight library programs in every run (six here) and the
    variants of a lab compile many of the same programs. Measured: lab 8's six runs 169 -> 83 s of CPU.
    A subprocess does not inherit ``jax.config``, hence the environment variables. (Programs loaded from
    the cache are safe here: the warm second run of every case below passes too; the multi-device
    *training* step that deadlocks when loaded (``examples/recall/cli.py``) is not among them.)"""
    import jax

    cache = jax.config.jax_compilation_cache_dir
    return {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} if cache else {}


def _grade(lab, path, extra, env, cwd=ROOT, grade=LABS / "grade.py"):
    return subprocess.run([sys.executable, str(grade), lab, str(path), *extra], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, **_cache_env(), **env), cwd=cwd)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """name -> (case, CompletedProcess) for every case, run two at a time (the CI machine has 2 cores)."""
    cases = _cases(tmp_path_factory.mktemp("labs"))
    order = sorted(cases, key=lambda n: not n.endswith(("reference", "racy")))  # the long runs first
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(order, pool.map(lambda n: _grade(*cases[n][:3], cases[n][4]), order)))
    return {name: (cases[name], runs[name]) for name in cases}


def _verdict(proc):
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {proc.stderr[-2000:]}"
    return lines[-1]


@pytest.mark.parametrize("lab", list(LAB_FILES))
def test_reference_solution_passes(graded, lab):
    _, proc = graded[f"{lab}_reference"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert _verdict(proc).startswith(f"PASS {lab}:")


def _assert_fails(graded, name):
    (lab, _, _, expect, _), proc = graded[name]
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
def test_edited_reference_fails_naming_the_property(graded, lab):
    verdict = _assert_fails(graded, f"{lab}_edited")
    assert "property" in verdict and "example" in verdict, verdict


@pytest.mark.parametrize("name", [p.name for p in WRONG_FILES])
def test_wrong_variant_fails_naming_its_property(graded, name):
    _assert_fails(graded, f"wrong/{name}")


def test_every_new_lab_has_a_wrong_variant():
    labs = {_declared(p)[0] for p in WRONG_FILES}
    assert labs >= {"lab01", "lab02", "lab03", "lab04", "lab05", "lab06", "lab07", "lab08"}, labs


@pytest.mark.parametrize("name", UNGUARDED)
def test_attack_on_the_grader_fails_without_the_source_check(graded, name):
    _assert_fails(graded, f"unguarded/{name}")


def test_pallas_race_is_reported(graded):
    _assert_fails(graded, "lab05_racy")


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_solution_gets_one_clear_line(graded, name):
    verdict = _assert_fails(graded, name)
    assert len(verdict) < 800, verdict


def test_timeout_exit_code(graded):
    _, proc = graded["timeout"]
    assert proc.returncode == 3, proc.stdout


def test_printed_verdict_is_marked_as_the_solutions(graded):
    _, proc = graded["fake_pass"]
    assert "| PASS lab01" in proc.stdout and proc.returncode == 4, proc.stdout


def test_bad_command_line():
    proc = subprocess.run([sys.executable, str(LABS / "grade.py"), "lab99", __file__], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no lab 'lab99'" in proc.stdout


def test_handout_has_no_solutions_and_grades(tmp_path):
    """The handout: skeletons, grader, notebooks, libraries, what the notebooks import and read (the recall
    example, the training page and its metrics); no tests/, no instructor's kit; a reference passes there.
    (tests/test_notebooks.py runs every notebook from a handout.)"""
    dest = tmp_path / "handout"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_handout.py"), str(dest)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (dest / "tests").exists() and (dest / "notebooks" / "labs" / "_grader" / "common.py").is_file()
    assert not (dest / "docs" / "instructor").exists(), "the answer key and the exam are the instructor's"
    for needed in ("examples/recall/train.py", "examples/recall/tasks.py", "examples/demo.py", "docs/training.md",
                   "docs/_static/training_full.json", "docs/course.md"):
        assert (dest / needed).is_file(), f"the handout lacks {needed}"
    solutions = {p.read_text() for p in SOLUTIONS.glob("lab*.py")}
    assert not [p for p in dest.rglob("*.py") if p.read_text() in solutions]
    for lab in ("lab01", "lab07"):  # numpy and JAX, graded from the handout's own copy of everything
        mine = tmp_path / f"my_{lab}.py"
        mine.write_text((SOLUTIONS / LAB_FILES[lab][0]).read_text())
        run = _grade(lab, mine, (), {"PYTHONPATH": ""}, cwd=dest, grade=dest / "notebooks" / "labs" / "grade.py")
        assert run.returncode == 0 and _verdict(run).startswith(f"PASS {lab}"), run.stdout + run.stderr[-2000:]


def test_lab09_wrong_variants_cover_the_mask_the_ring_and_the_block_mask():
    """Lab 9's wrong files fail on each of its three parts: the mask's definition, the mask called per
    tile by the ring (not elementwise), and the block mask's counting (a tile judged by its corners)."""
    expects = {_declared(p)[1] for p in WRONG_FILES if _declared(p)[0] == "lab09"}
    assert {"the mask is the packed prefix-LM documents' mask",
            "the library's ring with your mask_fn (called per tile) gives the oracle's output",
            "block_mask's tile kinds are the library's block mask"} <= expects, expects


def test_handout_refuses_what_is_kept_back(tmp_path, monkeypatch):
    """Whatever its list of what to include says, the build refuses the solutions and the instructor's kit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_handout", ROOT / "scripts" / "build_handout.py")
    build_handout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_handout)
    for kept in ("tests/lab_solutions/", "docs/instructor/answers.md"):
        monkeypatch.setattr(build_handout, "INCLUDE", build_handout.INCLUDE + (kept,))
        with pytest.raises(SystemExit, match="kept back from students"):
            build_handout.build(tmp_path / kept.replace("/", "_"))
