"""The ring's two alternatives for sequence parallelism, simulated on ``n_hosts`` virtual hosts.

Both start where the ring starts (``ring.setup_ring``): host ``my_idx`` holds layout shard ``my_idx``
of q, k, v (``c = seq / N`` tokens, all heads) and must end with its shard of the output.

- **All-gather** (Llama 3's context parallelism): every host gathers the K/V of the whole sequence
  (a ring all-gather: ``N - 1`` rounds, each host forwards the shard it received last), then attends
  its own queries to all of it, in one blockwise pass. Same bytes as the ring's forward, but the K/V
  of all ``S`` tokens sit on every host: memory grows with ``S``.
- **Ulysses** (DeepSpeed-Ulysses, arXiv:2309.14509): an all-to-all swaps the sequence split for a
  head split -- host ``j`` receives, from every host, the q/k/v of its heads group ``j``
  (``heads / N`` query heads) -- then attends over the full sequence on its heads, and a second
  all-to-all sends each host its tokens back. Needs ``heads % N == 0``. With GQA the kv heads are
  split as ``ringattn_fast.ulysses_attention`` splits them (:func:`kv_repeat`): ``kv_heads / N`` each
  when ``kv_heads`` is a multiple of ``N``; otherwise each kv head is first repeated
  ``N / gcd(kv_heads, N)`` times, so every host receives ``lcm(kv_heads, N) / N`` (whole groups of its
  query heads, some kv heads on several hosts). The simulation sends what the compiled program sends,
  so the cost model (``strategy_cost``) prices the code that runs, and the hybrid at ring size 1 is
  this Ulysses byte for byte.

Each returns a :class:`StrategyTrace` like the ring's :class:`~ringattn_ref.ring.RingTrace`: bytes
sent per host per step, the steps, peak live bytes per host.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from .blockwise import attend_kv_shard, bias_tile
from .ring import setup_ring
from .shards import KVShard, QShard
from .softmax import finalize, init_state


@dataclass(frozen=True)
class StrategyTrace:
    """What each host sent and held at each step of a sequence-parallel strategy.

    - strategy: ``"allgather"``, ``"ulysses"`` or ``"hybrid"``; steps: one name per step (``"gather 1"``,
      ..., ``"attend"``; ``"all-to-all qkv"``, ``"attend"``, ``"all-to-all o"``; ``"all-to-all qkv"``,
      ``"ring 1"``, ..., ``"ring R"``, ``"all-to-all o"``);
    - bytes_sent (int) ``[n_hosts, n_steps]``: float bytes (q/k/v/o) each host sent at that step
      (positions and segment ids are not counted, as in ``RingTrace.bytes_sent``);
    - flops (float) ``[n_hosts, n_steps]``: ``4 * batch * heads * block_q * block_kv * dim`` per
      computed tile;
    - peak_bytes (int) ``[n_hosts]``: peak live float bytes (see each strategy for what is counted);
    - ulysses_size, ring_size: the split of ``"hybrid"`` (``hybrid.hybrid_attention``), else None.
    """
    strategy: str
    n_hosts: int
    steps: tuple
    bytes_sent: np.ndarray
    flops: np.ndarray
    peak_bytes: np.ndarray
    ulysses_size: int | None = None
    ring_size: int | None = None

    @property
    def n_steps(self):
        return len(self.steps)

    def total_bytes_sent(self):
        """Bytes each host sent over the whole pass, [n_hosts]."""
        return self.bytes_sent.sum(axis=1)


def _caller_order(problem, shards, axis):
    """Concatenate per-host results (layout order) and undo the layout permutation."""
    return np.take(np.concatenate(shards, axis=axis), np.argsort(problem.perm), axis=axis)


def _attend(qs, kv, problem, bias):
    """One blockwise pass (``blockwise.attend_kv_shard``) from a fresh state: ``(o, lse, computed)``;
    ``bias``: the full bias in true order (its block for these queries and keys is taken here)."""
    b, sq, h, d = qs.q.shape
    state = init_state(b, h, sq, d)
    kv = kv._replace(bias=bias_tile(bias, qs.pos, kv.pos))
    computed, _ = attend_kv_shard(state, qs, kv, problem.hop)
    o, lse = finalize(*state)
    return o, lse, computed


def allgather_attention(q, k, v, *, n_hosts, causal=False, segment_ids=None, bias=None, window=None,
                        scale=None, layout="contiguous", block_q=None, block_kv=None, return_trace=False):
    """Attention by all-gathering K/V on ``n_hosts`` simulated hosts (Llama 3 context parallelism).

    Arguments as in :func:`ringattn_ref.ring_attention` (q: [batch, seq, heads, dim]; k, v:
    [batch, seq, kv_heads, dim]; masks, layout, tile sides). Steps ``0 .. N-2`` are the ring
    all-gather: at step ``s`` host ``i`` forwards the shard ``(i - s) % N`` it got last (its own at
    step 0); the last step attends. Peak per host: q shard, the K/V of all ``S`` tokens, o, m, l and
    one score tile. Returns o [batch, seq, heads, dim] float64 (and the trace if ``return_trace``).
    """
    problem, hosts = setup_ring(q, k, v, n_hosts=n_hosts, causal=causal, segment_ids=segment_ids, bias=bias,
                                window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv)
    n, e, hop = problem.n_hosts, problem.itemsize, problem.hop
    b, c, h, d = hosts[0].qs.q.shape
    bytes_sent, flops = np.zeros((n, n), np.int64), np.zeros((n, n))
    gathered = [[host.held] for host in hosts]  # the K/V shards (messages) each host holds so far
    for step in range(n - 1):  # the ring all-gather: each host forwards what arrived last
        outgoing = [blocks[-1] for blocks in gathered]  # all sends of a step happen at once
        for host in hosts:
            assert outgoing[host.my_idx].kv_idx == (host.my_idx - step) % n  # the ring's index arithmetic
            bytes_sent[host.my_idx, step] = outgoing[host.my_idx].payload_elements() * e
            gathered[(host.my_idx + 1) % n].append(outgoing[host.my_idx])  # to the next host
    tile_flops = 4 * b * h * hop.block_q * hop.block_kv * d
    outs, peak = [], np.zeros(n, np.int64)
    for host in hosts:
        shards = [msg.kv for msg in sorted(gathered[host.my_idx], key=lambda msg: msg.kv_idx)]  # all N shards
        assert sorted(msg.kv_idx for msg in gathered[host.my_idx]) == list(range(n))
        cat = lambda name: np.concatenate([getattr(kv, name) for kv in shards], axis=1)  # noqa: E731
        kv_all = KVShard(cat("k"), cat("v"), cat("pos"), None if host.qs.seg is None else cat("seg"))  # (1, S) positions
        o, lse, computed = _attend(host.qs, kv_all, problem, problem.bias)
        flops[host.my_idx, n - 1] = computed * tile_flops
        tile = b * h * hop.block_q * hop.block_kv
        peak[host.my_idx] = (host.qs.q.size + kv_all.k.size + kv_all.v.size + o.size + 2 * lse.size + tile) * e
        outs.append((o, lse))
    o = _caller_order(problem, [o for o, _ in outs], axis=1)  # (b, s, h, d)
    trace = StrategyTrace("allgather", n, tuple(f"gather {s + 1}" for s in range(n - 1)) + ("attend",),
                          bytes_sent, flops, peak)
    return (o, trace) if return_trace else o


def kv_repeat(kv_heads, n_hosts):
    """How often each kv head is repeated before Ulysses's all-to-all over ``n_hosts``: ``N / gcd(kv_heads,
    N)`` (1 when ``kv_heads`` is a multiple of ``N``). Each host then receives ``kv_heads * kv_repeat / N``
    kv heads (``lcm(kv_heads, N) / N``), which divides its ``heads / N`` query heads: the tiled all-to-all
    of ``ringattn_fast`` needs equal parts, and every query head must find its kv head on its host."""
    return n_hosts // gcd(kv_heads, n_hosts)


def ulysses_heads(heads, kv_heads, n_hosts, j):
    """Host ``j``'s query heads and its kv heads, as ``(slice(q), slice(kv))``; the kv slice indexes the
    kv heads as sent, each repeated :func:`kv_repeat` times (copy ``i * rep + a`` is kv head ``i``).

    Query heads are cut into ``N`` contiguous groups of ``heads / N``; query head ``t`` uses kv head
    ``t // (heads // kv_heads)`` (``attention.repeat_kv``), i.e. copy ``t // (heads // (kv_heads * rep))``.
    Example: 8 heads, 2 kv heads, 4 hosts: each kv head twice; host 1 gets query heads 2, 3 and copy 1
    (kv head 0), host 2 gets 4, 5 and copy 2 (kv head 1). 12 heads, 3 kv heads, 4 hosts: each kv head 4
    times, host 1 gets query heads 3, 4, 5 and copies 3, 4, 5 (kv heads 0, 1, 1).
    """
    hq, hk_sent = heads // n_hosts, kv_heads * kv_repeat(kv_heads, n_hosts)
    per_host = hk_sent // n_hosts
    return slice(j * hq, (j + 1) * hq), slice(j * per_host, (j + 1) * per_host)


def ulysses_attention(q, k, v, *, n_hosts, causal=False, segment_ids=None, bias=None, window=None,
                      scale=None, layout="contiguous", block_q=None, block_kv=None, return_trace=False):
    """Attention by DeepSpeed-Ulysses on ``n_hosts`` simulated hosts: sequence -> heads -> sequence.

    Arguments as in :func:`ringattn_ref.ring_attention`; ``heads`` must be divisible by ``n_hosts``.
    Step 0, all-to-all: host ``i`` sends host ``j`` its ``c`` tokens of q on heads group ``j`` and
    of k, v on the kv heads that group uses, repeated as :func:`kv_repeat` says (:func:`ulysses_heads`). Step 1: host ``j`` attends
    over all ``S`` tokens (layout order, true positions) on its ``heads / N`` heads. Step 2,
    all-to-all back: host ``j`` sends host ``i`` the output of ``i``'s tokens on group ``j``.
    Peak per host: the largest of (inputs + received q/k/v), (received q/k/v + o, m, l, one score
    tile), (o of all tokens + the received output shard); on one host (no all-to-all) only the middle
    one, as the ring's and the hybrid's. Returns o [batch, seq, heads, dim] float64
    (and the trace if ``return_trace``).
    """
    problem, hosts = setup_ring(q, k, v, n_hosts=n_hosts, causal=causal, segment_ids=segment_ids, bias=bias,
                                window=window, scale=scale, layout=layout, block_q=block_q, block_kv=block_kv)
    n, e, hop = problem.n_hosts, problem.itemsize, problem.hop
    b, c, h, d = hosts[0].qs.q.shape
    hk = hosts[0].held.kv.k.shape[2]
    if h % n:
        raise ValueError(f"ulysses_attention splits the heads over the hosts: heads ({h}) must be divisible "
                         f"by n_hosts ({n}); got q {tuple(q.shape)}")
    heads, rep = [ulysses_heads(h, hk, n, j) for j in range(n)], kv_repeat(hk, n)
    sent = [(hst.held.kv.k.repeat(rep, axis=2), hst.held.kv.v.repeat(rep, axis=2)) for hst in hosts]  # as sent
    bytes_sent, flops, peak = np.zeros((n, 3), np.int64), np.zeros((n, 3)), np.zeros(n, np.int64)
    pos = problem.perm[None]  # (1, S) true positions in layout order
    seg = None if hosts[0].qs.seg is None else np.concatenate([hst.qs.seg for hst in hosts], axis=1)
    o_heads = []  # o_heads[j]: host j's output, all S tokens on its heads, (b, S, h/N, d)
    for j, (qh, kvh) in enumerate(heads):
        # step 0: host j receives from every host i its tokens on j's heads (its own part stays)
        q_j = np.concatenate([hst.qs.q[:, :, qh] for hst in hosts], axis=1)  # (b, S, h/N, d)
        k_j, v_j = (np.concatenate([kv[a][:, :, kvh] for kv in sent], axis=1)
                    for a in (0, 1))  # (b, S, kv heads of group j, d): whole groups of its query heads
        for i, hst in enumerate(hosts):
            if i != j:
                bytes_sent[i, 0] += (hst.qs.q[:, :, qh].size + 2 * sent[i][0][:, :, kvh].size) * e
        bias_j = problem.bias
        if bias_j is not None and bias_j.shape[1] > 1:
            bias_j = bias_j[:, qh]  # (b|1, h/N, s|1, s|1): this group's heads
        # step 1: full-sequence attention on h/N heads
        o_j, lse_j, computed = _attend(QShard(q_j, pos, seg), KVShard(k_j, v_j, pos, seg), problem, bias_j)
        flops[j, 1] = computed * 4 * b * q_j.shape[2] * hop.block_q * hop.block_kv * d
        tile = b * q_j.shape[2] * hop.block_q * hop.block_kv
        inputs = hosts[j].qs.q.size + hosts[j].held.payload_elements()  # the repeated copies: views, not counted
        received = q_j.size + k_j.size + v_j.size
        peak[j] = (received + o_j.size + 2 * lse_j.size + tile) * e
        if n > 1:  # the all-to-alls: inputs and what arrived; o and the output shard that arrived
            peak[j] = max(peak[j], (inputs + received) * e, (o_j.size + b * c * h * d) * e)
        bytes_sent[j, 2] = (n - 1) * b * c * q_j.shape[2] * d * e  # step 2: every other host's tokens
        o_heads.append(o_j)
    shards = [np.concatenate([o_j[:, i * c:(i + 1) * c] for o_j in o_heads], axis=2)  # (b, c, h, d)
              for i in range(n)]
    o = _caller_order(problem, shards, axis=1)  # (b, s, h, d)
    trace = StrategyTrace("ulysses", n, ("all-to-all qkv", "attend", "all-to-all o"), bytes_sent, flops, peak)
    return (o, trace) if return_trace else o
