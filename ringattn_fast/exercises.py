"""Self-checks for the exercises of notebooks 07-10 (``ringattn_fast``: shard_map, kernels, fused ring).

Same protocol as :mod:`ringattn_ref.exercises`: each ``check_*`` takes the learner's answer (a number
or a function). While it is the placeholder ``None`` it prints a reminder and returns ``False``, so a
notebook runs top to bottom before anyone has tried; a wrong answer raises ``AssertionError`` with a
hint; a right one prints ``Correct`` and returns ``True``. Expected values come from the library (the
kernels' tile predicate, the fused kernel's ring rules, the cost model), never from a hard-coded
result. Names do not clash with :mod:`ringattn_ref.exercises`.
"""
from __future__ import annotations

import math

import numpy as np

from ringattn_ref.exercises import _correct, _pending  # one voice for every notebook's checks


def _as_int(x, what):
    """``x`` as an int, or AssertionError if it is not an integral number."""
    try:
        value = float(np.asarray(x).item())
    except (TypeError, ValueError) as err:
        raise AssertionError(f"{what} must be a single integer; got {x!r}") from err
    if not value.is_integer():
        raise AssertionError(f"{what} must be an integer; got {x!r}")
    return int(value)


# ---- 07 shard_map and ppermute ---------------------------------------------------------------------

def check_reverse_ring_perm(reverse_perm):
    """07, exercise 1: ``reverse_perm(n) -> [(source, destination), ...]`` for ``lax.ppermute`` so that
    every device sends its block to device ``i - 1`` (the ring run backwards)."""
    if _pending(reverse_perm, "reverse_perm(n) for lax.ppermute"):
        return False
    for n in range(1, 9):
        try:
            pairs = [(_as_int(a, "a source"), _as_int(b, "a destination")) for a, b in reverse_perm(n)]
        except (TypeError, ValueError) as err:
            raise AssertionError(f"reverse_perm({n}) must return (source, destination) pairs; {err}") from err
        if sorted(a for a, _ in pairs) != list(range(n)) or sorted(b for _, b in pairs) != list(range(n)):
            raise AssertionError(f"reverse_perm({n}) = {pairs}: every device must send once and receive once")
        held = np.arange(n)  # held[i] = block on device i
        after = np.empty_like(held)
        for a, b in pairs:
            after[b] = held[a]
        want = np.roll(held, -1)  # device i now holds block i + 1: it came from the right
        if not np.array_equal(after, want):
            raise AssertionError(f"n={n}: after one ppermute the devices hold blocks {after.tolist()}; "
                                 f"a ring run backwards gives {want.tolist()} (device i receives from i + 1)")
    _run_on_devices(pairs)
    return _correct("K/V would travel i -> i - 1, and host i holds block (i + step) % n at step `step`")


