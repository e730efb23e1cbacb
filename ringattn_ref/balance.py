"""Load balance for any mask: a work model read off the block mask, and layouts that even it out.

**The work model.** On the ring, host ``i`` at step ``s`` attends its queries against K/V shard
``(i - s) % N``; the block mask (``block_mask.py``) says which of that hop's ``block_q x block_kv`` tiles
hold a visible pair. :func:`work` counts them: ``[N, N]`` (host, step), an empty tile 0, a full or a
partial tile 1 each. Why a partial tile counts as a full one: both rings compute every pair of a
non-empty tile (Q K^T and P V, the ``4 * block_q * block_kv * d`` flops that dominate) and only then mask
the partial ones, so the mask's element-wise select is the only difference (``partial=`` weighs it
otherwise, e.g. 0.5 for "about half the pairs").

Two figures of balance, from the same ``w = work(bm)``:

- ``imbalance = max_i sum_s w[i, s] / mean_i sum_s w[i, s]``: the slowest host's total over the mean
  host's. This is the issue's "imbalance figure (slowest host / mean)": 1 is perfect, N is one host doing
  everything. Causal, one document, one tile per hop: contiguous 1.78 at 8 hosts (host 7 computes 8
  hops, the mean host 4.5), zigzag 1.0.
- ``step_imbalance = critical_path / (total / N)`` with ``critical_path = sum_s max_i w[i, s]``: the
  ring is step-synchronous (a host cannot start step ``s + 1`` before the K/V of step ``s`` has come
  round, and every ``ppermute`` is a collective), so each step waits for its slowest host and this is
  the time the ring takes over the time of a perfect split. Always ``>= imbalance`` (a max of sums is at
  most the sum of maxes); it is what a machine with one core per host pays.

Nothing visible (total 0) counts as balanced, 1.0. Both are ratios to the layout's *own* mean, so they
do not see work a layout adds: striped balances packed causal documents perfectly (1.0) by making
nearly every tile partial, about twice the tiles of the contiguous layout. What the ring pays is the
absolute ``critical_path`` (in tiles), which :func:`balance` reports beside them, with the total.

**Layouts that balance.** Per-document zigzag (``layouts.per_document_zigzag``) balances causal
documents by construction, but cuts short documents into pieces finer than a tile, and a tile holding
pieces of several documents is non-empty for all of them: balance bought with extra tiles (8 documents
of 192-2900 tokens, 8 hosts, 128 x 128 tiles: 2.5 times the tiles of contiguous). The solver
:func:`balanced_layout` keeps tiles whole: it moves *chunks* of ``chunk`` tokens (a multiple of both tile
sides), so every tile of the permuted sequence is a tile of the original one and the total work is the
same for all its layouts; only who does it moves. Its steps (deterministic, no randomness):

1. ``W[a, b]``: the work of query chunk ``a`` against key chunk ``b`` (tiles of the mask in true
   order, visible in any batch row and head); row work ``r_a = sum_b W[a, b]``; host ``i``'s total is
   ``sum_{a on i} r_a`` wherever the keys go.
2. Sorted rounds (LPT with a cardinality constraint): chunks by decreasing ``r_a``, in rounds of ``N``;
   in each round the largest chunk goes to the least-loaded host, the next to the next, ... (one chunk
   per host per round, so each host ends with ``S / N / chunk`` chunks). **Guarantee**: after a round
   ``max - min`` load is at most ``max(previous spread, largest - smallest chunk of the round)`` (a host
   behind gets a bigger chunk than a host ahead), so ``max - min <= max_k range_k <= r_max - r_min``
   and ``imbalance <= 1 + (N - 1) / N * max_k range_k / mean``: with many chunks of similar work,
   near 1.
3. Swaps: exchange two chunks of different hosts while that lowers the larger of their two totals
   (never raising the largest: the bound of 2 holds), then, not letting the largest total grow, while it
   lowers the critical path (which chunk sits on which host decides who meets whom at which step).
4. Candidates: the fixed layouts of ``candidates`` (by default contiguous, striped and, when it
   splits, zigzag; pass ``per_document_zigzag(...)`` too) are scored on the same tiles and the best is
   returned, the solver's own on a tie. Best by ``objective``: ``"critical_path"`` (default: the
   ring's time, then the largest host total, then the imbalance) or ``"imbalance"`` (the issue's figure,
   then the step imbalance, then the critical path). So **the result is never worse than any candidate
   by its objective**, and its imbalance at most the bound of 2 unless a candidate beat it.

Measured (``python -m benchmarks.bench --mode balance``: 8 causal documents of 192-2900 tokens, S 8192,
8 hosts, 128 x 128 tiles): the solver alone 1.002 (step 1.10, critical path 69 tiles) where global
zigzag is 1.62 (step 2.26, 142 tiles), per-document zigzag 1.05 (164 tiles: 2.5x the tiles) and striped
1.00 (136 tiles: 2.2x); ``objective="imbalance"`` therefore returns striped, ``"critical_path"`` the
solver's own. Timed on 8 simulated CPU devices sharing 2 cores (two runs, load ~12), fwd+bwd of the
fast ring follows *all hosts'* tiles plus a fixed cost per live hop (a least-squares fit: 9-19 tiles a
hop), not the critical path: contiguous (17 live hops) was fastest, the solver (all 64 hops live)
0.96-1.43x global zigzag (36), striped and per-document zigzag 1.4-2.2x. The critical path is the time
only where each host has its own core or chip; ``hop=`` (:func:`work`, the solver) adds the per-hop cost.

The cost: one ``tile_kinds`` of the mask in true order (``block_mask.py``'s timings), a block mask per
candidate, and the swaps, ``O(C^2 N^2)`` per pass over ``C = S / chunk`` chunks, vectorised per chunk
(S 8192, 8 hosts, C 64: 0.5 s; S 16384, C 128: 1.6 s, on a shared 2-core machine).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .block_mask import FULL, PARTIAL, BlockMask, block_mask, check_function, tile_kinds
from .layouts import Layout, as_layout
from .shards import default_block
from .validation import check_bool, check_n_hosts, check_window


OBJECTIVES = ("critical_path", "imbalance")


class Balance(NamedTuple):
    """The balance of one ring: work ``[N, N]`` (host, step), each host's total ``[N]``, ``critical_path``
    (sum over steps of the max over hosts), ``imbalance`` (slowest host / mean host) and ``step_imbalance``
    (critical path / mean host): see the module docstring."""
    work: np.ndarray
    host_totals: np.ndarray
    critical_path: float
    imbalance: float
    step_imbalance: float


def work(bm, *, partial=1.0, full=1.0, hop=0.0):
    """Visible work per host per step, float ``[N, N]`` indexed (host ``i``, ring step ``s``).

    bm: a :class:`~ringattn_ref.block_mask.BlockMask` (tiles ``[N, N, nq, nk]`` indexed by K/V shard,
    which host ``i`` holds at step ``s`` as shard ``(i - s) % N``). Each tile weighs 0 when empty, ``full``
    when full and ``partial`` when partial (default 1 and 1: see the module docstring); ``hop`` is added
    for each live hop (``bm.hops``), the fixed cost of a hop that runs at all, in tiles (default 0: tiles
    alone; the module docstring has a measured value). Example: causal, 16 tokens on 4 hosts contiguous,
    tiles of 4 (one per hop): ``work`` is 1 on the first ``i + 1`` steps of host ``i``, 0 after.
    """
    if not isinstance(bm, BlockMask):
        raise ValueError(f"bm must be a ringattn_ref.block_mask.BlockMask; got {type(bm).__name__}")
    weights = np.zeros(3)
    weights[[FULL, PARTIAL]] = full, partial
    per_shard = weights[bm.tiles].sum(axis=(2, 3))  # (host, K/V shard)
    n = per_shard.shape[0]
    host = np.arange(n)[:, None]
    return per_shard[host, (host - np.arange(n)[None, :]) % n] + hop * bm.hops  # (host, step)


def _work(x):
    """``x``: a BlockMask or a work array ``[N, N]`` (host, step) -> the work array, float."""
    w = work(x) if isinstance(x, BlockMask) else np.asarray(x, np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1 or (w < 0).any():
        raise ValueError(f"work must be a non-negative [n_hosts, n_steps] array with n_steps == n_hosts; got "
                         f"shape {w.shape}")
    return w


def critical_path(x):
    """Sum over ring steps of the slowest host's work: ``w.max(axis=0).sum()`` (x: BlockMask or work)."""
    return float(_work(x).max(axis=0).sum())


