"""Issue 21: the recall CLI (``python -m examples.recall.train``) stopped, resumed, rerun, given bad flags.

Before: ``metrics.json`` was written in place (a kill left it truncated) and could hold a bare NaN; there
was no checkpoint; a second run with the persistent compilation cache on aborted (rc -6) in a collective
rendezvous; ``--steps -1`` trained and exited 0, ``--batch 0`` died in a ``scan``, ``--out`` below a
regular file raised ``NotADirectoryError`` after the work.
"""
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from examples.recall import cli, outputs
from examples.recall import train as recall_train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, message", [
    (["--steps", "-1"], "argument --steps: must be an int >= 1; got -1"),
    (["--batch", "0"], "argument --batch: must be an int >= 1; got 0"),
    (["--seq", "ten"], "argument --seq: must be an int >= 1; got 'ten'"),
    (["--devices", "0"], "argument --devices: must be an int >= 1; got 0"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be an int >= 1; got 0"),
    (["--seed", "-3"], "argument --seed: must be an int >= 0; got -3"),
    (["--seq", "60", "--devices", "8"], "--seq must be divisible by --devices = 8"),
    (["--seq", "64", "--devices", "8", "--layout", "zigzag", "--steps", "1"], None),  # fine: 64 = 4 * 16
    (["--seq", "36", "--devices", "4", "--layout", "zigzag"], "--seq must be divisible by 2 * --devices = 8"),
    (["--seq", "16", "--devices", "2"], "--seq 16 is too short for --devices 2"),
])
def test_bad_flags_are_argparse_errors_before_any_compile(flags, message, tmp_path, monkeypatch, capsys):
    """Each bad flag exits 2 with a message naming it, what it got and what it needs; nothing runs."""
    ran = []
    summary = dict.fromkeys(("ring_accuracy", "local_accuracy", "chance_accuracy", "seq", "devices", "steps",
                             "seconds"), 0)
    monkeypatch.setattr(recall_train, "run_experiment", lambda **kw: ran.append(kw) or summary)
    monkeypatch.setattr(recall_train, "write_outputs", lambda *a: [])
    argv = flags + ["--out", str(tmp_path / "out")]
    if message is None:
        cli.main(argv)
        assert len(ran) == 1
        return
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err and not ran


def test_out_below_a_regular_file_is_an_argparse_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recall_train, "run_experiment", lambda **kw: pytest.fail("ran"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--quick", "--out", str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"--out must be a directory this process can write; got '{tmp_path / 'file' / 'run'}'" in err
    assert "NotADirectoryError" in err


def test_metrics_are_strict_json_and_every_file_is_replaced_whole(tmp_path):
    """A NaN loss is null (it used to be a bare NaN); a write that fails leaves the old file, no temp."""
    path = tmp_path / "m.json"
    outputs.write_json(path, {"loss": [1.5, float("nan"), np.float32("inf")], "n": np.int64(3)})
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"loss": [1.5, None, None], "n": 3}

    def broken(f):
        f.write(b'{"half')
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        outputs.atomic_write(path, broken)
    assert json.loads(path.read_text())["n"] == 3 and os.listdir(tmp_path) == ["m.json"]


FLAGS = ["--seq", "64", "--devices", "8", "--steps", "30", "--batch", "2", "--checkpoint-every", "5"]


def cli_run(out, *extra, wait_for=None, env):
    """Run the CLI in a child; with ``wait_for`` (a path), SIGTERM it as soon as that path exists."""
    cmd = [sys.executable, "-m", "examples.recall.train", *FLAGS, "--out", str(out), *extra]
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait_for is not None:
        deadline = time.monotonic() + 300
        while not wait_for.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
    stdout, stderr = child.communicate(timeout=600)
    return child.returncode, stdout, stderr


