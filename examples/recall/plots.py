"""The recall experiment's figure: loss curves of every model and eval accuracy by question-fact distance.

matplotlib is imported inside :func:`plot` only, so training needs no plotting library
(``outputs.write_outputs`` skips the figure without it); the notebooks draw the same figure with
:func:`draw` on a figure of their own (``ringattn_course.figures.plot_training``).
"""
from __future__ import annotations

import numpy as np


def draw(metrics, fig):
    """Draw a metrics dict on ``fig`` (a matplotlib Figure): loss curves of every run; eval accuracy by
    question-fact distance, with chance and one shard marked. Returns ``fig``."""
    ax_loss, ax_dist = fig.subplots(1, 2)
    for name, losses in metrics["losses"].items():
        ax_loss.plot(losses, label=name, lw=1)
    ax_loss.axhline(-np.log(metrics["chance_accuracy"]), color="gray", ls=":", lw=1, label="log(n_values): guessing")
    ax_loss.set(xlabel="step", ylabel="loss (questions)", title="training loss")
    ax_loss.legend(fontsize=8)
    for name, d in metrics["accuracy_by_distance"].items():
        ax_dist.plot(d["centers"], [np.nan if a is None else a for a in d["accuracy"]], "o-", label=name)
    ax_dist.axhline(metrics["chance_accuracy"], color="gray", ls=":", lw=1, label="chance")
    ax_dist.axvline(metrics["shard"], color="k", ls="--", lw=1, label="one shard")
    ax_dist.set(xlabel="distance from question to fact (tokens)", ylabel="eval accuracy", ylim=(0, 1.05),
                title="accuracy by key distance")
    ax_dist.legend(fontsize=8)
    return fig


def plot(metrics, path):
    """:func:`draw` into a PNG file (no pyplot: a bare Figure with the Agg canvas)."""
    from matplotlib.figure import Figure
    fig = draw(metrics, Figure(figsize=(11, 4), layout="constrained"))
    fig.savefig(path, dpi=120, format="png")  # a path or an open binary file (outputs.atomic_write)
