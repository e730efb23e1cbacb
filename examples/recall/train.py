"""Train the library's model (``ringattn_fast.model``) on the recall task of ``tasks.py``: ring vs one shard.

``python -m examples.recall.train --quick --out runs/quick`` (from the repository root) trains two
models on the same batches: attention over the whole sequence around a ring of ``--devices`` hosts,
and the same model with its attention window cut to one host's shard (``window=(shard - 1, 0)``,
what a model without the ring would see). It writes ``DIR/metrics.json`` (accuracies, chance, timing,
loss curves; strict JSON) and ``DIR/training.png`` (loss curves; accuracy by the distance between
question and fact; skipped, with one line on stderr, when matplotlib is not installed), each
atomically (``outputs.py``), then prints a one-line JSON summary. It checkpoints every
``--checkpoint-every`` steps and when stopped by SIGTERM / SIGINT; ``--resume`` continues with the
same losses as a run never stopped (``checkpoint.py``). The command line is ``cli.py``. On CPU
``--devices`` simulated devices are made with ``jax_num_cpu_devices``. Needs the ``train`` extra
(optax, orbax-checkpoint, matplotlib).

Batches are made in true order (``tasks.py``), permuted into the layout (``--layout``) and sharded;
the model gets each token's true position, so the loss curve does not depend on the ring size or the
layout (``tests/test_training.py``).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .checkpoint import Stopped
from .outputs import Progress, write_outputs  # noqa: F401 - write_outputs: this module's interface too
from .tasks import RecallTask, accuracy_by_distance

QUICK = dict(seq=256, devices=8, steps=300, batch=16, d_model=64, layers=2, lr=1e-2)
FULL = dict(seq=512, devices=8, steps=400, batch=16, d_model=64, layers=2, lr=1e-2)


def layout_batch(batch, perm):
    """The batch in layout order (``x[:, perm]``) with each token's true position ``perm``."""
    tokens, targets, weights, distance = (x[:, perm] for x in batch)
    positions = np.broadcast_to(perm.astype(np.int32)[None], tokens.shape)
    return tokens, positions, targets, weights, distance


def loss_and_accuracy(logits, targets, weights, answer_base, n_values):
    """Mean cross-entropy over the questions (weights 1), the fraction whose argmax answer is right,
    and that argmax answer at every position (int [b, s])."""
    import jax
    import jax.numpy as jnp
    logp = jax.nn.log_softmax(logits, axis=-1)  # (b, s, vocab)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    guess = jnp.argmax(logits[..., answer_base:answer_base + n_values], axis=-1) + answer_base
    total = weights.sum()
    return (nll * weights).sum() / total, (((guess == targets) * weights).sum() / total, guess)


def make_step(cfg, task, mesh, optimizer):
    """The jitted ``step(params, opt_state, tokens, positions, targets, weights) -> (params, opt_state,
    loss, acc, guess)`` on ``mesh``: one AdamW update, and the loss, accuracy and argmax answers of the
    parameters *before* it. Evaluation calls the same step and drops the update: one compile per model
    (a separate forward-only function would be a second one, seconds on a CPU)."""
    import jax
    import optax

    from ringattn_fast.model import sharded_forward

    def loss_fn(params, tokens, positions, targets, weights):
        logits = sharded_forward(params, tokens, positions, cfg, mesh)
        return loss_and_accuracy(logits, targets, weights, task.answer_base, task.n_values)

    @jax.jit
    def step(params, opt_state, tokens, positions, targets, weights):
        (loss, (acc, guess)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, positions, targets, weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc, guess

    return step


def make_optimizer(lr, steps):
    """AdamW with warmup and cosine decay, gradients clipped to norm 1 (optax)."""
    import optax
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), max(steps, 2), lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(task, cfg, *, mesh, layout="contiguous", steps=100, batch_size=16, lr=3e-3, seed=0, label="",
          progress=True, eval_batches=8, checkpoints=None, name="model", stop=None):
    """Train one model; returns a dict: losses, accuracies (per step), eval accuracy, by-distance data,
    and ``resumed_at`` (the step it continued from, 0 for a fresh start).

    The data depend only on ``seed`` (the same batches for every model, ring size and layout); the
    evaluation uses ``eval_batches`` fresh batches from ``seed + 1``. ``checkpoints``
    (``checkpoint.Checkpoints``): continue from model ``name``'s latest checkpoint and save when due;
    ``stop`` (``checkpoint.Stop``): when it has caught a signal, save and raise ``checkpoint.Stopped``.
    """
    import jax

    from ringattn_fast.model import init_params
    from ringattn_ref.layouts import layout_permutation

    n = mesh.shape["sp"]
    perm = layout_permutation(layout, task.seq, n)
    optimizer = make_optimizer(lr, steps)
    step = make_step(cfg, task, mesh, optimizer)
    shard = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    put = lambda *xs: [jax.device_put(x, shard) for x in xs]  # noqa: E731
    # Replicated on the mesh, as the step's outputs are: the second step then hits the first one's
    # compile (arrays on device 0 alone would compile the step twice).
    replicated = jax.sharding.NamedSharding(mesh, jax.P())
    params = jax.device_put(init_params(jax.random.key(seed), cfg), replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)
    rng = np.random.default_rng(seed)
    losses, accs = [], []  # device scalars: the host reads them at the end (and every 5 steps for the bar)
    start = saved = 0
    restored = None if checkpoints is None else checkpoints.restore(name, dict(params=params, opt_state=opt_state))
    if restored is not None:
        start = saved = restored[0]
        params, opt_state = restored[1]["params"], restored[1]["opt_state"]
        losses, accs = ([np.nan if x is None else x for x in restored[2][key]] for key in ("losses", "accuracies"))
        rng.bit_generator.state = restored[2]["rng"]

    def save(done):
        as_floats = lambda xs: [float(x) for x in xs]  # noqa: E731 - NaN becomes null in the JSON
        checkpoints.save(name, done, dict(params=params, opt_state=opt_state),
                         dict(losses=as_floats(losses), accuracies=as_floats(accs), rng=rng.bit_generator.state))

    bar = Progress(steps, label) if progress else None
    for i in range(start, steps):
        if stop is not None and stop.signum is not None:
            if checkpoints is not None and i > saved:
                save(i)
            raise Stopped(stop.signum, name, i)
        tokens, positions, targets, weights, _ = layout_batch(task.batch(rng, batch_size), perm)
        params, opt_state, loss, acc, _ = step(params, opt_state, *put(tokens, positions, targets, weights))
        losses.append(loss)
        accs.append(acc)
        if checkpoints is not None and checkpoints.due(i + 1, steps):
            save(saved := i + 1)
        if bar is not None and (i % 5 == 4 or i == steps - 1):
            bar.update(i + 1, loss=float(np.mean(losses[-5:])), acc=float(np.mean(accs[-5:])))
    if bar is not None:
        bar.close()
    losses, accs = np.asarray(losses, np.float64).tolist(), np.asarray(accs, np.float64).tolist()
    eval_rng = np.random.default_rng(seed + 1)
    correct, distance, weights = [], [], []
    for _ in range(eval_batches):
        tokens, positions, targets, w, dist = layout_batch(task.batch(eval_rng, batch_size), perm)
        *_, guess = step(params, opt_state, *put(tokens, positions, targets, w))  # the update is dropped
        correct.append(np.asarray(guess) == targets), distance.append(dist), weights.append(w)
    correct, distance, weights = (np.concatenate(x) for x in (correct, distance, weights))
    accuracy = float((correct * weights).sum() / weights.sum())
    return dict(losses=losses, accuracies=accs, accuracy=accuracy, correct=correct, distance=distance,
                weights=weights, params=params, resumed_at=start)