@pytest.mark.slow
def test_a_killed_run_resumes_bit_for_bit_and_reruns_work_with_the_cache_on(tmp_path):
    """Three runs with the persistent compilation cache on (``JAX_COMPILATION_CACHE_DIR``): one straight
    through, one SIGTERMed half-way through the ring model (once its step-15 checkpoint of 30 exists), and
its ``--resume``. The second and third
    used to load the first one's step from the cache and abort (rc -6) after 40 s; the resumed run's
    losses and evaluation equal the uninterrupted run's exactly. About 2 minutes on 2 cores."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    rc, _, err = cli_run(tmp_path / "whole", env=env)
    assert rc == 0, err[-3000:]
    rc, _, err = cli_run(tmp_path / "cut", wait_for=tmp_path / "cut" / "checkpoints" / "ring" / "15", env=env)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM at step" in err and "--resume" in err
    assert not (tmp_path / "cut" / "metrics.json").exists()
    rc, _, err = cli_run(tmp_path / "cut", "--resume", env=env)
    assert rc == 0, err[-3000:]
    whole, cut = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("whole", "cut"))
    assert cut["resumed_at"]["ring"] >= 15  # it did continue from a checkpoint, half-way or later
    for key in ("losses", "eval_accuracy", "final_loss", "accuracy_by_distance", "ring_accuracy"):
        assert cut[key] == whole[key], key


# Issue 31, item 8: damaged checkpoints, one run per --out, a resume of another configuration.

def _save_steps(directory, steps=(2, 4), config=None):
    """Checkpoints of a tiny pytree as ``steps`` of model 'ring' (what the recall run saves, smaller)."""
    import jax
    import jax.numpy as jnp
    from examples.recall.checkpoint import Checkpoints
    like = {"w": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones((3,))}
    ck = Checkpoints(directory, every=2, config=config or {"seed": 0}, resume=False, stream=io.StringIO())
    for s in steps:
        ck.save("ring", s, jax.tree.map(lambda x: x * s, like), {"losses": [1.0] * s, "accuracies": [0.5] * s,
                                                                   "rng": {"state": s}})
    return like


def _largest_array_file(step_dir):
    return max((Path(r) / n for r, _, ns in os.walk(step_dir / "state") for n in ns), key=lambda p: p.stat().st_size)


def _damage(step_dir, how):
    """Flip a bit of, or cut short, the step's largest array file; or remove its 'meta' item."""
    if how == "no_meta":
        shutil.rmtree(step_dir / "meta")
        return
    path = _largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


DAMAGE = {"flip": "changed since it was saved", "truncate": "changed since it was saved",
          "no_meta": "missing its 'meta' item"}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_resume_skips_a_damaged_step_saying_so_in_one_line(how, tmp_path):
    from examples.recall.checkpoint import Checkpoints
    like = _save_steps(tmp_path / "ck")
    _damage(tmp_path / "ck" / "ring" / "4", how)
    said = io.StringIO()
    step, state, meta = Checkpoints(tmp_path / "ck", every=2, config={"seed": 0}, resume=True,
                                    stream=said).restore("ring", like)
    assert step == 2 and meta["rng"] == {"state": 2}
    np.testing.assert_array_equal(np.asarray(state["w"]), 2 * np.arange(1000, dtype=np.float32))
    lines = said.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("checkpoint step 4 of 'ring' in ") and DAMAGE[how] in lines[0], lines
    assert lines[1].startswith("moved the unusable step(s) 4 of 'ring' to "), lines  # step 4 is saved again
    assert lines[2] == "resuming 'ring' from step 2, its newest intact checkpoint", lines
    assert sorted(os.listdir(tmp_path / "ck" / "ring")) == ["2"] and os.listdir(tmp_path / "ck" / "ring.damaged") == ["4"]
    said = io.StringIO()  # a second resume: step 2 as it is, the step set aside is not a model of its own
    assert Checkpoints(tmp_path / "ck", every=2, config={"seed": 0}, resume=True,
                       stream=said).restore("ring", like)[0] == 2 and not said.getvalue()