def imbalance(x):
    """The slowest host's total work over the mean host's (x: a BlockMask or a work array ``[N, N]``):
    1.0 is perfect; 1.0 too when nothing is visible."""
    totals = _work(x).sum(axis=1)
    return float(totals.max() / totals.mean()) if totals.sum() > 0 else 1.0


def step_imbalance(x):
    """The ring's critical path over the mean host's total: ``sum_s max_i w[i, s] / (total / N)``;
    ``>= imbalance(x)``; 1.0 when nothing is visible."""
    w = _work(x)
    return float(w.max(axis=0).sum() / w.sum(axis=1).mean()) if w.sum() > 0 else 1.0


def balance(x):
    """All the figures at once: a :class:`Balance` of a BlockMask or a work array ``[N, N]``."""
    w = _work(x)
    return Balance(w, w.sum(axis=1), critical_path(w), imbalance(w), step_imbalance(w))


def _positive(x, name):
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{name} must be a positive int; got {x!r}")
    return int(x)


def _segment_rows(segment_ids, seq_len):
    """Segment ids ``[seq]`` or ``[batch, seq]`` in true order -> int64 ``[1|batch, seq]`` or None."""
    if segment_ids is None:
        return None
    seg = np.asarray(segment_ids)
    if seg.ndim not in (1, 2) or seg.shape[-1] != seq_len or not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(f"segment_ids must be an int array [seq_len] or [batch, seq_len] with seq_len = {seq_len}; "
                         f"got shape {seg.shape}, dtype {seg.dtype}")
    return np.atleast_2d(seg).astype(np.int64)


