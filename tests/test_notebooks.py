"""Execute every course notebook (``notebooks/NN_*.md``) top to bottom and check its structure.

The notebooks run where a student runs them (issue 32): ``scripts/build_handout.py`` builds the
student handout into a temporary folder, a fresh venv gets it installed with exactly the extras of the
install line the handout documents (``docs/course.md``: ``pip install -e ".[test,notebooks]"``) and
nothing else, and each notebook is read with jupytext and executed with nbclient in the handout's
``notebooks/`` as working directory, on a kernel that runs the fresh venv's interpreter (a kernelspec
written on the fly, so the test never picks up some other ``python3`` kernel installed on the machine),
with no ``PYTHONPATH``: a notebook that needs a file the handout lacks (notebook 12 imports
``examples/recall`` and reads ``docs/``) or a package its extras lack (optax) fails here. This is the
course's only notebook run, so CI pays for the handout once: the build (a second) and the venv's install
(about 45 s on two cores with pip's cache warm from the project's own venv; measured and printed). Every
notebook runs in full, notebook 12 included (60-70 s): no quick mode is needed, since nothing runs twice.
``RINGATTN_NOTEBOOKS_FROM=checkout`` runs them from this checkout on this interpreter instead (a quick
local loop, no install).

Any cell error fails the test. Each notebook's wall time is recorded: printed as a table at the end of
the module and written to ``build/notebook_times.json`` (``RINGATTN_NOTEBOOK_TIMES`` overrides the path).
The budget is 90 s per notebook on a 2-core CPU (CI's); it is reported, never asserted (wall time is not
a test).

New notebooks are picked up automatically: one parametrized test per ``notebooks/[0-9][0-9]_*.md``.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.md"))
CELL_TIMEOUT_S = 300
TIMES: dict[str, float] = {}
SETUP: dict[str, float] = {}  # the handout's build and install, seconds
# The install line of the handout's course page; its extras are all the fresh venv gets.
INSTALL_LINE = re.compile(r'pip install -e "\.\[([\w,]+)\]"')


def test_course_exists():
    assert len(NOTEBOOKS) >= 7, f"expected notebooks 00-06 in {NB_DIR}, found {[p.name for p in NOTEBOOKS]}"
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    assert numbers == list(range(len(numbers))), f"notebook numbers must be 00, 01, ... without gaps: {numbers}"


def _run(cmd, what, **kwargs):
    """Run ``cmd`` (a setup step of the handout); fail the notebook tests with its output's tail if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}"
                    f"{proc.stderr[-3000:]}\n(RINGATTN_NOTEBOOKS_FROM=checkout runs the notebooks from the checkout "
                    f"without a handout)", pytrace=False)
    return proc.stdout


