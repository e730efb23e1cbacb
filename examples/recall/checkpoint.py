"""Stop and resume the recall experiment: Orbax checkpoints every K steps and at SIGTERM / SIGINT.

Under the checkpoint directory (``--checkpoint-dir``, default ``OUT/checkpoints``): ``config.json``,
the run's settings (a resume must match them), and one Orbax ``CheckpointManager`` per model
(``ring/``, ``local/``, ``ring_bfloat16/``) whose steps count the optimizer updates done. A
checkpoint holds what the next step needs: the parameters and the optimizer state (arrays, restored
with the mesh's replicated sharding, as the step returns them), and, as JSON, the loss and accuracy of
every step so far and the state of the data RNG (numpy's bit generator), so a resumed run draws the
very batch the stopped one would have drawn next. The evaluation uses its own fresh seed, so a resumed
run reports the same numbers, bit for bit on CPU, as one never stopped (``tests/test_training.py``).

Orbax writes each checkpoint into a temporary directory and renames it when complete: a run killed
while saving keeps its previous checkpoint as the latest. A step damaged afterwards (a flipped bit, a
file cut short, a missing item) is found by its digests (``integrity.py``): ``--resume`` says in one
line which step and what is wrong, and goes on from the newest intact step, or, when none is,
refuses (:class:`Unusable`, exit 2 from the CLI). Two runs on one ``--out`` are kept apart by
``lock.py``. A signal only sets a flag (:class:`Stop`);
the training loop polls it between steps, saves, and raises :class:`Stopped`; a second signal of the
same kind ends the process at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys

from .integrity import describe, problem, seal
from .outputs import strict, write_json


class Unusable(ValueError):
    """``--resume`` found checkpoints of a model, and none of them intact (the lines before say why)."""


class Stopped(Exception):
    """Raised by the training loop after a signal, once the checkpoint is saved."""

    def __init__(self, signum, name, step):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step} of {name!r}")
        self.signum, self.name, self.step = signum, name, step


class Stop:
    """A context in which SIGTERM and SIGINT set :attr:`signum` instead of ending the process (the
    previous handlers come back on exit). A second signal is handled the default way: at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum, self._old = None, {}

    def __enter__(self):
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.signum is not None:  # asked twice: no more waiting for the step to end
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum


