"""``python -m examples.recall.train``: the command line of the recall experiment (``train.py``).

Every flag is checked before anything is compiled: a bad one is an argparse error (exit 2) naming the
flag, what it got and what it needs, not a failure minutes later (``--steps -1`` used to train and
write a NaN, ``--batch 0`` to die in a ``scan``, ``--out`` below a regular file to fail after 12 s of
work). Stopped by SIGTERM or SIGINT, the run saves a checkpoint and exits with ``128 + signal``
(143 for SIGTERM); ``--resume`` continues it (``checkpoint.py``).

**The persistent compilation cache is off for runs on several CPU devices.** A training step that
JAX loads from the cache (``JAX_COMPILATION_CACHE_DIR``) deadlocks there: XLA:CPU serializes an
executable one thunk sequence at a time and gives each nested sequence (a ``while`` body: the ring's
``ppermute`` inside ``lax.scan``) a collective-communicator resource of its own, where the compiler
gave the whole program one; loaded, a collective in a loop is no longer ordered after the collectives
outside it, each simulated device runs them concurrently and in its own order (device 0 was seen
waiting in an all-reduce and a collective-permute at once), the in-process rendezvous blocks every
thread of the pool, and after 40 s XLA aborts the process (rc -6). A fresh compile keeps the order, so
the CLI compiles afresh: seconds, against a hang. Other backends keep the cache.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from benchmarks.flags import dtype_flag

from . import train as experiment
from .checkpoint import Checkpoints, Stop, Stopped, Unusable
from .lock import Busy, Lock
from .outputs import strict
from .tasks import RecallTask


def at_least(low):
    """An argparse ``type``: an int >= ``low``, or an error that says what was given and what is needed."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}; got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}; got {value}")
        return value
    return parse


def parser():
    p = argparse.ArgumentParser(prog="python -m examples.recall.train", description=experiment.__doc__.split("\n")[0])
    q, f = experiment.QUICK, experiment.FULL
    p.add_argument("--quick", action="store_true", help=f"the small configuration {q}")
    p.add_argument("--seq", type=at_least(1), help=f"sequence length (default: {f['seq']}, --quick {q['seq']})")
    p.add_argument("--devices", type=at_least(1), help="ring size (simulated CPU devices)")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "striped", "zigzag"))
    p.add_argument("--steps", type=at_least(1), help=f"optimizer steps per model (default {f['steps']})")
    p.add_argument("--batch", type=at_least(1), help=f"sequences per step (default {f['batch']})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), type=dtype_flag(("float32", "bfloat16")))
    p.add_argument("--compare-dtypes", action="store_true", help="also train the ring model in the other dtype")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--out", default="runs/train", help="output directory (metrics.json, training.png)")
    p.add_argument("--checkpoint-dir", help="where checkpoints go (default: OUT/checkpoints)")
    p.add_argument("--checkpoint-every", type=at_least(1), default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints of the same configuration")
    return p


def writable_dir(path):
    """Prove ``path`` can be a directory this process writes, creating nothing (a refused start leaves no
    trace): it takes a file, or, where it does not exist yet, its nearest existing parent does. The
    OSError's reason otherwise, else None."""
    missing = _missing_dirs(path)
    existing = os.path.dirname(missing[-1]) if missing else os.path.abspath(path)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, "Not a directory", existing)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def _missing_dirs(path):
    """The folders ``os.makedirs(path)`` would create, deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def check(p, args, preset):
    """The checks that look at several flags at once (argparse checked each alone)."""
    seq, devices = preset["seq"], preset["devices"]
    parts = 2 * devices if args.layout == "zigzag" else devices
    if seq % parts:
        what = f"2 * --devices = {parts} (zigzag layout)" if parts != devices else f"--devices = {devices}"
        p.error(f"--seq must be divisible by {what}: each device holds seq / devices tokens; got --seq {seq}")
    try:
        RecallTask(seq=seq, shard=seq // devices)
    except ValueError as err:
        p.error(f"--seq {seq} is too short for --devices {devices}: {err}")
    for flag, path in (("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir)):
        reason = None if path is None else writable_dir(path)
        if reason:
            p.error(f"{flag} must be a directory this process can write; got {path!r} ({reason})")


@contextlib.contextmanager
def devices_and_cache(devices, stream):
    """``devices`` CPU devices, and no persistent compilation cache on several CPU devices (module
    docstring); the previous cache setting comes back on exit (``main`` is called in-process by tests)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", max(devices, 1))
    old = jax.config.jax_enable_compilation_cache
    off = jax.default_backend() == "cpu" and devices > 1 and old
    if off:
        if jax.config.jax_compilation_cache_dir:
            print("the persistent compilation cache is off for this run: XLA:CPU deadlocks in the collectives of "
                  "a multi-device step loaded from it (examples/recall/cli.py)", file=stream)
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides once per process; make it decide again
    try:
        yield
    finally:
        if off:
            jax.config.update("jax_enable_compilation_cache", old)
            compilation_cache.reset_cache()


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    preset = dict(experiment.QUICK if args.quick else experiment.FULL)
    for name in ("seq", "devices", "steps", "batch"):
        if getattr(args, name) is not None:
            preset[name] = getattr(args, name)
    check(p, args, preset)
    config = dict(preset, layout=args.layout, dtype=args.dtype, seed=args.seed, compare_dtypes=args.compare_dtypes)
    created = _missing_dirs(args.out)  # made here; removed again if the start is refused
    os.makedirs(args.out, exist_ok=True)
    try:  # one --out, one run (lock.py): held until the run ends, whatever ends it
        lock = Lock(args.out, stream=sys.stderr).acquire()
    except Busy as err:
        p.error(str(err))
    try:
        metrics, written = train(p, args, preset, config)
    finally:
        lock.release()
        for path in created:  # a refused start leaves no --out behind, nor the folders made for it
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
    summary = {k: metrics[k] for k in ("ring_accuracy", "local_accuracy", "chance_accuracy", "seq", "devices",
                                       "steps", "seconds")}
    print(json.dumps(strict(summary)))
    print(f"wrote {' and '.join(written)}")


def train(p, args, preset, config):
    """Train (resuming with ``--resume``) and write the outputs; ``(metrics, files written)``."""
    with devices_and_cache(preset["devices"], sys.stderr), Stop() as stop:
        import jax
        if preset["devices"] > jax.device_count():
            p.error(f"--devices must be at most the {jax.device_count()} {jax.default_backend()} devices here; "
                    f"got {preset['devices']}")
        try:  # after every check: a fresh run (no --resume) clears the old checkpoints
            checkpoints = Checkpoints(args.checkpoint_dir or os.path.join(args.out, "checkpoints"),
                                      every=args.checkpoint_every, config=config, resume=args.resume)
        except ValueError as err:  # another run's checkpoints, or none of them intact (Unusable)
            p.error(str(err))
        try:
            metrics = experiment.run_experiment(layout=args.layout, dtype=args.dtype, seed=args.seed,
                                                compare_dtypes=args.compare_dtypes, checkpoints=checkpoints,
                                                stop=stop, **preset)
        except Unusable as err:  # a step only the reader found damaged, and no older one intact
            p.error(str(err))
        except Stopped as err:
            print(f"\n{err}: checkpoint saved in {checkpoints.directory}; continue with the same flags and "
                  f"--resume", file=sys.stderr)
            sys.exit(128 + err.signum)
    return metrics, experiment.write_outputs(metrics, args.out)