@pytest.fixture(scope="session")
def course(tmp_path_factory):
    """``(notebooks folder, python)`` the notebooks run with: the handout's ``notebooks/`` and a fresh venv
    that has the handout installed with its documented extras only; or, with
    ``RINGATTN_NOTEBOOKS_FROM=checkout``, this checkout's and this interpreter."""
    where = os.environ.get("RINGATTN_NOTEBOOKS_FROM", "handout")
    if where == "checkout":
        return NB_DIR, Path(sys.executable)
    if where != "handout":
        pytest.fail(f"RINGATTN_NOTEBOOKS_FROM={where!r}: expected 'handout' (the default) or 'checkout'", pytrace=False)
    base = tmp_path_factory.mktemp("course")
    handout, venv = base / "handout", base / "venv"
    start = time.perf_counter()
    _run([sys.executable, str(ROOT / "scripts" / "build_handout.py"), str(handout)], "building the handout")
    SETUP["handout build"] = time.perf_counter() - start
    documented = INSTALL_LINE.findall((handout / "docs" / "course.md").read_text())
    assert documented, "the handout's docs/course.md has no install line pip install -e \".[extras]\""
    extras = documented[0]
    assert "notebooks" in extras.split(","), f"the documented install line's extras [{extras}] lack notebooks"
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "venv", str(venv)], "creating a fresh venv", env=env)
    python = venv / "bin" / "python"
    # what the handout documents, in the handout's root: pip install -e ".[extras]"
    _run([str(python), "-m", "pip", "install", "-q", "-e", f".[{extras}]"], f"installing the handout with [{extras}]",
         cwd=handout, env=env, timeout=1800)
    SETUP[f"venv + pip install .[{extras}]"] = time.perf_counter() - start
    # the kernel must import the handout's code, not the checkout's
    where_from = json.loads(_run([str(python), "-c", "import json, ringattn_ref, ringattn_fast, ringattn_course; "
                                  "print(json.dumps([m.__file__ for m in (ringattn_ref, ringattn_fast, ringattn_course)]))"],
                                 "importing the course's packages in the fresh venv", cwd=base, env=env))
    outside = [f for f in where_from if not Path(f).resolve().is_relative_to(handout.resolve())]
    assert not outside, f"the fresh venv imports {outside}, not the handout's copies"
    return handout / "notebooks", python


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory, course):
    """A kernelspec that runs the course's interpreter (``course``), in a private kernel directory."""
    kdir = tmp_path_factory.mktemp("kernels")
    spec = kdir / "kernels" / "ringattn-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(course[1]), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ringattn test", "language": "python",
    }))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(kdir), old]))
    yield "ringattn-test"
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