def _read_config(path):
    """The run settings saved in ``path`` (a JSON object), or a ValueError naming the file (a truncated or
    hand-edited ``config.json`` ended the CLI with only JSON's own message, or an AttributeError)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({type(err).__name__}: {err}); remove it, or its checkpoint "
                         f"directory, to start afresh") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not the run's settings; remove it, or its "
                         f"checkpoint directory, to start afresh")
    return saved


class Checkpoints:
    """The checkpoints of one run: ``every`` steps (and the last one) per model, in ``directory``.

    ``config``: the run's settings (JSON). With ``resume`` a directory holding another configuration is
    a ValueError naming what differs, and an empty one starts at step 0 (a line on ``stream``);
    without ``resume``, old checkpoints are removed (a line on ``stream``) and the run starts afresh.
    """

    def __init__(self, directory, *, every, config, resume, stream=None):
        self.directory, self.every, self._managers = os.path.abspath(directory), int(every), {}
        self._reported = set()  # (folder, step): each damaged step is reported once
        self.stream = stream = sys.stderr if stream is None else stream
        path = os.path.join(self.directory, "config.json")
        config = strict(config)
        if os.path.exists(path):
            saved = _read_config(path)
            if resume and saved != config:
                diff = {k: (saved.get(k), config.get(k)) for k in sorted(set(saved) | set(config))
                        if saved.get(k) != config.get(k)}
                raise ValueError(f"--resume: the checkpoints in {self.directory} are of another run; settings "
                                 f"that differ (checkpointed, asked): {diff}")
            if resume:
                self._check_all()
            else:
                print(f"removing the checkpoints of an earlier run in {self.directory} (pass --resume to "
                      f"continue it)", file=stream)
                shutil.rmtree(self.directory)
        elif resume:
            print(f"--resume: no checkpoint in {self.directory}; starting at step 0", file=stream)
        os.makedirs(self.directory, exist_ok=True)
        write_json(path, config)

    def due(self, step, steps):
        """Whether ``step`` (updates done) gets a checkpoint: every ``every`` steps, and the last."""
        return step % self.every == 0 or step == steps

    def _folder(self, name):
        return os.path.join(self.directory, re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_"))

    def _sums(self, folder, step):
        return os.path.join(folder + ".sums", f"{step}.json")

    def _manager(self, name):
        import orbax.checkpoint as ocp
        if name not in self._managers:
            options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False, create=True)
            self._managers[name] = ocp.CheckpointManager(self._folder(name), options=options)
        return self._managers[name]

    def _steps(self, folder):
        """The saved steps in ``folder``, newest first (Orbax names each step's folder by its number)."""
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return sorted((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n))),
                      reverse=True)

    def _check_all(self):
        """Before anything is compiled: every model folder with steps must have an intact one (else
        :class:`Unusable`); the damaged ones are reported now, once."""
        for entry in sorted(os.listdir(self.directory)):
            if "." in entry:  # config.json, NAME.sums, NAME.damaged: a model's folder name has no dot (_folder)
                continue
            folder = os.path.join(self.directory, entry)
            steps = self._steps(folder)
            if steps and all([self._problem(entry, folder, step) for step in steps]):
                raise self._unusable(entry, steps)

    def _problem(self, name, folder, step):
        """``problem`` for one step, reported on the stream in one line when there is one."""
        what = problem(os.path.join(folder, str(step)), self._sums(folder, step))
        if what:
            self._say(name, step, what)
        return what

    def _say(self, name, step, what):
        if (self._folder(name), step) in self._reported:
            return
        self._reported.add((self._folder(name), step))
        print(f"checkpoint step {step} of {name!r} in {self.directory} is unusable: {what}", file=self.stream)

    def _unusable(self, name, steps):
        return Unusable(f"--resume: no intact checkpoint of {name!r} in {self.directory} (steps "
                        f"{', '.join(map(str, steps))}: see above); remove that folder to start afresh, or drop "
                        f"--resume")

    def save(self, name, step, state, meta):
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON) as ``step`` of model ``name``, then its
        digests; returns when both are on disk."""
        import orbax.checkpoint as ocp
        manager = self._manager(name)
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave(strict(meta))), force=True)
        manager.wait_until_finished()
        folder = self._folder(name)
        seal(os.path.join(folder, str(step)), self._sums(folder, step))

    def _set_aside(self, name, folder, steps):
        """Move damaged ``steps`` to ``FOLDER.damaged/`` (kept for a look, out of the manager's way: the run
        saves those step numbers again) and forget the manager that listed them."""
        aside = folder + ".damaged"
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            shutil.rmtree(os.path.join(aside, str(step)), ignore_errors=True)
            os.replace(os.path.join(folder, str(step)), os.path.join(aside, str(step)))
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._sums(folder, step))
        self._managers.pop(name, None)
        print(f"moved the unusable step(s) {', '.join(map(str, steps))} of {name!r} to {aside}", file=self.stream)

    def restore(self, name, like):
        """The newest intact checkpoint of model ``name`` as ``(step, state, meta)``, or None if it has none;
        :class:`Unusable` when it has steps and none is intact. ``like``: a pytree of arrays with the shapes,
        dtypes and shardings to restore into."""
        import jax
        import orbax.checkpoint as ocp
        folder = self._folder(name)
        steps = self._steps(folder)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        for n, step in enumerate(steps):
            what = problem(os.path.join(folder, str(step)), self._sums(folder, step))
            if not what:
                try:
                    got = self._manager(name).restore(step, args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
                    meta = got["meta"]
                    if not isinstance(meta, dict) or not {"losses", "accuracies", "rng"} <= set(meta):
                        raise ValueError("its 'meta' item lacks losses, accuracies or rng")
                except Exception as err:  # noqa: BLE001 - any reader failure is this step's verdict, in one line
                    self._managers.pop(name, None)  # a reader that failed may be unusable (a closed event loop)
                    what = describe(err)
                else:
                    if n:
                        self._set_aside(name, folder, steps[:n])
                        print(f"resuming {name!r} from step {step}, its newest intact checkpoint", file=self.stream)
                    return step, got["state"], meta
            self._say(name, step, what)
        if steps:
            raise self._unusable(name, steps)
        return None