def test_a_step_saved_without_digests_is_judged_by_the_reader_in_one_line(tmp_path):
    from examples.recall.checkpoint import Checkpoints
    like = _save_steps(tmp_path / "ck")
    (tmp_path / "ck" / "ring.sums" / "4.json").unlink()  # as saved before digests existed
    _damage(tmp_path / "ck" / "ring" / "4", "truncate")
    said = io.StringIO()
    step, _, _ = Checkpoints(tmp_path / "ck", every=2, config={"seed": 0}, resume=True,
                             stream=said).restore("ring", like)
    lines = said.getvalue().splitlines()
    assert step == 2 and len(lines) == 3 and "step 4 of 'ring'" in lines[0] and "unusable: " in lines[0], lines


FLAGS_SMALL = ["--seq", "64", "--devices", "8", "--steps", "4", "--batch", "2", "--checkpoint-every", "2"]


def _cli_config(**changes):
    """The configuration ``cli.main`` saves for ``FLAGS_SMALL`` (and ``changes``)."""
    return dict(recall_train.FULL, seq=64, devices=8, steps=4, batch=2, layout="contiguous", dtype="float32",
                seed=0, compare_dtypes=False) | changes


def _no_training(monkeypatch):
    monkeypatch.setattr(recall_train, "run_experiment", lambda **kw: pytest.fail("a refused start trained"))


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_resume_with_no_intact_step_exits_2_in_lines_not_a_traceback(tmp_path, monkeypatch, capsys):
    _save_steps(tmp_path / "out" / "checkpoints", config=_cli_config())
    _damage(tmp_path / "out" / "checkpoints" / "ring" / "4", "flip")
    _damage(tmp_path / "out" / "checkpoints" / "ring" / "2", "no_meta")
    _no_training(monkeypatch)
    before = _tree(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_:
        cli.main(FLAGS_SMALL + ["--out", str(tmp_path / "out"), "--resume"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert "checkpoint step 4 of 'ring'" in err and "checkpoint step 2 of 'ring'" in err, err
    assert "--resume: no intact checkpoint of 'ring'" in err, err
    assert _tree(tmp_path / "out") == before  # nothing written, no lock left


def test_resume_of_another_configuration_names_the_fields_and_writes_nothing(tmp_path, monkeypatch, capsys):
    _save_steps(tmp_path / "out" / "checkpoints", config=_cli_config())
    _no_training(monkeypatch)
    before = _tree(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_:
        cli.main(FLAGS_SMALL + ["--out", str(tmp_path / "out"), "--resume", "--seed", "1", "--batch", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'seed': (0, 1)" in err and "'batch': (2, 3)" in err, err
    assert _tree(tmp_path / "out") == before


def test_a_refused_start_leaves_no_new_out_behind(tmp_path, monkeypatch, capsys):
    """Another run's checkpoints in --checkpoint-dir: refused, and the new --out it named is not left behind
    as an empty directory (the writability check created it)."""
    _save_steps(tmp_path / "ck", config=_cli_config())
    _no_training(monkeypatch)
    out = tmp_path / "new" / "out"
    with pytest.raises(SystemExit) as exit_:
        cli.main(FLAGS_SMALL + ["--out", str(out), "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                                "--seed", "5"])
    assert exit_.value.code == 2 and "'seed': (0, 5)" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("text, says", [('{"seq": 64, "dev', "is unreadable (JSONDecodeError"),
                                         ("[]", "holds a JSON list, not the run's settings")])
def test_a_damaged_config_json_is_named_in_one_line(text, says, tmp_path, monkeypatch, capsys):
    """A truncated or hand-edited ``config.json``: exit 2 naming the file (it said only JSON's own message,
    or ended in an AttributeError traceback)."""
    _save_steps(tmp_path / "out" / "checkpoints", config=_cli_config())
    (tmp_path / "out" / "checkpoints" / "config.json").write_text(text)
    _no_training(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        cli.main(FLAGS_SMALL + ["--out", str(tmp_path / "out"), "--resume"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert f"{tmp_path / 'out' / 'checkpoints' / 'config.json'} {says}" in err, err


def test_a_digest_file_that_is_not_a_map_makes_its_step_unusable(tmp_path):
    from examples.recall.checkpoint import Checkpoints
    like = _save_steps(tmp_path / "ck")
    (tmp_path / "ck" / "ring.sums" / "4.json").write_text("[1, 2]")
    said = io.StringIO()
    step, _, _ = Checkpoints(tmp_path / "ck", every=2, config={"seed": 0}, resume=True,
                             stream=said).restore("ring", like)
    assert step == 2 and "is not a map of files to digests (a JSON list)" in said.getvalue(), said.getvalue()


def test_a_second_run_on_an_out_in_use_is_refused_and_a_stale_lock_is_taken_over(tmp_path, monkeypatch, capsys):
    from examples.recall import lock
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / lock.NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        _no_training(monkeypatch)
        before = _tree(out)
        with pytest.raises(SystemExit) as exit_:
            cli.main(FLAGS_SMALL + ["--out", str(out)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--out {out} is in use by process {holder.pid}" in err, err
        assert _tree(out) == before
    finally:
        holder.kill()
        holder.wait()
    ran = []  # the holder is gone: its lock is stale, the next run takes it over and leaves none
    monkeypatch.setattr(recall_train, "run_experiment", lambda **kw: ran.append(kw) or dict.fromkeys(
        ("ring_accuracy", "local_accuracy", "chance_accuracy", "seq", "devices", "steps", "seconds"), 0))
    monkeypatch.setattr(recall_train, "write_outputs", lambda *a: [])
    cli.main(FLAGS_SMALL + ["--out", str(out)])
    assert len(ran) == 1 and "which is gone; taking it over" in capsys.readouterr().err
    assert not (out / lock.NAME).exists()


def _cli(out, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "examples.recall.train", *FLAGS_SMALL, "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_cli_refuses_a_resume_with_no_intact_step_in_a_subprocess(tmp_path):
    _save_steps(tmp_path / "out" / "checkpoints", config=_cli_config())
    for step, how in ((4, "truncate"), (2, "flip")):
        _damage(tmp_path / "out" / "checkpoints" / "ring" / str(step), how)
    run = _cli(tmp_path / "out", "--resume")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "error: --resume: no intact checkpoint of 'ring'" in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_the_cli_resumes_from_the_newest_intact_step_in_a_subprocess(tmp_path):
    """A real run (4 steps, checkpoints at 2 and 4), its ring model's step 4 bit-flipped, then --resume:
    one line about step 4, one saying step 2 is used, exit 0 (about 90 s on 2 loaded cores)."""
    run = _cli(tmp_path / "out")
    assert run.returncode == 0, run.stderr[-3000:]
    _damage(tmp_path / "out" / "checkpoints" / "ring" / "4", "flip")
    run = _cli(tmp_path / "out", "--resume")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "checkpoint step 4 of 'ring'" in run.stderr and "changed since it was saved" in run.stderr
    assert "resuming 'ring' from step 2, its newest intact checkpoint" in run.stderr
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["resumed_at"]["ring"] == 2


def test_two_real_runs_on_one_out_the_second_is_refused(tmp_path):
    """Run A holds ``--out`` (its lock appears at start, before any compile); run B on the same folder exits
    2 naming A's pid and leaves A's files alone; A, SIGKILLed, leaves a lock the next run takes over."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "examples.recall.train", *FLAGS_SMALL, "--out", str(tmp_path / "out")]
    a = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out" / "run.lock").exists() and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.poll() is None, "run A ended before taking its lock"
        b = subprocess.run(cmd + ["--seed", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert b.returncode == 2 and f"is in use by process {a.pid}" in b.stderr, b.stderr[-3000:]
        assert json.loads((tmp_path / "out" / "run.lock").read_text())["pid"] == a.pid
    finally:
        a.kill()
        a.wait()
    assert (tmp_path / "out" / "run.lock").exists()  # SIGKILL: no cleanup; stale, and taken over by the next run
