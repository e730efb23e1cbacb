"""Ring Attention (arXiv:2310.01889, Algorithm 1) simulated on ``n_hosts`` explicit virtual hosts.

The sequence is cut into ``N = n_hosts`` shards of ``c = seq / N`` tokens (after the layout's
permutation). Host ``my_idx`` keeps its query shard (a :class:`~ringattn_ref.shards.QShard`) for the
whole computation; the K/V shards (:class:`~ringattn_ref.shards.KVShard`) travel around the ring,
host ``i -> i + 1``. At step ``step`` host ``my_idx`` holds K/V shard ``kv_idx = (my_idx - step) % N``:
with 4 hosts, at step 1 host 0 holds K/V shard 3. Each host runs blockwise attention
(``blockwise.attend_kv_shard``) of its queries against the shard it holds, folding tiles into its
running ``(m, l, o)``, while the shard is being sent on to the next host (on real hardware the send
overlaps the compute, paper §3). After ``N`` steps every host has seen every shard; there is no send
after the last step.

Segment ids and true positions travel with their K/V shard, so masks are exact for every layout.
A full bias ``[b, h|1, t, s]`` is indexed by the host with its query rows and the key columns of the
shard it holds (by true positions); in this simulation the bias is not sent around the ring.

Queries and keys may differ in length (cross-attention, ``t != s``): each is laid out and cut into ``N``
shards on its own (``t / N`` queries stay, ``s / N`` keys travel), and the queries are the *last* t
positions (``ringattn_ref.attention``'s default: causal means ``k_pos <= q_pos + s - t``). A ``mask_fn``
(``variants.py``) is evaluated once before the ring into a ``block_mask.BlockMask``; a host skips the
hops and the tiles it leaves empty, which bounds on positions cannot prove for a user's function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .balance import balance as work_balance
from .block_mask import block_mask, check_function
from .blockwise import attend_kv_shard, bias_tile
from .dropout import check_dropout
from .layouts import layout_permutation
from .masks import mark_bad_keys, tile_is_empty
from .shards import HopConfig, KVGrads, KVShard, QShard, default_block
from .softmax import finalize, init_state
from .validation import (check_attention_shapes, check_bias, check_block, check_bool, check_layout, check_n_hosts,
                         check_qkv, check_scale, check_segment_ids, check_softcap, check_window)


class Message(NamedTuple):
    """What one host sends its right neighbour at a step: K/V shard number ``kv_idx`` (``kv``, with
    its true positions and segment ids) and, in the backward, its gradient accumulators ``grads``."""
    kv_idx: int
    kv: KVShard
    grads: KVGrads | None = None

    def payload_elements(self):
        """Number of float elements sent: K and V (and dK, dV in the backward)."""
        grads = () if self.grads is None else (self.grads.dk, self.grads.dv)
        return sum(x.size for x in (self.kv.k, self.kv.v) + grads)

    def meta_bytes(self):
        """Bytes of the positions and segment ids sent alongside."""
        return self.kv.pos.nbytes + (0 if self.kv.seg is None else self.kv.seg.nbytes)


@dataclass
class Host:
    """One virtual device: its query shard (stays), the message it holds, its receive buffer, and its
    online-softmax state.

    - qs: QShard(q [b, c, h, d], pos int [1, c] true positions, seg int [b, c] or None); K/V shards
      hold ``s / N`` keys, which is ``c`` unless ``t != s``;
    - held / recv: :class:`Message` (the K/V shard held now / being received), recv None between steps;
    - m, l: [b, h, c]; o: [b, c, h, d] (unnormalised until the end);
    - backward only (``backward.py``): do: [b, c, h, d]; lse, delta: [b, h, c]; dq: [b, c, h, d].
    """
    my_idx: int
    qs: QShard
    held: Message
    recv: Message | None = None
    m: np.ndarray | None = None
    l: np.ndarray | None = None
    o: np.ndarray | None = None
    do: np.ndarray | None = None
    lse: np.ndarray | None = None
    delta: np.ndarray | None = None
    dq: np.ndarray | None = None

    def live_elements(self, tile_elements):
        """Float elements live during compute: q, held K/V, receive buffer, o, m, l, one score tile."""
        recv = 0 if self.recv is None else self.recv.payload_elements()
        return (self.qs.q.size + self.held.payload_elements() + recv + self.o.size + self.m.size
                + self.l.size + tile_elements)


@dataclass(frozen=True)
class RingTrace:
    """What happened on each host at each step of the forward ring; ``n_steps == n_hosts``.

    layout: the layout name, or ``"custom"`` for a permutation array. Arrays ``[n_hosts, n_steps]``:

    - kv_idx (int): the K/V shard host i holds at step s, ``(i - s) % n_hosts``;
    - tiles_computed / tiles_skipped (int): ``block_q x block_kv`` tiles computed / left out because
      the mask is provably empty (by position bounds, or by the block mask of a ``mask_fn``);
      hop_skipped (bool): the whole hop was empty;
    - flops (float): ``4 * batch * heads * block_q * block_kv * dim`` per computed tile (QK^T and
      PV, 2 flops per multiply-add);
    - bytes_sent (int): bytes of K and V sent after step s (0 at the last step: no wasted final
      send); meta_bytes_sent (int): positions and segment ids sent alongside.

    peak_bytes (int) ``[n_hosts]``: peak live bytes on the host: q shard, held K/V, K/V receive
    buffer, o, m, l and one score tile (the bias and the int metadata are not counted).
    Float bytes use the input dtype's itemsize. block_mask: the :class:`~ringattn_ref.block_mask.BlockMask`
    the ring skipped by (with a ``mask_fn``), else None.
    """
    n_hosts: int
    layout: str
    block_q: int
    block_kv: int
    kv_idx: np.ndarray
    tiles_computed: np.ndarray
    tiles_skipped: np.ndarray
    hop_skipped: np.ndarray
    flops: np.ndarray
    bytes_sent: np.ndarray
    meta_bytes_sent: np.ndarray
    peak_bytes: np.ndarray
    block_mask: Any = None

    @property
    def n_steps(self):
        return self.kv_idx.shape[1]

    def critical_path(self):
        """Sum over steps of the max over hosts of flops: hosts synchronise at every hop."""
        return float(self.flops.max(axis=0).sum())

    def work_per_host(self):
        """Flops per host summed over steps, [n_hosts]."""
        return self.flops.sum(axis=1)

    def balance(self):
        """The load balance of this run (``balance.py``): a :class:`~ringattn_ref.balance.Balance` of the
        tiles each host computed at each step (``tiles_computed``: the block mask's non-empty tiles with a
        ``mask_fn``, else those the position bounds could not prove empty)."""
        return work_balance(self.tiles_computed)

    def imbalance(self):
        """The slowest host's computed tiles over the mean host's (1.0: perfect); ``balance()`` has the
        step-synchronous figure (critical path / mean) too."""
        return self.balance().imbalance


@dataclass(frozen=True)
class RingProblem:
    """Validated, normalised arguments shared by the forward and the backward ring."""
    n_hosts: int
    shard: int
    perm: np.ndarray  # (t,) perm[p] = the query at layout position p (its true position minus q_offset)
    layout_name: str
    hop: HopConfig  # scale, mask, tile sides: every field set
    bias: np.ndarray | None
    itemsize: int
    dropout: tuple | None = None  # (seed uint32 [2], rate) or None
    kv_perm: np.ndarray | None = None  # (s,) the same for the keys (true position = key index)
    kv_shard: int | None = None  # keys per K/V shard, s / N
    q_offset: int = 0  # s - t: query i is at true position i + s - t
    block_mask: Any = None  # block_mask.BlockMask of hop.mask_fn, or None


def setup_ring(q, k, v, *, n_hosts, causal, segment_ids, bias, window, scale, layout, block_q,
               block_kv, dropout_rate=0.0, dropout_key=None, logit_softcap=None, mask_fn=None, score_fn=None,
               kv_segment_ids=None, cross_attention=False):
    """Validate the arguments and build the hosts: host ``r`` gets layout shard ``r`` of q and of k/v.

    ``cross_attention``: q may hold t queries and k/v s keys, ``t != s`` (the ring allows it; the
    all-gather and Ulysses do not yet); each is laid out with ``layout`` and cut into shards on its own.
    """
    if cross_attention:
        b, t, s, h, hk, d, _ = check_attention_shapes(q, k, v)
    else:
        b, s, h, hk, d = check_qkv(q, k, v, value_width=True)
        t = s
    if not isinstance(layout, str) and t != s:
        raise ValueError(f"layout: a permutation array orders one sequence; with t = {t} queries and s = {s} "
                         f"keys pass a layout name ('contiguous', 'striped', 'zigzag')")
    layout = check_layout(layout, t)
    n_hosts = check_n_hosts(n_hosts, t, layout)
    if s != t:
        try:
            check_n_hosts(n_hosts, s, layout)
        except ValueError as e:
            raise ValueError(f"k and v (s = {s} keys, q has t = {t}): {e}") from None
    c, c_kv = t // n_hosts, s // n_hosts
    hop = HopConfig(scale=check_scale(scale, d), causal=check_bool(causal, "causal"),
                    window=check_window(window, s if t <= s else None), logit_softcap=check_softcap(logit_softcap),
                    block_q=check_block(default_block(c) if block_q is None else block_q, c, "block_q"),
                    block_kv=check_block(default_block(c_kv) if block_kv is None else block_kv, c_kv, "block_kv"),
                    mask_fn=check_function(mask_fn, "mask_fn"), score_fn=check_function(score_fn, "score_fn"))
    rate, seed = check_dropout(dropout_rate, dropout_key)
    segment_ids = check_segment_ids(segment_ids, b, t)
    if kv_segment_ids is None and segment_ids is not None and t != s:
        raise ValueError(f"segment_ids has the queries' length t = {t}; with keys of another length s = {s} "
                         f"pass kv_segment_ids [batch, s] too")
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too")
    kv_segment_ids = segment_ids if kv_segment_ids is None else check_segment_ids(kv_segment_ids, b, s,
                                                                                   "kv_segment_ids")
    perm, kv_perm = layout_permutation(layout, t, n_hosts), layout_permutation(layout, s, n_hosts)
    k, v = mark_bad_keys(k, v)  # a key holding a nan/inf: NaN for whoever sees it, nothing for the rest
    q_l = np.asarray(q, np.float64)[:, perm]  # layout order
    k_l, v_l = k[:, kv_perm], v[:, kv_perm]
    seg_l = None if segment_ids is None else np.asarray(segment_ids)[:, perm]
    kv_seg_l = None if kv_segment_ids is None else np.asarray(kv_segment_ids)[:, kv_perm]
    q_pos_l = perm + (s - t)  # true positions of the queries in layout order: the last t
    problem = RingProblem(
        n_hosts=n_hosts, shard=c, perm=perm, layout_name=layout if isinstance(layout, str) else "custom", hop=hop,
        bias=None if check_bias(bias, b, h, t, s) is None else np.asarray(bias, np.float64),
        itemsize=np.dtype(q.dtype).itemsize, dropout=None if seed is None else (seed, rate),
        kv_perm=kv_perm, kv_shard=c_kv, q_offset=s - t,
        block_mask=None if hop.mask_fn is None else block_mask(
            hop.mask_fn, q_pos_l, kv_perm, n_hosts=n_hosts, block_q=hop.block_q, block_kv=hop.block_kv, heads=h,
            q_seg=seg_l, k_seg=kv_seg_l, causal=hop.causal, window=hop.window))
    hosts = []
    for r in range(n_hosts):
        sl, kv_sl = slice(r * c, (r + 1) * c), slice(r * c_kv, (r + 1) * c_kv)
        qs = QShard(q_l[:, sl], q_pos_l[None, sl], None if seg_l is None else seg_l[:, sl])  # pos (1, c)
        kv = KVShard(k_l[:, kv_sl], v_l[:, kv_sl], kv_perm[None, kv_sl],
                     None if kv_seg_l is None else kv_seg_l[:, kv_sl])
        hosts.append(Host(my_idx=r, qs=qs, held=Message(kv_idx=r, kv=kv)))
    return problem, hosts


def hop_kv(host, problem):
    """The K/V shard the host attends this step, with the bias block of its queries and these keys."""
    kv = host.held.kv
    return kv._replace(bias=bias_tile(problem.bias, host.qs.pos - problem.q_offset, kv.pos))  # bias rows: query index


def hop_is_empty(host, problem, step):
    """Whether host's hop at ``step`` has no visible pair: by position bounds (``masks.tile_is_empty``: a
    hop is a tile) or, with a ``mask_fn``, by the block mask."""
    qs, kv, hop = host.qs, host.held.kv, problem.hop
    if tile_is_empty(qs.pos, kv.pos, qs.seg, kv.seg, causal=hop.causal, window=hop.window):
        return True
    return problem.block_mask is not None and not problem.block_mask.hops[host.my_idx, step]


def hop_kinds(host, problem):
    """The tile kinds of the host's queries against the K/V shard it holds (``BlockMask.tiles``), or None."""
    bm = problem.block_mask
    return None if bm is None else bm.tiles[host.my_idx, host.held.kv_idx]