def _blocks(seq_len, n_hosts, block_q, block_kv):
    shard = seq_len // n_hosts
    block_q = default_block(shard) if block_q is None else block_q
    block_kv = default_block(shard) if block_kv is None else block_kv
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1 or shard % b:
            raise ValueError(f"{name} must be a positive int dividing the shard seq_len / n_hosts = {shard}; "
                             f"got {b!r}")
    return int(block_q), int(block_kv)


def layout_block_mask(layout, seq_len, n_hosts, *, mask_fn=None, segment_ids=None, causal=False, window=None,
                      block_q=None, block_kv=None, heads=1):
    """The :class:`~ringattn_ref.block_mask.BlockMask` of self-attention over ``seq_len`` tokens laid out
    with ``layout`` (a name, a permutation array or a :class:`~ringattn_ref.layouts.Layout`) on ``n_hosts``.

    Like ``ring_block_mask``, plus ``segment_ids`` (int ``[seq_len]`` or ``[batch, seq_len]``, in true
    order: permuted here with the tokens). Tile sides default to the ring's (``shards.default_block`` of
    the shard, at most 128).
    """
    seq_len, n_hosts = _positive(seq_len, "seq_len"), _positive(n_hosts, "n_hosts")
    check_n_hosts(n_hosts, seq_len, layout if isinstance(layout, str) else "contiguous")
    perm = as_layout(layout, seq_len, n_hosts).perm
    block_q, block_kv = _blocks(seq_len, n_hosts, block_q, block_kv)
    seg = _segment_rows(segment_ids, seq_len)
    seg_l = None if seg is None else seg[:, perm]
    return block_mask(check_function(mask_fn, "mask_fn"), perm, perm, n_hosts=n_hosts, block_q=block_q,
                      block_kv=block_kv, heads=heads, q_seg=seg_l, k_seg=seg_l, causal=check_bool(causal, "causal"),
                      window=check_window(window))