@pytest.fixture(scope="module", autouse=True)
def report_times(request):
    """After the module: print the per-notebook times and write them as JSON."""
    yield
    if not TIMES:
        return
    out = Path(os.environ.get("RINGATTN_NOTEBOOK_TIMES", ROOT / "build" / "notebook_times.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(sorted(TIMES.items())), indent=2) + "\n")
    lines = ["", "notebook run times (budget 90 s each on a 2-core CPU):"]
    lines += [f"  {name:<40s} {t:7.1f} s" for name, t in sorted(TIMES.items())]
    lines += [f"  {'total':<40s} {sum(TIMES.values()):7.1f} s   (written to {out})"]
    lines += [f"  {'setup: ' + name:<40s} {t:7.1f} s" for name, t in SETUP.items()]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, course, kernel_name, monkeypatch, record_property):
    nb_dir, _ = course
    if nb_dir == NB_DIR:  # the kernel is a child process: make it import this checkout (also when not installed)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    else:  # the handout's notebook, on the fresh venv's own install: nothing of the checkout on the path
        monkeypatch.delenv("PYTHONPATH", raising=False)
        path = nb_dir / path.name
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(nb_dir)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:  # drop the ANSI colours of the traceback
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # outside the f-string: Python 3.11 allows no backslash there
        pytest.fail(f"{path.name} failed:\n{plain}", pytrace=False)
    TIMES[path.stem] = time.perf_counter() - start
    record_property("notebook_seconds", round(TIMES[path.stem], 2))


# ---- structure: what every course notebook must contain (issue 5) ----------------------------------

def _code_cells(nb):
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _is_listing(node: ast.stmt) -> bool:
    """``show_source(...)`` (``ringattn_course.listing``): a cell that shows the library's code."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and re.search(r"(^|\.)show_source$", ast.unparse(node.value.func)) is not None)


def _is_setup_only(tree: ast.Module) -> bool:
    """A cell that only imports, defines functions or shows source code computes nothing."""
    simple = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    for node in tree.body:
        if isinstance(node, simple):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if _is_listing(node):
            continue  # the code is the lesson: show_source(...)
        return False
    return True


def _ends_in_check(tree: ast.Module) -> bool:
    last = tree.body[-1]
    if isinstance(last, ast.Assert):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        name = ast.unparse(last.value.func)
        return bool(re.search(r"(^|\.)(assert_\w+|check_\w+)$", name))
    return False


# Notebooks 00..SECOND_EDITION_LAST follow the course's second edition (issue 13): learning objectives,
# prerequisites, an inline quiz, "What to take away", at least three exercises.
SECOND_EDITION_LAST = 15

PLOTTING_MODULES = {"viz": "ringattn_ref", "viz_blocks": "ringattn_ref", "figures": "ringattn_course"}


def _plots_with_project_code(cells) -> bool:
    """A later cell calls ``NAME.plot_*(...)`` where the first cell imports NAME from the package that
    holds the project's plotting module of that name (``from ringattn_ref import viz``, ...)."""
    first = ast.parse(re.sub(r"^\s*[%!].*$", "", cells[0], flags=re.M))  # drop IPython magics
    imported = {alias.asname or alias.name for node in ast.walk(first) if isinstance(node, ast.ImportFrom)
                for alias in node.names if PLOTTING_MODULES.get(alias.name) == node.module}
    called = set(re.findall(r"\b(\w+)\.plot_\w+\(", "\n".join(cells[1:])))
    return bool(imported & called)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_structure(path):
    nb = jupytext.read(path)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", "kernelspec must be python3"
    assert nb.metadata["jupytext"]["text_representation"]["format_name"] == "myst"
    cells = _code_cells(nb)
    assert cells, "no code cells"
    assert re.search(r'jax\.config\.update\("jax_num_cpu_devices",\s*8\)', cells[0]), \
        "the first code cell must set 8 simulated devices"
    for i, src in enumerate(cells[1:], start=1):
        assert "inspect.getsource(" not in src, \
            f"code cell {i}: show the library's code with show_source(...) (from ringattn_course)"
        tree = ast.parse(re.sub(r"^\s*[%!].*$", "", src, flags=re.M))  # drop IPython magics
        if not tree.body or _is_setup_only(tree):
            continue
        assert _ends_in_check(tree), f"code cell {i} does not end in an assert/check:\n{src}"
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    n_ex = len(re.findall(r"^#+ Exercise \d", text, flags=re.M))
    if int(path.name[:2]) <= SECOND_EDITION_LAST:
        assert re.search(r"\{admonition\}\s*What to take away", text), "missing the 'What to take away' box"
        assert re.search(r"\{admonition\}\s*Learning objectives", text), "missing the learning objectives"
        assert re.search(r"^\*\*Prerequisites", text, flags=re.M), "missing the prerequisites"
        assert re.search(r"^\*\*Quiz", text, flags=re.M), "no inline quiz (**Quiz** ... then a hidden answer)"
        assert 3 <= n_ex <= 6, f"expected 3-6 exercises, found {n_ex}"
    else:  # a chapter written before the second edition's structure; raise SECOND_EDITION_LAST once it has it
        assert re.search(r"\{admonition\}\s*(Takeaway|What to take away)", text), "missing the Takeaway box"
        assert 1 <= n_ex <= 6, f"expected 1-6 exercises, found {n_ex}"
    assert text.count('<details class="answer">') >= n_ex, "each exercise needs a hidden answer"
    assert _plots_with_project_code(cells), \
        "each notebook has at least one figure made by the project's plotting code: viz.plot_... or " \
        "viz_blocks.plot_... (ringattn_ref), figures.plot_... (ringattn_course)"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs in git"


# Notebooks BUILD_OR_MEASURE_FIRST.. have an exercise that builds something or predicts, then measures
# (issue 24): its heading says so, "### Exercise N (build ...)" or "(predict, then measure)".
BUILD_OR_MEASURE_FIRST = 5


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if int(p.name[:2]) >= BUILD_OR_MEASURE_FIRST],
                         ids=lambda p: p.stem)
def test_notebook_has_a_build_or_predict_then_measure_exercise(path):
    text = path.read_text()
    assert re.search(r"^#+ Exercise \d+ \((build|predict, then measure)", text, flags=re.M), \
        "no exercise marked '(build ...)' or '(predict, then measure)'"


# ---- the instructor's kit (docs/instructor, issue 24) ------------------------------------------------

