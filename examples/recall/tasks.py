"""A long-range task for ``ringattn_fast.model``: associative recall, with the answer far away.

Each sequence of ``seq`` tokens holds ``n_pairs`` *facts* scattered among filler tokens: one token
each, "key ``i`` has value ``j``" (vocabulary ``n_keys * n_values`` fact tokens, keys distinct within
a sequence). It ends with ``n_queries`` questions, ``Q_i`` followed by its answer ``V_j``: the model
must predict the answer at each ``Q_i``. Every fact lies more than ``shard`` tokens before every
question, so a model whose attention window is one shard (``window=(shard - 1, 0)``: the tokens of
one host) sees no fact and can only guess (:attr:`RecallTask.chance`), while attention over the
whole sequence finds the fact by content: the question token's query matches the key part of a fact
token's key, and the fact's value part rides back in ``V``. This is the paper's line retrieval
(arXiv:2310.01889 §5.4) in miniature, one token per line.

Batches are numpy (a seed gives the same data on every machine and for every ring size), in true
order: the trainer permutes them into the ring's layout.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """One batch in true token order, all ``[batch, seq]``: tokens (int32 inputs), targets (int32: the
    answer token at a question, 0 elsewhere), weights (float32: 1 at questions), distance (int32:
    question position minus its fact's position, 0 elsewhere)."""
    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    distance: np.ndarray


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Associative recall over ``seq`` tokens with every fact more than ``shard`` tokens from its question.

    Vocabulary, in order: ``n_filler`` filler tokens, ``n_keys * n_values`` facts (``key * n_values +
    value``), ``n_keys`` question tokens, ``n_values`` answer tokens.
    """
    seq: int
    shard: int
    n_keys: int = 4
    n_values: int = 16
    n_pairs: int = 4
    n_queries: int = 4
    n_filler: int = 1

    def __post_init__(self):
        if self.n_pairs > self.n_keys or self.n_queries > self.n_pairs:
            raise ValueError(f"need n_queries <= n_pairs <= n_keys; got {self.n_queries}, {self.n_pairs}, "
                             f"{self.n_keys}")
        if self.fact_limit < self.n_pairs:
            raise ValueError(f"seq ({self.seq}) leaves room for {max(self.fact_limit, 0)} facts more than "
                             f"shard ({self.shard}) tokens before the questions; need n_pairs = {self.n_pairs}")

    @property
    def fact_base(self):
        return self.n_filler

    @property
    def query_base(self):
        return self.n_filler + self.n_keys * self.n_values

    @property
    def answer_base(self):
        return self.query_base + self.n_keys

    @property
    def vocab(self):
        return self.answer_base + self.n_values

    @property
    def fact_limit(self):
        """Facts sit at positions ``< fact_limit``: more than ``shard`` before the first question."""
        return self.seq - 2 * self.n_queries - self.shard

    @property
    def chance(self):
        """Accuracy of guessing the answer: 1 / n_values."""
        return 1.0 / self.n_values

    def batch(self, rng, batch_size):
        """A :class:`Batch` of ``batch_size`` sequences drawn from ``rng`` (a ``np.random.Generator``)."""
        b, s, nq = batch_size, self.seq, self.n_queries
        rows = np.arange(b)[:, None]
        keys = np.argsort(rng.random((b, self.n_keys)), axis=1)[:, :self.n_pairs]  # distinct keys
        values = rng.integers(self.n_values, size=(b, self.n_pairs))
        where = np.argsort(rng.random((b, self.fact_limit)), axis=1)[:, :self.n_pairs]  # fact positions
        tokens = rng.integers(self.n_filler, size=(b, s))
        tokens[rows, where] = self.fact_base + keys * self.n_values + values
        asked = np.argsort(rng.random((b, self.n_pairs)), axis=1)[:, :nq]  # which facts are asked
        q_pos = s - 2 * nq + 2 * np.arange(nq)[None]  # (1, nq): question tokens, answers right after
        tokens[rows, q_pos] = self.query_base + keys[rows, asked]
        answers = self.answer_base + values[rows, asked]
        tokens[rows, q_pos + 1] = answers
        targets, weights, distance = (np.zeros((b, s), dt) for dt in (np.int32, np.float32, np.int32))
        targets[rows, q_pos], weights[rows, q_pos] = answers, 1.0
        distance[rows, q_pos] = q_pos - where[rows, asked]
        return Batch(tokens.astype(np.int32), targets, weights, distance)


def accuracy_by_distance(correct, distance, weights, edges):
    """Accuracy per bin of fact distance: ``(centers, accuracy, count)`` arrays over ``edges`` (n + 1).

    correct: bool [b, s] (prediction right), distance, weights: as in :class:`Batch`. A bin with no
    question gets accuracy nan.
    """
    asked = weights > 0
    d, c = distance[asked], correct[asked]
    idx = np.clip(np.digitize(d, edges) - 1, 0, len(edges) - 2)
    count = np.bincount(idx, minlength=len(edges) - 1)
    hits = np.bincount(idx, weights=c.astype(np.float64), minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(count > 0, hits / np.maximum(count, 1), np.nan)
    return (edges[:-1] + edges[1:]) / 2, acc, count