def send_to_next(hosts):
    """Every host sends the message it holds to host ``my_idx + 1`` (into its receive buffer)."""
    n = len(hosts)
    for host in hosts:
        hosts[(host.my_idx + 1) % n].recv = host.held


def swap_buffers(hosts):
    """After the step: the received message becomes the held one; the receive buffer is freed."""
    for host in hosts:
        host.held, host.recv = host.recv, None


def ring_forward(q, k, v, *, n_hosts, causal=False, segment_ids=None, bias=None, window=None,
                 scale=None, layout="contiguous", block_q=None, block_kv=None, dropout_rate=0.0,
                 dropout_key=None, logit_softcap=None, mask_fn=None, score_fn=None, kv_segment_ids=None):
    """The ring forward pass; returns ``(o, lse, trace)`` with o, lse in the caller's order.

    o: [b, t, h, d_v]; lse: [b, h, t]. Arguments as in :func:`ring_attention`.
    """
    problem, hosts = setup_ring(q, k, v, n_hosts=n_hosts, causal=causal, segment_ids=segment_ids,
                                bias=bias, window=window, scale=scale, layout=layout,
                                block_q=block_q, block_kv=block_kv, dropout_rate=dropout_rate,
                                dropout_key=dropout_key, logit_softcap=logit_softcap, mask_fn=mask_fn,
                                score_fn=score_fn, kv_segment_ids=kv_segment_ids, cross_attention=True)
    n, c, hop = problem.n_hosts, problem.shard, problem.hop
    b, _, h, d = hosts[0].qs.q.shape
    d_v = hosts[0].held.kv.v.shape[-1]
    n_tiles = (c // hop.block_q) * (problem.kv_shard // hop.block_kv)
    tile_flops = 2 * b * h * hop.block_q * hop.block_kv * (d + d_v)  # Q K^T and P V
    tile_elements = b * h * hop.block_q * hop.block_kv
    shape = (n, n)  # (n_hosts, n_steps)
    kv_idx, computed, skipped = (np.zeros(shape, np.int64) for _ in range(3))
    hop_skipped = np.zeros(shape, bool)
    bytes_sent, meta_sent = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    peak = np.zeros(n, np.int64)

    for host in hosts:
        host.m, host.l, host.o = init_state(b, h, c, d_v)  # o as wide as v
    for step in range(n):
        if step < n - 1:  # post the sends first: on hardware they overlap this step's compute
            send_to_next(hosts)
        for host in hosts:
            i = host.my_idx
            kv_idx[i, step] = host.held.kv_idx
            assert host.held.kv_idx == (i - step) % n  # the authors' index arithmetic
            if step < n - 1:
                bytes_sent[i, step] = host.held.payload_elements() * problem.itemsize
                meta_sent[i, step] = host.held.meta_bytes()
            peak[i] = max(peak[i], host.live_elements(tile_elements) * problem.itemsize)
            if hop_is_empty(host, problem, step):
                hop_skipped[i, step], skipped[i, step] = True, n_tiles
                continue
            computed[i, step], skipped[i, step] = attend_kv_shard(
                (host.m, host.l, host.o), host.qs, hop_kv(host, problem), hop, dropout=problem.dropout,
                kinds=hop_kinds(host, problem))
        if step < n - 1:
            swap_buffers(hosts)

    outs = [finalize(host.m, host.l, host.o) for host in hosts]
    inverse = np.argsort(problem.perm)
    o = np.concatenate([o for o, _ in outs], axis=1)[:, inverse]  # (b, t, h, d_v) caller's order
    lse = np.concatenate([lse for _, lse in outs], axis=2)[:, :, inverse]  # (b, h, t)
    trace = RingTrace(n_hosts=n, layout=problem.layout_name, block_q=hop.block_q, block_kv=hop.block_kv,
                      kv_idx=kv_idx, tiles_computed=computed, tiles_skipped=skipped, hop_skipped=hop_skipped,
                      flops=computed.astype(np.float64) * tile_flops, bytes_sent=bytes_sent,
                      meta_bytes_sent=meta_sent, peak_bytes=peak, block_mask=problem.block_mask)
    return o, lse, trace


def ring_attention(q, k, v, *, n_hosts, causal=False, segment_ids=None, bias=None, window=None,
                   scale=None, layout="contiguous", block_q=None, block_kv=None, return_trace=False,
                   dropout_rate=0.0, dropout_key=None, logit_softcap=None, mask_fn=None, score_fn=None,
                   kv_segment_ids=None):
    """Attention computed by ``n_hosts`` simulated hosts passing K/V around a ring.

    q: [batch, t, heads, dim]; k: [batch, s, kv_heads, dim]; v: [batch, s, kv_heads, dim_v]; all in the
    caller's (true) order; ``t != s`` is cross-attention, the queries being the last t positions. The
    mask arguments are those of :func:`ringattn_ref.attention` (segment_ids [batch, t], kv_segment_ids
    [batch, s], default segment_ids when ``t == s``; bias ``[b|1, h|1, t|1, s|1]``). ``layout``:
    ``"contiguous"``, ``"striped"``, ``"zigzag"`` or a permutation array (``layouts.py``; ``t == s`` only),
    applied to queries and keys each on its own; t and s must be divisible by ``n_hosts`` (``2 * n_hosts``
    for zigzag). ``block_q`` must divide the query shard ``t / n_hosts``, ``block_kv`` the K/V shard
    ``s / n_hosts``; default: the largest divisor ``<= 128``. ``dropout_rate`` / ``dropout_key``: attention
    dropout as in :func:`ringattn_ref.attention` (the same mask, for every ring size, layout and block
    size: ``dropout.py``). ``logit_softcap``: ``c * tanh(s / c)`` on the scaled logits (Gemma 2);
    ``mask_fn`` / ``score_fn``: functions of true positions (``variants.py``), called per tile; the hops and
    tiles a ``mask_fn`` leaves empty are skipped (``block_mask.py``; the trace counts them).
    Returns o [batch, t, heads, dim_v] float64, and a :class:`RingTrace` if ``return_trace``.
    """
    o, _, trace = ring_forward(q, k, v, n_hosts=n_hosts, causal=causal, segment_ids=segment_ids,
                               bias=bias, window=window, scale=scale, layout=layout,
                               block_q=block_q, block_kv=block_kv, dropout_rate=dropout_rate,
                               dropout_key=dropout_key, logit_softcap=logit_softcap, mask_fn=mask_fn,
                               score_fn=score_fn, kv_segment_ids=kv_segment_ids)
    return (o, trace) if return_trace else o