KIT = ROOT / "docs" / "instructor"
KIT_PAGES = ("answers", "exam", "project", "readings")
PAPERS = {"2310.01889": "Ring Attention", "2305.19370": "Blockwise Parallel Transformer",
          "2205.14135": "FlashAttention", "2307.08691": "FlashAttention-2", "2311.09431": "Striped Attention",
          "2309.14509": "DeepSpeed Ulysses", "2405.07719": "USP", "2411.01783": "Context Parallelism",
          "2412.05496": "FlexAttention", "2309.17453": "StreamingLLM"}
_ANSWER = re.compile(r'<details class="answer">(.*?)</details>', re.S)
_PYTHON = re.compile(r"```python\n(.*?)```", re.S)


def test_instructor_kit_is_in_the_site():
    course = (ROOT / "docs" / "course.md").read_text()
    assert re.search(r"```\{toctree\}[^`]*\ninstructor/index\n", course), "docs/course.md's toctree lacks instructor/index"
    index = (KIT / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}(.*?)```", index, re.S).group(1).splitlines()
    assert [line.strip() for line in toctree if line.strip() and not line.startswith(":")] == list(KIT_PAGES)
    for heading in ("## Prerequisites", "## Academic integrity", "## Grading"):
        assert heading in index, f"docs/instructor/index.md lacks {heading!r}"
    assert all((KIT / f"{page}.md").is_file() for page in KIT_PAGES)


def test_answer_key_holds_every_notebooks_answers():
    """Every exercise's checked code (the notebook's folded answer) is in the key verbatim, under its heading,
    and every quiz's answer text too: the key cannot drift from what tests/test_exercises.py checks."""
    key = (KIT / "answers.md").read_text()
    for path in NOTEBOOKS:
        text = path.read_text()
        number = path.name[:2]
        for head in re.findall(r"^### (Exercise \d[^\n]*)$", text, flags=re.M):
            assert f"### {number}, {head}" in key, f"answers.md has no entry '{number}, {head}'"
        for answer in _ANSWER.findall(text):
            for code in _PYTHON.findall(answer):
                assert code in key, f"{path.name}: an answer's code is not in answers.md:\n{code}"
        n_quiz = len(re.findall(r"^\*\*Quiz", text, flags=re.M))
        section = key.split(f"Notebook `{path.name}`")[1].split("\n## ")[0]
        assert section.count("**Quiz.**") == n_quiz, f"{path.name}: {n_quiz} quizzes, answers.md has another count"


def test_exam_bank_project_and_readings():
    exam = (KIT / "exam.md").read_text()
    questions = re.split(r"^### Question \d+ ", exam, flags=re.M)[1:]
    assert len(questions) >= 20, f"the exam bank has {len(questions)} questions; at least 20"
    assert all("**Answer.**" in q for q in questions), "every exam question needs an answer"
    kinds = [q.split(";")[0].lstrip("(") for q in questions]
    assert kinds.count("midterm") >= 10 and kinds.count("final") >= 10, "ten or more for the midterm and the final"
    project = (KIT / "project.md").read_text()
    rubric = project.split("## Rubric")[1]
    points = [int(x) for x in re.findall(r"^\| [a-z][^|]* \| (\d+) \|", rubric, flags=re.M)]
    assert sum(points) == 100 and len(points) >= 4, f"rubric points {points} should add up to 100"
    readings = (KIT / "readings.md").read_text()
    weeks = [int(w) for w in re.findall(r"^\| (\d+) \|", readings, flags=re.M)]
    assert weeks == list(range(1, 17)), f"readings for weeks {weeks}; expected 1-16 (one notebook a week)"
    missing = {arxiv: name for arxiv, name in PAPERS.items() if f"arXiv:{arxiv}" not in readings}
    assert not missing, f"readings.md does not name {missing}"


def test_semester_plan_is_one_notebook_a_week_and_the_final_counts():
    """docs/course.md: every notebook in a week of its own, presentations in a week with no notebook, each
    lab set in or after the week of the notebooks it builds on; the kit's weighting adds up to 100 % with the
    final exam and the presentation in it, and the final covers 14 and 15 (issue 32)."""
    course = (ROOT / "docs" / "course.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]*) \| ([^|]*) \|$", course.split("## A semester plan")[1], flags=re.M)
    notebooks = {int(week): re.findall(r"\b(\d\d) ·", cell) for week, cell, _ in rows}
    assert sorted(nb for nbs in notebooks.values() for nb in nbs) == [f"{i:02d}" for i in range(16)]
    assert all(len(nbs) <= 1 for nbs in notebooks.values()), notebooks
    assert any("presentations" in cell and not notebooks[int(week)] for week, cell, _ in rows)
    first_week = {nb: week for week, nbs in notebooks.items() for nb in nbs}
    builds_on = {1: "01", 2: "03", 3: "07", 4: "07", 5: "08", 6: "07", 7: "11", 8: "13", 9: "14"}
    for week, _, labs in rows:
        for lab in map(int, re.findall(r"lab (\d):", labs)):
            assert int(week) >= first_week[builds_on[lab]], f"lab {lab} set in week {week}, before {builds_on[lab]}"
    index = (KIT / "index.md").read_text()
    weights = dict(re.findall(r"^\| ([a-z][^|]*?) \| (\d+) % \|", index.split("## Grading")[1], flags=re.M))
    assert sum(map(int, weights.values())) == 100, weights
    assert any(k.startswith("final exam") for k in weights) and any(k.startswith("presentation") for k in weights)
    assert "labs 1–9" in weights
    exam = (KIT / "exam.md").read_text()
    final = exam.split("## Final: notebooks 07–15")[1]
    for needle in ("soft-cap", "sink", "prefix-LM", "per-document"):
        assert needle in final, f"the final has no question on {needle}"


def test_show_source_renders_highlighted_and_plain():
    """``show_source``: a ```` ```python ```` block for Jupyter, Colab and the site; the bare source as text."""
    import inspect
    import textwrap

    from IPython.core.formatters import format_display_data

    from ringattn_course import show_source
    from ringattn_ref import merge, ring

    listing = show_source(ring.Message.payload_elements, merge)  # a method: dedented to column 0
    data, _ = format_display_data(listing)
    expected = textwrap.dedent(inspect.getsource(ring.Message.payload_elements)).rstrip() + "\n\n" + \
        inspect.getsource(merge).rstrip()
    assert data["text/markdown"] == f"```python\n{expected}\n```\n"
    assert data["text/plain"] == str(listing) == repr(listing) == expected


def test_notebooks_extra_has_what_the_notebooks_import():
    """The ``[notebooks]`` extra (the Colab cell's and the course's install line) holds optax: notebook 12
    trains the recall example's models with it (the handout run above would fail without it)."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["notebooks"]
    names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0] for req in extra}
    assert {"jupyter", "jupytext", "nbclient", "ipykernel", "matplotlib", "optax"} <= names, names


def test_ipynb_copies_for_colab(tmp_path):
    """``make notebooks-ipynb``: one .ipynb per notebook, the install cell first, then the course."""
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("nb_tools", NB_DIR / "_tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    written = tools.write_ipynb(tmp_path / "ipynb")
    assert [p.stem for p in written] == [p.stem for p in NOTEBOOKS]
    assert (tmp_path / "ipynb" / ".gitignore").read_text().splitlines()[-1] == "*"
    for src, out in zip(NOTEBOOKS, written):
        nb = nbformat.read(out, as_version=4)
        nbformat.validate(nb)
        first = nb.cells[0].source
        assert nb.cells[0].cell_type == "code" and '%pip install -q "{REPO}[notebooks]"' in first
        assert 'os.chdir(os.path.join(REPO, "notebooks"))' in first  # where notebook 12 finds examples/, docs/
        assert "jax_num_cpu_devices" in next(c.source for c in nb.cells[1:] if c.cell_type == "code")
        assert [c.source for c in nb.cells[1:]] == [c.source for c in jupytext.read(src).cells]