def by_distance(runs, task, n_bins=8):
    """Eval accuracy per bin of question-fact distance for each run: ``{name: {centers, accuracy, count}}``
    (lists, for metrics.json; an empty bin's accuracy is None)."""
    edges = np.linspace(task.shard, task.seq, n_bins + 1)
    out = {}
    for name, run in runs.items():
        centers, acc, count = accuracy_by_distance(run["correct"], run["distance"], run["weights"], edges)
        out[name] = dict(centers=centers.tolist(), accuracy=[None if np.isnan(a) else float(a) for a in acc],
                         count=count.tolist())
    return out


def run_experiment(*, seq, devices, layout, steps, dtype, batch, d_model, layers, lr, seed=0, progress=True,
                   compare_dtypes=False, checkpoints=None, stop=None):
    """Ring vs one-shard-window models (and, with ``compare_dtypes``, the ring model in the other dtype);
    returns the metrics dict (:func:`write_outputs` writes it). ``checkpoints``, ``stop``: as in
    :func:`train`, for every model (a finished model's last checkpoint lets a resume skip its training)."""
    from ringattn_fast.mesh import make_mesh
    from ringattn_fast.model import ModelConfig

    mesh = make_mesh(devices)
    task = RecallTask(seq=seq, shard=seq // devices)
    base = ModelConfig(vocab=task.vocab, d_model=d_model, n_layers=layers, n_heads=4, n_kv_heads=2,
                       d_ff=2 * d_model, compute_dtype=dtype, ffn_block=math.gcd(32, seq // devices))
    configs = {"ring": base, "local": base.__class__(**{**base.__dict__, "window": (task.shard - 1, 0)})}
    if compare_dtypes:  # base.compute_dtype: the dtype's name, however it was spelled
        other = "float32" if base.compute_dtype == "bfloat16" else "bfloat16"
        configs[f"ring ({other})"] = base.__class__(**{**base.__dict__, "compute_dtype": other})
    start = time.perf_counter()
    runs, seconds = {}, {}
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        runs[name] = train(task, cfg, mesh=mesh, layout=layout, steps=steps, batch_size=batch, lr=lr, seed=seed,
                           label=f"{name:>16}", progress=progress, checkpoints=checkpoints, name=name, stop=stop)
        seconds[name] = time.perf_counter() - t0
    metrics = dict(ring_accuracy=runs["ring"]["accuracy"], local_accuracy=runs["local"]["accuracy"],
                   chance_accuracy=task.chance, seq=seq, devices=devices, layout=layout, steps=steps, batch=batch,
                   dtype=base.compute_dtype, d_model=d_model, layers=layers, shard=task.shard, window=[task.shard - 1, 0],
                   seconds=time.perf_counter() - start, seconds_per_model=seconds,
                   final_loss={k: float(np.mean(r["losses"][-10:])) for k, r in runs.items()},
                   eval_accuracy={k: r["accuracy"] for k, r in runs.items()},
                   losses={k: r["losses"] for k, r in runs.items()}, accuracy_by_distance=by_distance(runs, task),
                   resumed_at={k: r["resumed_at"] for k, r in runs.items()})
    return metrics


def main(argv=None):
    """The command line (``cli.main``): ``python -m examples.recall.train --help``."""
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    main()