class _Assignment:
    """Chunks on hosts, with what the swaps need kept up to date (``A``: one-hot [C, N] of ``host``).

    P = A^T W A [N, N]: work of host h's queries against host g's keys, so the ring's work at (host i,
    step s) is ``P[i, (i - s) % N]``; Rq = W A, Rk = W^T A [C, N]: a chunk's work against each host's keys
    (as a query) and each host's queries (as a key). Swapping chunk a (host h) with b (host g) adds
    ``u v^T`` to A (u = e_a - e_b, v = e_g - e_h), so P gains ``v x^T + y v^T + c v v^T`` with
    ``x = Rq[a] - Rq[b]``, ``y = Rk[a] - Rk[b]``, ``c = W[a,a] - W[a,b] - W[b,a] + W[b,b]``.
    """

    def __init__(self, W, host, n, hop=0.0):
        self.W, self.host, self.n, self.hop = W, host.copy(), n, hop
        A = np.eye(n)[host]
        self.Rq, self.Rk = W @ A, W.T @ A
        self.P = A.T @ self.Rq
        self.cols = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n  # (host, step) -> the shard it holds

    def totals(self):
        return self.P.sum(axis=1)

    def critical(self, P):
        """Critical path of one P [N, N] or of many [..., N, N] (a live hop costs ``hop`` more)."""
        rows = np.arange(self.n)[:, None]
        w = P[..., rows, self.cols]
        return (w + self.hop * (w > 0)).max(axis=-2).sum(axis=-1)

    def swapped(self, a):
        """P after swapping chunk ``a`` with each chunk ``b``: [C, N, N] (rows of b on a's host: P unchanged)."""
        W, h, g = self.W, self.host[a], self.host
        x = self.Rq[a][None] - self.Rq  # (C, N)
        y = self.Rk[a][None] - self.Rk
        c = W[a, a] - W[a, :] - W[:, a] + np.diag(W)  # (C,)
        v = np.eye(self.n)[g] - np.eye(self.n)[h][None]  # (C, N): e_g - e_h
        return (self.P[None] + v[:, :, None] * x[:, None, :] + y[:, :, None] * v[:, None, :]
                + c[:, None, None] * v[:, :, None] * v[:, None, :])

    def swap(self, a, b):
        h, g = self.host[a], self.host[b]
        delta = self.W[:, a] - self.W[:, b]
        delta_t = self.W[a, :] - self.W[b, :]
        self.Rq[:, h] += -delta
        self.Rq[:, g] += delta
        self.Rk[:, h] += -delta_t
        self.Rk[:, g] += delta_t
        self.host[a], self.host[b] = g, h
        A = np.eye(self.n)[self.host]
        self.P = A.T @ self.Rq


def _rounds(row_work, n):
    """Step 2: sorted rounds of ``n`` chunks, each round's largest to the least-loaded host. -> host [C]."""
    order = np.lexsort((np.arange(row_work.size), -row_work))  # by decreasing work, then by position
    load, host = np.zeros(n), np.zeros(row_work.size, np.int64)
    for k in range(0, order.size, n):
        by_load = np.lexsort((np.arange(n), load))  # least loaded first, ties by host index
        for chunk, h in zip(order[k:k + n], by_load):
            host[chunk] = h
            load[h] += row_work[chunk]
    return host


def _improve(asg, *, max_passes):
    """Step 3: first-improvement swaps, chunks in index order, at most ``max_passes`` passes per phase.

    Phase "host": swap a (host h) with b (host g) when that lowers ``max(T_h, T_g)`` (the pair's larger
    total; the pair's sum is unchanged, so the sum of squares falls and the largest total never rises).
    Phase "step": swap when that lowers the critical path and keeps every total at most phase one's max.
    """
    tol = 1e-9 * max(1.0, float(asg.W.sum()))
    row = asg.W.sum(axis=1)
    for _ in range(max_passes):
        improved = False
        for a in range(row.size):
            totals = asg.totals()
            h, g = asg.host[a], asg.host
            d = row[a] - row  # (C,): what host h gives away, host g gets
            pair_max = np.maximum(totals[h] - d, totals[g] + d)
            ok = (g != h) & (pair_max < np.maximum(totals[h], totals[g]) - tol)
            if ok.any():
                asg.swap(a, int(np.argmin(np.where(ok, pair_max, np.inf))))
                improved = True
        if not improved:
            break
    cap = asg.totals().max() + tol
    for _ in range(max_passes):
        improved = False
        for a in range(row.size):
            P = asg.swapped(a)  # (C, N, N)
            crit = asg.critical(P)
            ok = (asg.host != asg.host[a]) & (P.sum(axis=2).max(axis=1) <= cap) & (crit < asg.critical(asg.P) - tol)
            if ok.any():
                asg.swap(a, int(np.argmin(np.where(ok, crit, np.inf))))
                improved = True
        if not improved:
            break
    return asg