def _run_on_devices(pairs):
    """Run the learner's permutation with a real ``lax.ppermute`` on ``len(pairs)`` simulated devices."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from .mesh import make_mesh

    n = len(pairs)
    if n > len(jax.devices()):
        return
    mesh = make_mesh(n)
    out = jax.shard_map(lambda x: lax.ppermute(x, "sp", pairs), mesh=mesh, in_specs=jax.P("sp"),
                        out_specs=jax.P("sp"))(jnp.arange(n, dtype=jnp.int32))
    if not np.array_equal(np.asarray(out), np.roll(np.arange(n), -1)):
        raise AssertionError(f"lax.ppermute with your pairs gave {np.asarray(out).tolist()}")


def check_kv_bytes_sent(answer, *, batch=1, seq=256, kv_heads=2, dim=16, n_devices=8, itemsize=4):
    """07, exercise 2: bytes of K and V one device sends over a whole forward ring (positions aside).

    Defaults: the notebook's problem (batch 1, seq 256, 2 kv heads, dim 16, float32, 8 devices).
    """
    if _pending(answer, "bytes of K and V one device sends in the forward"):
        return False
    shard = batch * (seq // n_devices) * kv_heads * dim * itemsize  # one of K, V on one device
    want = (n_devices - 1) * 2 * shard
    got = _as_int(answer, "the number of bytes")
    if got != want:
        raise AssertionError(f"got {got}; hint: how many ppermute sends does the scan make (no send after the "
                             f"last step), and how large are one device's K and V shards?")
    return _correct(f"{n_devices - 1} sends x 2 x {shard} bytes = {want} bytes; the queries never move")


# ---- 08 Pallas per-hop kernels ---------------------------------------------------------------------

def _tiles_computed(seq, block, causal, window):
    import jax.numpy as jnp

    from .kernels.tiles import tile_schedule

    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    return int(np.asarray(tile_schedule(pos, pos, causal=causal, window=window, block_q=block,
                                        block_kv=block)).sum())


def check_causal_tiles(answer, *, seq=1024, block=128):
    """08, exercise 1: tiles a causal one-device hop computes, seq 1024, block_q = block_kv = 128."""
    if _pending(answer, "number of tiles computed under a causal mask"):
        return False
    want = _tiles_computed(seq, block, True, None)
    if _as_int(answer, "the number of tiles") != want:
        n = seq // block
        raise AssertionError(f"got {answer}; the grid has {n} x {n} = {n * n} tiles: which ones have a key "
                             f"no later than the tile's last query?")
    return _correct(f"{want} of {(seq // block) ** 2}: the lower triangle and the diagonal")


def check_window_tiles(answer, *, seq=1024, block=128, window=(100, 0)):
    """08, exercise 2: tiles computed for a sliding window ``(100, 0)``, seq 1024, blocks of 128."""
    if _pending(answer, "number of tiles computed with window=(100, 0)"):
        return False
    want = _tiles_computed(seq, block, False, tuple(window))
    if _as_int(answer, "the number of tiles") != want:
        raise AssertionError(f"got {answer}; a query at position i sees keys i - 100 ... i: which key tiles "
                             f"can a query tile [128 t, 128 t + 127] reach?")
    return _correct(f"{want}: the diagonal and the tile left of it (except for the first row)")


# ---- 09 the fused TPU ring -------------------------------------------------------------------------

def check_recv_slot(recv_slot):
    """09, exercise 1: ``recv_slot(step)``: the slot of the double buffer that a device's left
    neighbour writes into (by remote DMA) during ring step ``step``."""
    if _pending(recv_slot, "recv_slot(step)"):
        return False
    for step in range(8):
        want = 1 - step % 2  # tpu_ring_fused._sends: compute on slot step % 2, receive into the other
        got = _as_int(recv_slot(step), f"recv_slot({step})")
        if got != want:
            raise AssertionError(f"step {step}: the device computes on slot {step % 2}; you say it receives "
                                 f"into slot {got}")
    return _correct("1 - step % 2: the slot that will be computed on at step + 1")


def check_handshake_signals(n_signals):
    """09, exercise 2: ``n_signals(n_devices)``: how often one device signals the handshake semaphore
    (``cap_sem``) to its left neighbour during the fused *forward* kernel."""
    if _pending(n_signals, "n_signals(n_devices)"):
        return False
    for n in range(1, 9):
        # The kernel signals after step `step` when the left neighbour will still write again, i.e.
        # when it sends at step + 1: sends happen at steps 0 .. n - 2.
        want = sum(1 for step in range(n) if step < n - 1 and step + 1 <= n - 2)
        got = _as_int(n_signals(n), f"n_signals({n})")
        if got != want:
            raise AssertionError(f"n_devices={n}: a device signals {want} times, you say {got} (hint: the "
                                 f"left neighbour sends at steps 0 .. n-2; which of its writes need my 'free'?)")
    return _correct("max(n - 2, 0): with 2 devices nobody writes a slot twice, so no handshake is needed")


# ---- 10 putting it together ------------------------------------------------------------------------

def check_min_context(answer, *, hardware="TPU v5e", n_hosts=64):
    """10, exercise 1: the shortest total sequence at which a ring of 64 TPU v5e hosts hides every
    transfer (Table 2's minimal sequence per host, ``6c`` with ``c = F/B``, times the hosts)."""
    if _pending(answer, "shortest context that overlaps communication on 64 TPU v5e hosts"):
        return False
    from ringattn_ref import cost

    want = n_hosts * cost.table2([hardware])[0].min_seq
    got = float(np.asarray(answer).item())
    if not math.isclose(got, want, rel_tol=1e-3):
        raise AssertionError(f"got {got:.6g}; Table 2 gives the minimal sequence per host (6 c, c = F / B); "
                             f"the ring has {n_hosts} hosts")
    return _correct(f"{want / 1e3:.0f}K tokens: below that, the hosts wait for K/V")
