"""Training through the ring (issue 12): the loss curve does not depend on the ring size or the layout,
and the recall task puts every answer more than one shard away. The experiment is an example
(``examples/recall``, run from the repository root); the model is the library's."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from ringattn_fast.mesh import make_mesh
from ringattn_fast.model import ModelConfig
from examples.recall import train as recall_train
from examples.recall.tasks import RecallTask, accuracy_by_distance
from examples.recall.train import train

TASK = RecallTask(seq=64, shard=8, n_queries=2)
CFG = ModelConfig(vocab=TASK.vocab, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32, ffn_block=8)
STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def no_persistent_cache():
    """Compile these steps afresh: on the 8-device CPU mesh, a training step loaded from the persistent
    compilation cache (tests/conftest.py) deadlocks in its collectives and aborts the process (the 8-device
    zigzag run would load the program the contiguous run wrote; the cause: ``examples/recall/cli.py``,
    which does the same for the CLI). JAX decides once per process whether the cache is used, so turning
    it off needs ``reset_cache()`` too, or an earlier test module that already used the cache keeps it on."""
    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", old)
    compilation_cache.reset_cache()


def test_every_fact_is_more_than_one_shard_before_its_question():
    task = RecallTask(seq=128, shard=16)
    batch = task.batch(np.random.default_rng(0), 64)
    asked = batch.weights > 0
    assert asked.sum() == 64 * task.n_queries
    assert (batch.distance[asked] > task.shard).all()
    b, q = np.nonzero(asked)
    fact = batch.tokens[b, q - batch.distance[asked]] - task.fact_base  # key * n_values + value
    assert (fact // task.n_values == batch.tokens[b, q] - task.query_base).all()  # the asked key
    assert (fact % task.n_values == batch.targets[b, q] - task.answer_base).all()  # its value is the answer
    assert batch.tokens.max() < task.vocab and batch.tokens.min() >= 0
    again = task.batch(np.random.default_rng(0), 64)
    assert all(np.array_equal(x, y) for x, y in zip(batch, again))  # a seed gives the same data
    centers, acc, count = accuracy_by_distance(asked, batch.distance, batch.weights, np.array([0, 64, 128]))
    assert count.sum() == asked.sum() and np.allclose(acc[count > 0], 1.0)


@pytest.fixture(scope="module")
def dense_losses():
    """20 steps with plain dense attention on one device: the reference curve."""
    return np.array(train(TASK, CFG, mesh=make_mesh(1), steps=STEPS, batch_size=4, lr=3e-3, progress=False,
                          eval_batches=1)["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("devices, layout", [(2, "striped"), (4, "zigzag"), (8, "contiguous"), (8, "zigzag")])
def test_first_steps_losses_do_not_depend_on_ring_size_or_layout(dense_losses, devices, layout):
    """The same batches, the same initialisation: the ring's loss curve equals dense attention's to float32
    rounding (relative 1e-4), because every token gets its true position (rotary angles and the mask)."""
    losses = np.array(train(TASK, CFG, mesh=make_mesh(devices), layout=layout, steps=STEPS, batch_size=4, lr=3e-3,
                            progress=False, eval_batches=1)["losses"])
    assert dense_losses[0] > dense_losses[-1]  # it trains
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-4)


def test_quoted_numbers_are_those_of_the_committed_runs():
    """docs/training.md and README.md quote the runs whose metrics.json are committed
    (docs/_static/training_{quick,full}.json): re-running a run means updating every quote. Notebook 12
    reads the full run's file itself (and checks docs/training.md against it) instead of quoting it."""
    root = Path(__file__).resolve().parents[1]
    runs = {name: json.loads((root / "docs" / "_static" / f"training_{name}.json").read_text())
            for name in ("quick", "full")}
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    doc, readme = (root / "docs" / "training.md").read_text(), (root / "README.md").read_text()
    notebook = (root / "notebooks" / "12_training_long_context.md").read_text()
    for name, m in runs.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {m['seq']} | {m['steps']} | **{pct(m['ring_accuracy'])}**" in row, row
        assert f"| {pct(m['local_accuracy'])} | {100 * m['chance_accuracy']:g} % | {round(m['seconds'])} |" in row, row
    quick, full = runs["quick"], runs["full"]
    bf16 = full["eval_accuracy"]["ring (bfloat16)"]
    assert f"(bfloat16: {pct(bf16)})" in doc
    assert (f"ring {pct(quick['ring_accuracy'])} accuracy, one-shard model {pct(quick['local_accuracy'])}"
            f" (chance {100 * quick['chance_accuracy']:g} %), {round(quick['seconds'])} s") in " ".join(readme.split())
    assert (f"({full['seq']} tokens: {pct(full['ring_accuracy'])}, bfloat16 {pct(bf16)}, local "
            f"{pct(full['local_accuracy'])})") in " ".join(readme.split())
    assert '"training_full.json"' in notebook and '"ring_accuracy": 0.' not in notebook  # read, not quoted


# A metrics dict with every key the figure and the summary read (run_experiment's, tiny): no training.
FAKE_METRICS = dict(ring_accuracy=0.9, local_accuracy=0.05, chance_accuracy=0.0625, seq=64, devices=8, steps=2,
                    seconds=1.5, shard=8, losses={"ring": [2.9, 1.0], "local": [2.9, 2.8]},
                    accuracy_by_distance={name: dict(centers=[20.0, 44.0], accuracy=[acc, None], count=[8, 0])
                                          for name, acc in (("ring", 0.9), ("local", 0.05))})


def _block_matplotlib(monkeypatch):
    """Make every ``import matplotlib...`` fail as if it were not installed (None in sys.modules)."""
    for name in ["matplotlib"] + [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("has_matplotlib", [True, False])
def test_outputs_are_written_and_a_missing_matplotlib_only_skips_the_figure(tmp_path, monkeypatch, capsys,
                                                                             has_matplotlib):
    if not has_matplotlib:
        _block_matplotlib(monkeypatch)
    out = tmp_path / "run"
    written = recall_train.write_outputs(FAKE_METRICS, str(out))
    assert json.loads((out / "metrics.json").read_text()) == FAKE_METRICS
    err = capsys.readouterr().err
    if has_matplotlib:
        assert written == [str(out / "metrics.json"), str(out / "training.png")] and err == ""
        assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert written == [str(out / "metrics.json")] and not (out / "training.png").exists()
        assert err.count("\n") == 1 and "matplotlib is not installed" in err and "training.png" in err


def test_cli_without_matplotlib_prints_the_summary_and_exits_normally(tmp_path, monkeypatch, capsys):
    """The bug this guards: minutes of training, metrics.json written, then ModuleNotFoundError in the
    plot and no summary. Training is replaced by the fake metrics; the rest of ``main`` runs."""
    _block_matplotlib(monkeypatch)
    monkeypatch.setattr(recall_train, "run_experiment", lambda **kw: dict(FAKE_METRICS, seq=kw["seq"]))
    recall_train.main(["--quick", "--out", str(tmp_path)])  # returns: no SystemExit, no ImportError
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads(lines[0])
    assert summary["ring_accuracy"] == 0.9 and summary["seq"] == recall_train.QUICK["seq"]
    assert lines[1] == f"wrote {tmp_path / 'metrics.json'}"
