"""The block mask: which tiles (and which ring hops) a mask leaves empty, full or partial, before the ring runs.

The built-in masks (causal, window, segment ids) prove a tile empty from its positions' min/max alone
(``masks.tile_is_empty``); a user's ``mask_fn`` (``variants.py``) proves nothing that way, so without a
block mask every tile it leaves empty is still computed, then masked. Here the mask is evaluated once,
densely, on the *true positions* of every host's queries and keys (FlexAttention's ``create_block_mask``,
Dong et al. 2024), and each ``block_q x block_kv`` tile gets a kind:

- ``EMPTY`` (0): no pair attends, for any batch row and any head: the tile is skipped;
- ``FULL`` (1): every pair attends, in every row and head: the tile needs no mask;
- ``PARTIAL`` (2): the rest: computed and masked.

A hop is empty when all its tiles are: the host skips the whole K/V shard (it still forwards it). With 8
documents of S/8 tokens, causal, on 8 hosts contiguous, host i's queries see only shard i: 56 of the
64 hops are empty and 93% of the 128 x 128 tiles (``tests/test_ref_block_mask.py``).

Cost: ``O(T * S * heads)`` pair evaluations, done in chunks of at most ``CHUNK_PAIRS`` pairs (at least
one tile), so memory stays ``O(block_q * block_kv * heads * batch)`` beyond the result, ``N^2 * (T / N /
block_q) * (S / N / block_kv)`` int8 (4 MiB at seq 65536, 8 hosts, 128 x 128 tiles). Key tiles that the
built-ins prove empty for a whole chunk are not evaluated (a causal mask costs about half), nor are the
built-ins in a chunk they prove full. Measured (``ring_block_mask`` of that document mask, one head, 8
hosts, 128 x 128 tiles, numpy on a 2-core machine shared with three other jobs, load ~10, so upper
bounds): seq 8192 in 0.2 s (causal or not, contiguous or zigzag); seq 65536 in 7 s causal contiguous and
11-19 s non-causal or zigzag (about 4 ns per pair); the built-in causal mask alone, 1.2 s at 65536.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from .attention import call_mask_fn
from .layouts import layout_permutation
from .masks import allowed, bounds_empty, bounds_full
from .validation import check_bool, check_layout, check_window

EMPTY, FULL, PARTIAL = 0, 1, 2
CHUNK_PAIRS = 2 ** 19  # mask elements (pairs x heads x batch rows) per evaluation chunk, or one tile's if more


class BlockMask(NamedTuple):
    """The tile kinds of a whole ring, and its hops.

    - tiles: int8 ``[n_hosts, n_hosts, nq, nk]``, indexed (query host, K/V shard, query tile, key tile):
      ``EMPTY`` / ``FULL`` / ``PARTIAL`` (0 / 1 / 2);
    - hops: bool ``[n_hosts, n_hosts]`` indexed (host ``my_idx``, ring step): True where the hop at that
      step (K/V shard ``(my_idx - step) % n_hosts``) holds at least one visible pair;
    - seconds: the wall time it took to compute.
    """
    tiles: np.ndarray
    hops: np.ndarray
    seconds: float

    @property
    def empty_hop_fraction(self):
        """The fraction of the ``n_hosts**2`` hops that are empty (skipped whole)."""
        return float(1.0 - self.hops.mean())

    @property
    def skipped_fraction(self):
        """The fraction of all tiles that are empty: the share of the tile compute skipped."""
        return float((self.tiles == EMPTY).mean())

    def tile_counts(self):
        """``dict(empty=, full=, partial=)``: how many tiles of each kind, over all hosts and shards."""
        return {name: int((self.tiles == kind).sum())
                for name, kind in (("empty", EMPTY), ("full", FULL), ("partial", PARTIAL))}


def check_function(fn, name):
    """A user function (``mask_fn``, ``score_fn``: ``variants.py``) must be callable, or None."""
    if fn is not None and not callable(fn):
        raise ValueError(f"{name} must be a function (see ringattn_ref.variants) or None; got "
                         f"{type(fn).__name__} {fn!r}")
    return fn


def _rows(x, name, length=None):
    """Int positions or segment ids ``[s]`` or ``[b, s]`` -> ``[1|b, s]`` int64."""
    x = np.asarray(x)
    if x.ndim not in (1, 2) or not np.issubdtype(x.dtype, np.integer) or x.shape[-1] < 1:
        raise ValueError(f"{name} must be a non-empty int array [seq] or [batch, seq]; got {x.dtype} {x.shape}")
    if length is not None and x.shape[-1] != length:
        raise ValueError(f"{name} must have the length of its positions, {length}; got shape {x.shape}")
    return np.asarray(x if x.ndim == 2 else x[None], np.int64)


def _tile_side(block, n, name, what):
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1 or n % block:
        raise ValueError(f"{name} must be a positive int dividing {what} ({n}); got {block!r}")
    return int(block)


def _tile_bounds(pos, seg, block):
    """Each tile's (pos_lo, pos_hi[, seg_lo, seg_hi]), each ``[1|b, n_tiles]``: ``masks.bounds_empty``'s input."""
    tiles = lambda x: x.reshape(x.shape[0], -1, block)  # noqa: E731  (1|b, n_tiles, block)
    parts = (pos,) if seg is None else (pos, seg)
    return tuple(f(tiles(x), axis=-1) for x in parts for f in (np.min, np.max))


def tile_kinds(mask_fn, q_pos, k_pos, *, block_q, block_kv, heads=1, q_seg=None, k_seg=None, causal=False,
               window=None):
    """The kind of every ``block_q x block_kv`` tile of queries ``q_pos`` against keys ``k_pos``: int8 ``[nq, nk]``.

    q_pos: int [sq] or [b, sq], k_pos: int [sk] or [b, sk] true positions (a host's queries, the keys in
    layout order); q_seg / k_seg: segment ids of the same shapes, or None. A pair is visible when the
    built-in mask (``masks.allowed``: causal, window, segment ids) *and* ``mask_fn`` (None: built-ins only;
    called as in ``variants.py``: ``q_pos [b|1, 1, t, 1]``, ``k_pos [b|1, 1, 1, s]``, segment ids alike, 0
    when None, ``head [1, heads, 1, 1]``) allow it. Tile ``(i, j)`` is ``EMPTY`` (0) when no pair of it is
    visible in any batch row and head, ``FULL`` (1) when all are, else ``PARTIAL`` (2).

    Example, causal, 4 positions, tiles of 2: ``tile_kinds(None, np.arange(4), np.arange(4), block_q=2,
    block_kv=2, causal=True)`` is ``[[2, 0], [1, 2]]``.
    """
    mask_fn = check_function(mask_fn, "mask_fn")
    q_pos, k_pos = _rows(q_pos, "q_pos"), _rows(k_pos, "k_pos")
    sq, sk = q_pos.shape[1], k_pos.shape[1]
    if (q_seg is None) != (k_seg is None):
        raise ValueError("q_seg and k_seg go together: pass both or neither")
    q_seg = None if q_seg is None else _rows(q_seg, "q_seg", sq)
    k_seg = None if k_seg is None else _rows(k_seg, "k_seg", sk)
    rows_of = [x.shape[0] for x in (q_pos, k_pos, q_seg, k_seg) if x is not None]
    batch = max(rows_of)
    if any(r not in (1, batch) for r in rows_of):
        raise ValueError(f"q_pos, k_pos, q_seg, k_seg must have the same batch (or 1); got {rows_of} rows")
    block_q = _tile_side(block_q, sq, "block_q", "the number of queries")
    block_kv = _tile_side(block_kv, sk, "block_kv", "the number of keys")
    if not isinstance(heads, (int, np.integer)) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"heads must be a positive int; got {heads!r}")
    causal, window = check_bool(causal, "causal"), check_window(window)

    nq, nk = sq // block_q, sk // block_kv
    kinds = np.zeros((nq, nk), np.int8)
    q_bounds, k_bounds = _tile_bounds(q_pos, q_seg, block_q), _tile_bounds(k_pos, k_seg, block_kv)
    tile_pairs = block_q * block_kv * heads * batch
    q_step = max(1, CHUNK_PAIRS // (tile_pairs * nk))  # query tiles per chunk (whole tile rows)
    for q0 in range(0, nq, q_step):
        q_tiles = np.arange(q0, min(nq, q0 + q_step))
        qb, kb = tuple(x[:, q_tiles, None] for x in q_bounds), tuple(x[:, None, :] for x in k_bounds)
        empty = bounds_empty(qb, kb, causal=causal, window=window)  # (1|b, chunk, nk), None: nothing provable
        full = bounds_full(qb, kb, causal=causal, window=window)  # (1|b, chunk, nk), None: nothing masked
        live = np.arange(nk) if empty is None else np.flatnonzero(~empty.all(axis=(0, 1)))  # k tiles to look at
        k_step = max(1, CHUNK_PAIRS // (tile_pairs * q_tiles.size))
        for k0 in range(0, live.size, k_step):
            k_tiles = live[k0:k0 + k_step]
            builtins_full = full is None or full[:, :, k_tiles].all()  # the built-ins mask nothing here
            if mask_fn is None and builtins_full:
                kinds[np.ix_(q_tiles, k_tiles)] = FULL
                continue
            rows = (q_tiles[:, None] * block_q + np.arange(block_q)).ravel()
            cols = (k_tiles[:, None] * block_kv + np.arange(block_kv)).ravel()
            qp, kp = q_pos[:, rows], k_pos[:, cols]
            qs, ks = (None, None) if q_seg is None else (q_seg[:, rows], k_seg[:, cols])
            ok = np.ones((1, 1, rows.size, cols.size), bool)
            if not builtins_full:  # (1|b, 1, r, c)
                seg = (None, None) if qs is None else (qs[:, :, None], ks[:, None, :])
                ok = allowed(qp[:, :, None], kp[:, None, :], *seg, causal=causal, window=window)[:, None]
            if mask_fn is not None:
                ok = ok & call_mask_fn(mask_fn, qp, kp, qs, ks, batch, heads)  # (1|b, 1|h, r, c)
            b_, h_ = ok.shape[:2]  # a broadcast axis repeats the same pairs: counting it once is exact
            count = ok.reshape(b_, h_, q_tiles.size, block_q, k_tiles.size, block_kv).sum(axis=(0, 1, 3, 5))
            kinds[np.ix_(q_tiles, k_tiles)] = np.where(count == b_ * h_ * block_q * block_kv, FULL,
                                                       np.where(count > 0, PARTIAL, EMPTY))
    return kinds


def block_mask(mask_fn, q_pos, k_pos, *, n_hosts, block_q, block_kv, heads=1, q_seg=None, k_seg=None,
               causal=False, window=None):
    """The :class:`BlockMask` of a ring whose positions are already in layout order.

    q_pos: int [T] or [b, T], k_pos: int [S] or [b, S]: true positions in layout order (host ``r`` owns
    queries ``r*T/N : (r+1)*T/N`` and K/V shard ``r``, keys ``r*S/N : (r+1)*S/N``); q_seg / k_seg alike or
    None; the rest as in :func:`tile_kinds`. ``ring.setup_ring`` calls this with its hosts' positions.
    """
    start = time.perf_counter()
    q_pos, k_pos = _rows(q_pos, "q_pos"), _rows(k_pos, "k_pos")
    n = n_hosts
    for name, x in (("q_pos", q_pos), ("k_pos", k_pos)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1 or x.shape[1] % n:
            raise ValueError(f"n_hosts must be a positive int dividing the length of {name} ({x.shape[1]}); "
                             f"got {n!r}")
    c = q_pos.shape[1] // n
    per_host = []
    for r in range(n):  # one host's queries against every key at once: its tiles of every shard
        sl = slice(r * c, (r + 1) * c)
        kinds = tile_kinds(mask_fn, q_pos[:, sl], k_pos, block_q=block_q, block_kv=block_kv, heads=heads,
                           q_seg=None if q_seg is None else _rows(q_seg, "q_seg")[:, sl], k_seg=k_seg,
                           causal=causal, window=window)  # (nq, N * nk)
        per_host.append(kinds.reshape(kinds.shape[0], n, -1).transpose(1, 0, 2))  # (N, nq, nk)
    tiles = np.stack(per_host)  # (query host, K/V shard, nq, nk)
    live = (tiles != EMPTY).any(axis=(2, 3))  # (query host, K/V shard)
    hops = np.array([[live[i, (i - step) % n] for step in range(n)] for i in range(n)])  # the ring's kv_idx
    return BlockMask(tiles, hops, time.perf_counter() - start)


def _length(x, name):
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{name} must be a positive int; got {x!r}")
    return int(x)


def ring_block_mask(mask_fn, seq_len, n_hosts, *, layout="contiguous", kv_seq_len=None, block_q, block_kv,
                    heads=1, causal=False, window=None):
    """The :class:`BlockMask` of ``mask_fn`` on a ring of ``n_hosts`` hosts: which hops and tiles it leaves empty.

    seq_len T queries, kv_seq_len S keys (None: T); each is laid out with ``layout`` on its own
    (``"contiguous"``, ``"striped"``, ``"zigzag"``, or a permutation array when ``T == S``) and split into
    ``n_hosts`` shards. Keys' true positions are their positions in ``0 .. S-1``; queries are the *last* T
    (``ringattn_ref.attention``'s default): layout position over T plus ``S - T``. ``block_q`` must divide
    the query shard ``T / N``, ``block_kv`` the K/V shard ``S / N``; the mask is ``mask_fn`` (or None) and
    the built-ins ``causal`` / ``window``, evaluated for ``heads`` query heads (see :func:`tile_kinds`).

    Example: ``ring_block_mask(None, 16, 4, block_q=2, block_kv=2, causal=True).hops`` is True on the
    first ``i + 1`` steps of host ``i`` (it sees shards ``i, i-1, .., 0``): 6 of the 16 hops are empty.
    """
    seq_len = _length(seq_len, "seq_len")
    kv_seq_len = seq_len if kv_seq_len is None else _length(kv_seq_len, "kv_seq_len")
    if not isinstance(layout, str) and seq_len != kv_seq_len:
        raise ValueError(f"layout: a permutation array orders one sequence; with seq_len ({seq_len}) != "
                         f"kv_seq_len ({kv_seq_len}) pass a layout name ('contiguous', 'striped', 'zigzag')")
    layout = check_layout(layout, seq_len)
    n_hosts = _length(n_hosts, "n_hosts")
    parts = 2 * n_hosts if isinstance(layout, str) and layout == "zigzag" else n_hosts
    for name, length in (("seq_len", seq_len), ("kv_seq_len", kv_seq_len)):
        if length % parts:
            raise ValueError(f"{name} ({length}) must be divisible by "
                             f"{f'2*n_hosts = {parts} (zigzag layout)' if parts != n_hosts else f'n_hosts = {parts}'}")
    _tile_side(block_q, seq_len // n_hosts, "block_q", "the query shard seq_len / n_hosts")
    _tile_side(block_kv, kv_seq_len // n_hosts, "block_kv", "the K/V shard kv_seq_len / n_hosts")
    q_pos = layout_permutation(layout, seq_len, n_hosts) + (kv_seq_len - seq_len)
    k_pos = layout_permutation(layout, kv_seq_len, n_hosts)
    return block_mask(mask_fn, q_pos, k_pos, n_hosts=n_hosts, block_q=block_q, block_kv=block_kv, heads=heads,
                      causal=causal, window=window)