def balanced_layout(mask_fn, seq_len, n_hosts, *, segment_ids=None, causal=False, window=None, block_q=None,
                    block_kv=None, chunk=None, heads=1, candidates=None, objective="critical_path", partial=1.0,
                    hop=0.0, max_passes=8):
    """A deterministic :class:`~ringattn_ref.layouts.Layout` that evens out the ring's work for any mask.

    The mask: ``mask_fn`` (``variants.py``, or None) and the built-ins ``causal``, ``window`` and
    ``segment_ids`` (int ``[seq_len]`` or ``[batch, seq_len]``, true order; one layout serves every row,
    the work of a tile being that of any row); ``heads`` query heads for a per-head ``mask_fn``. The ring:
    ``n_hosts`` hosts over ``seq_len`` tokens, tiles ``block_q x block_kv`` (default: the ring's,
    ``shards.default_block`` of the shard). ``chunk``: the unit moved, a multiple of both tile sides that
    divides the shard ``seq_len / n_hosts`` (default: the smallest, ``lcm(block_q, block_kv)``).
    ``candidates``: fixed layouts (names, permutations or Layouts) the result must match or beat (default
    contiguous, striped, and zigzag when ``2 * n_hosts`` divides ``seq_len``; ``()`` for the solver alone).
    ``partial``, ``hop``: a partial tile's weight and a live hop's cost (:func:`work`; with ``hop`` the
    swaps of the critical path count it too). The algorithm and its guarantee: the module
    docstring. Use it as ``ring_attention(..., layout=lay.perm)`` (ref or fast).

    Example: 4 causal documents of 8, 8, 8, 40 tokens (segment ids) on 4 hosts, tiles of 4: contiguous has
    imbalance 2.125 (host 3 holds the long document's last 16 tokens: 34 tiles, the mean 16), zigzag 1.375
    (critical path 34 tiles); the solver 1.0 with a critical path of 20 tiles, striped 1.0 with 28.
    """
    seq_len, n_hosts = _positive(seq_len, "seq_len"), _positive(n_hosts, "n_hosts")
    check_n_hosts(n_hosts, seq_len, "contiguous")
    mask_fn = check_function(mask_fn, "mask_fn")
    causal, window = check_bool(causal, "causal"), check_window(window)
    block_q, block_kv = _blocks(seq_len, n_hosts, block_q, block_kv)
    shard = seq_len // n_hosts
    unit = np.lcm(block_q, block_kv)
    chunk = int(unit) if chunk is None else chunk
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1 or chunk % unit \
            or shard % chunk:
        raise ValueError(f"chunk must be a positive multiple of lcm(block_q, block_kv) = {unit} dividing the shard "
                         f"seq_len / n_hosts = {shard}; got {chunk!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}; got {objective!r}")
    seg = _segment_rows(segment_ids, seq_len)
    kw = dict(mask_fn=mask_fn, segment_ids=seg, causal=causal, window=window, block_q=block_q, block_kv=block_kv,
              heads=heads)
    if candidates is None:
        candidates = ["contiguous", "striped"] + (["zigzag"] if seq_len % (2 * n_hosts) == 0 else [])

    # 1. chunk-pair work, from the tiles in true order
    pos = np.arange(seq_len)
    kinds = tile_kinds(mask_fn, pos, pos, block_q=block_q, block_kv=block_kv, heads=heads, q_seg=seg, k_seg=seg,
                       causal=causal, window=window)
    weights = np.zeros(3)
    weights[[FULL, PARTIAL]] = 1.0, partial
    tw = weights[kinds]  # (S / block_q, S / block_kv)
    n_chunks = seq_len // chunk
    W = tw.reshape(n_chunks, chunk // block_q, n_chunks, chunk // block_kv).sum(axis=(1, 3))  # (C, C)

    # 2. sorted rounds, 3. swaps
    asg = _improve(_Assignment(W, _rounds(W.sum(axis=1), n_hosts), n_hosts, hop), max_passes=max_passes)
    chunks = [np.flatnonzero(asg.host == h) for h in range(n_hosts)]  # each host's chunks, in true order
    perm = np.concatenate([(c[:, None] * chunk + np.arange(chunk)).ravel() for c in chunks])
    best = Layout(perm, np.argsort(perm))

    # 4. the candidates, scored on the same tiles
    def score(lay):
        b = balance(work(layout_block_mask(lay, seq_len, n_hosts, **kw), partial=partial, hop=hop))
        if objective == "imbalance":
            return b.imbalance, b.step_imbalance, b.critical_path
        return b.critical_path, b.host_totals.max(), b.imbalance
    best_score = score(best)
    for i, cand in enumerate(candidates):
        lay = as_layout(cand, seq_len, n_hosts, name=f"candidates[{i}]")
        s = score(lay)
        if s < best_score:
            best, best_score = lay, s
    return best


__all__ = ["Balance", "balance", "balanced_layout", "critical_path", "imbalance", "layout_block_mask",
           "step_imbalance", "work"]
