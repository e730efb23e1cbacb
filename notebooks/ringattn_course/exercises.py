"""Self-checks for the exercises of the notebook course (``notebooks/NN_*.md``, 00-15).

Each ``check_*`` takes the learner's answer (a number or a function). While the answer is still the
placeholder ``None`` it prints a reminder and returns ``False``, so a notebook runs top to bottom
before anyone has attempted it. A wrong answer raises ``AssertionError`` with a hint; a right one
prints ``Correct`` and returns ``True``. The expected values come from the library (the oracle
``attention``, the ring simulation, the cost model, the kernels' tile predicate, the fused kernel's
ring rules), never from a hard-coded result, so the checks stay true if the library's numbers change.

The checks are grouped by notebook: 00-06 and 15 use ``ringattn_ref`` (numpy), 07-14 ``ringattn_fast``
(JAX; imported inside those checks, so the numpy notebooks' checks never load a kernel). The
predict-then-measure checks (05-15, each notebook's last exercise) measure what they compare with:
a ring's gradients, a kernel's own tile counter, the scratch a ``pallas_call`` declares, the
collectives of a compiled program (``ringattn_course.hlo.collective_messages``), the hops a mask
function's block mask leaves empty (``ringattn_ref.ring_block_mask``), or a layout's critical path
(``ringattn_ref.balance``).

``tests/test_exercises.py`` runs every check against the hidden answer written in the notebook and
against a wrong answer.
"""
from __future__ import annotations

import math

import numpy as np

from ringattn_ref import cost
from ringattn_ref.attention import attention
from ringattn_ref.layouts import layout_permutation
from ringattn_ref.ring import ring_attention
from ringattn_ref.softmax import init_state, online_update


def _pending(answer, what):
    if answer is None:
        print(f"Exercise not attempted yet: {what}")
        return True
    return False


def _correct(msg=""):
    print("Correct" + (f": {msg}" if msg else "."))
    return True


def _close(got, want, rel, what):
    got = float(got)
    if not math.isclose(got, want, rel_tol=rel):
        raise AssertionError(f"{what}: got {got:.6g}, expected about {want:.6g}")


def _as_int(x, what):
    """``x`` as an int, or AssertionError if it is not an integral number."""
    try:
        value = float(np.asarray(x).item())
    except (TypeError, ValueError) as err:
        raise AssertionError(f"{what} must be a single integer; got {x!r}") from err
    if not value.is_integer():
        raise AssertionError(f"{what} must be an integer; got {x!r}")
    return int(value)


def _problem(seed, batch=1, seq=16, heads=2, kv_heads=2, dim=4):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, heads, dim))
    k = rng.standard_normal((batch, seq, kv_heads, dim))
    v = rng.standard_normal((batch, seq, kv_heads, dim))
    return q, k, v


# ---- 00 plain attention and the memory wall --------------------------------------------------------

def check_scores_gib(answer):
    """00, exercise 1: GiB of vanilla attention's scores, batch 1, 32 heads, seq 131072, bf16."""
    if _pending(answer, "GiB of the score matrix at seq = 128K"):
        return False
    attn, _ = cost.activation_bytes("vanilla", batch=1, seq=131072, hidden=4096, heads=32, shard=1)
    _close(answer, attn / 2**30, 1e-6, "score matrix in GiB (Table 1: 2bns^2 bytes, 1 GiB = 2^30 B)")
    return _correct(f"{attn / 2**30:.0f} GiB for one layer's scores")


def check_longest_vanilla_seq(answer):
    """00, exercise 2: the longest power-of-two seq whose vanilla activation fits in 80e9 bytes."""
    if _pending(answer, "longest power-of-two sequence for vanilla attention in 80 GB"):
        return False
    fits = [2**p for p in range(8, 30) if max(cost.activation_bytes(
        "vanilla", batch=1, seq=2**p, hidden=4096, heads=32, shard=1)) <= 80e9]
    want = max(fits)
    if int(answer) != want:
        raise AssertionError(f"got {answer}; check max(attention, ffn) bytes <= 80e9 for each "
                             f"power of two (hint: the answer is between {want // 4} and {want * 4})")
    return _correct(f"seq = {want}; twice that needs {max(cost.activation_bytes('vanilla', batch=1, seq=2 * want, hidden=4096, heads=32, shard=1)) / 1e9:.0f} GB")


def check_host_flops_ratio(answer, *, shard=4096, seqs=(131072, 1048576)):
    """00, exercise 3: a ring of hosts with ``shard`` tokens each grows from 128K to 1M tokens (more
    hosts, same shard length). How many times more attention FLOPs does *each host* do at 1M?"""
    if _pending(answer, "per-host FLOPs at 1M tokens / at 128K tokens"):
        return False
    per_host = [seq // shard * cost.step_flops(shard, 128, heads=32) for seq in seqs]  # N steps of 4dc^2
    want = per_host[1] / per_host[0]
    _close(answer, want, 1e-12, "each host runs N = s / c ring steps of 4 d c^2 FLOPs per head")
    return _correct(f"{want:g}x: memory per host is flat in s, compute per host grows linearly with s")


# ---- 01 online softmax -----------------------------------------------------------------------------

def check_merge_state(merge_state):
    """01, exercise 1: ``merge_state(m1, l1, o1, m2, l2, o2) -> (m, l, o)`` on *unnormalised* states.

    m, l: [b, h, q]; o: [b, q, h, d] unnormalised (``o = sum_j exp(s_j - m) v_j``). The merged
    state, finalised as ``o / l``, must equal attention over the union of the two key sets.
    """
    if _pending(merge_state, "merge_state(m1, l1, o1, m2, l2, o2)"):
        return False
    q, k, v = _problem(1, seq=12)
    q = q * 30.0  # large logits: a merge that forgets the max overflows or loses precision
    scale = q.shape[-1] ** -0.5
    logits = scale * np.einsum("bqhd,bkhd->bhqk", q, k)  # (b, h, q, k)
    states = []
    for sl in (slice(0, 5), slice(5, 12)):
        m, l, o = init_state(1, 2, 12, 4)
        states.append(online_update(m, l, o, logits[..., sl], v[:, sl]))
    m, l, o = merge_state(*states[0], *states[1])
    got = o / np.transpose(l, (0, 2, 1))[..., None]
    err = np.abs(got - attention(q, k, v)).max()
    if not err < 1e-12:
        raise AssertionError(f"merged state finalises to an error of {err:.3g} vs attention; "
                             "rescale each side by exp(m_i - m) with m = max(m1, m2)")
    return _correct(f"max error vs attention {err:.1e}")


def check_lse_of_large_logits(answer):
    """01, exercise 2: ``lse`` of the logits ``[1000, 1000, 1000, 1000]``, computed by hand."""
    if _pending(answer, "log-sum-exp of four logits equal to 1000"):
        return False
    want = float(np.logaddexp.reduce(np.full(4, 1000.0)))
    _close(answer, want, 1e-12, "lse = m + log(sum exp(s - m))")
    return _correct(f"lse = 1000 + log 4 = {want:.6f}")


def check_merged_lse(answer):
    """01, exercise 3: the lse of the union of two disjoint key sets whose partial lse are 2 and 3."""
    if _pending(answer, "lse of the merged partial results"):
        return False
    keys = np.array([2.0, 3.0])  # one key per partial result: its lse is its logit
    want = float(np.logaddexp.reduce(keys))
    _close(answer, want, 1e-12, "lse = log(e^lse1 + e^lse2), computed stably")
    return _correct(f"lse = {want:.6f} = 3 + log(1 + e^-1)")


# ---- 02 blockwise attention and blockwise feedforward ----------------------------------------------

def check_kv_outer_blockwise(kv_outer_attention):
    """02, exercise 1: ``kv_outer_attention(q, k, v, block_kv) -> o`` with the K/V loop outermost.

    This is the loop order of a ring host: for each K/V shard, update (m, l, o) of *all* queries.
    """
    if _pending(kv_outer_attention, "kv_outer_attention(q, k, v, block_kv)"):
        return False
    for seed, block in ((2, 4), (3, 2), (4, 16)):
        q, k, v = _problem(seed, seq=16)
        err = np.abs(kv_outer_attention(q, k, v, block) - attention(q, k, v)).max()
        if not err < 1e-12:
            raise AssertionError(f"block_kv={block}: max error {err:.3g} vs attention")
    return _correct("equal to attention for block_kv in (4, 2, 16)")


def _ffn_peak_elements(batch, seq, hidden, ffn_hidden, block):
    """The largest intermediate activation ``max(0, x W1 + b1)`` one call of the FFN builds when
    ``ringattn_ref.blockwise_feedforward`` runs it ``block`` tokens at a time: measured by handing the
    library a stand-in FFN that builds that activation (``[..., ffn_hidden]`` for the tokens it is given)
    and records its size (int8 and a broadcast input, so the measurement itself is small)."""
    from ringattn_ref.feedforward import blockwise_feedforward

    sizes = []

    def ffn(x):  # position-wise, as the real FFN: one hidden row of ffn_hidden per token
        sizes.append(np.zeros(x.shape[:-1] + (ffn_hidden,), np.int8).size)
        return x

    blockwise_feedforward(ffn, np.broadcast_to(np.int8(0), (batch, seq, hidden)), block)
    return max(sizes), len(sizes)


def check_ffn_peak_elements(answer, *, batch=2, seq=4096, hidden=256, ffn_hidden=1024, block=512):
    """02, exercise 2: intermediate FFN elements alive at once, blockwise, for the notebook's sizes
    (batch 2, seq 4096, hidden 256, ffn_hidden 1024 (4x), block 512), measured on the library's
    ``blockwise_feedforward`` (:func:`_ffn_peak_elements`)."""
    if _pending(answer, "peak intermediate elements of the blockwise FFN"):
        return False
    want, calls = _ffn_peak_elements(batch, seq, hidden, ffn_hidden, block)
    whole, _ = _ffn_peak_elements(batch, seq, hidden, ffn_hidden, seq)
    if _as_int(answer, "the number of elements") != want:
        raise AssertionError(f"got {answer}; the hidden activation max(0, x W1 + b1) of one block "
                             "is alive at a time: [batch, block, ffn_hidden]")
    return _correct(f"{want} elements in each of {calls} calls, {whole // want}x fewer than the whole sequence's")


def check_score_tile_elements(answer, *, batch=2, heads=4, block_q=128, block_kv=256):
    """02, exercise 3: score elements one blockwise tile holds (batch 2, 4 heads, 128 x 256 tile)."""
    if _pending(answer, "elements of one score tile"):
        return False
    want = batch * heads * block_q * block_kv  # logits [b, h, block_q, block_kv]
    if _as_int(answer, "the number of elements") != want:
        raise AssertionError(f"got {answer}; the tile's logits are [batch, heads, block_q, block_kv]")
    return _correct(f"{want} elements, whatever the sequence length")


# ---- 03 the ring -----------------------------------------------------------------------------------

def check_kv_index_reverse(kv_index):
    """03, exercise 1: ``kv_index(my_idx, step, n_hosts)`` when K/V travel host i -> i - 1."""
    if _pending(kv_index, "kv_index(my_idx, step, n_hosts) for the reversed ring"):
        return False
    for n in range(1, 9):
        # Simulate the reversed ring: shard b sits on host b at step 0, moves to b - 1 each step.
        where = np.arange(n)  # where[b] = host holding shard b
        for step in range(n):
            for b_idx, host in enumerate(where):
                got = kv_index(int(host), step, n)
                if got != b_idx:
                    raise AssertionError(f"n_hosts={n}, step={step}: host {host} holds shard "
                                         f"{b_idx}, your kv_index says {got}")
            where = (where - 1) % n
    return _correct("(my_idx + step) % n_hosts")


def check_total_bytes_sent(total_bytes_sent):
    """03, exercise 2: ``total_bytes_sent(batch, seq, kv_heads, dim, n_hosts, itemsize)`` per host."""
    if _pending(total_bytes_sent, "total_bytes_sent(batch, seq, kv_heads, dim, n_hosts, itemsize)"):
        return False
    for n_hosts, kv_heads in ((1, 1), (2, 2), (4, 1), (8, 2)):
        q, k, v = _problem(5, batch=2, seq=32, heads=2, kv_heads=kv_heads, dim=4)
        _, trace = ring_attention(q, k, v, n_hosts=n_hosts, return_trace=True)
        want = trace.bytes_sent.sum(axis=1)  # (n_hosts,)
        got = total_bytes_sent(2, 32, kv_heads, 4, n_hosts, 8)
        if not np.all(want == got):
            raise AssertionError(f"n_hosts={n_hosts}, kv_heads={kv_heads}: the trace says "
                                 f"{int(want[0])} bytes per host, you say {got}")
    return _correct("(n_hosts - 1) sends of one K/V shard each")


def check_ring_time(answer, *, n_hosts=8, compute_us=10.0, transfer_us=15.0):
    """03, exercise 3: wall time of a forward ring of 8 hosts when a hop computes 10 us and a K/V
    send takes 15 us (same on every host), from ``ringattn_ref.gantt.ring_timeline``."""
    if _pending(answer, "wall time of the ring in microseconds"):
        return False
    from ringattn_ref.gantt import ring_timeline

    q, k, v = _problem(9, seq=4 * n_hosts, heads=1, kv_heads=1, dim=2)
    _, trace = ring_attention(q, k, v, n_hosts=n_hosts, return_trace=True)
    f = trace.flops[0, 0] / (compute_us * 1e-6)
    b = trace.bytes_sent[0, 0] / (transfer_us * 1e-6)
    want = ring_timeline(trace, f, b).total_s * 1e6
    _close(answer, want, 1e-9, "each step waits for the slower of compute and transfer; no send after the last")
    return _correct(f"{want:g} us = 7 x 15 + 10: the links set the pace")


# ---- 04 causal masking and load balance ------------------------------------------------------------

def check_contiguous_busy_hops(busy_hops):
    """04, exercise 1: ``busy_hops(n_hosts) -> int array [n_hosts]``: hops each host computes
    under a causal mask with the contiguous layout."""
    if _pending(busy_hops, "busy_hops(n_hosts)"):
        return False
    for n in (1, 2, 4, 8):
        q, k, v = _problem(6, seq=8 * n)
        _, trace = ring_attention(q, k, v, n_hosts=n, causal=True, return_trace=True)
        want = (~trace.hop_skipped).sum(axis=1)
        got = np.asarray(busy_hops(n))
        if got.shape != want.shape or not np.all(got == want):
            raise AssertionError(f"n_hosts={n}: the trace says {want.tolist()}, you say {got.tolist()}")
    return _correct("host r computes r + 1 hops: the last host works N times as long as the first")


def check_zigzag_owner(owner):
    """04, exercise 2: ``owner(pos, seq, n_hosts) -> host`` that owns true position ``pos`` (zigzag)."""
    if _pending(owner, "owner(pos, seq, n_hosts) for the zigzag layout"):
        return False
    for n, seq in ((1, 4), (2, 8), (4, 16), (4, 32), (8, 64)):
        perm = layout_permutation("zigzag", seq, n)
        shard = seq // n
        for layout_pos, pos in enumerate(perm):
            want = layout_pos // shard
            got = owner(int(pos), seq, n)
            if got != want:
                raise AssertionError(f"seq={seq}, n_hosts={n}: position {pos} is on host {want}, "
                                     f"you say {got}")
    return _correct("chunk j = pos // (seq / 2N) is on host min(j, 2N - 1 - j)")


def check_causal_imbalance(answer, *, n_hosts=8):
    """04, exercise 3: critical path / mean work per host of the causal contiguous ring, 8 hosts."""
    if _pending(answer, "critical path / mean work for the contiguous causal ring"):
        return False
    q, k, v = _problem(10, seq=4 * n_hosts, heads=1, kv_heads=1, dim=2)
    _, trace = ring_attention(q, k, v, n_hosts=n_hosts, causal=True, block_q=4, block_kv=4, return_trace=True)
    want = trace.critical_path() / trace.work_per_host().mean()
    _close(answer, want, 1e-9, "the critical path is N hops; host r computes r + 1 of them")
    return _correct(f"{want:.4f} = 2N / (N + 1): the ring runs almost twice as long as balanced work needs")


# ---- 05 the ring backward --------------------------------------------------------------------------

def check_delta(delta):
    """05, exercise 1: ``delta(o, do) -> D = rowsum(dO * O)`` with layout [b, h, q] (FA-2 Alg. 2)."""
    if _pending(delta, "delta(o, do)"):
        return False
    q, k, v = _problem(7, seq=8, heads=4, kv_heads=2)
    o = attention(q, k, v)
    do = np.random.default_rng(8).standard_normal(o.shape)
    want = np.einsum("bqhd,bqhd->bhq", do, o)
    got = np.asarray(delta(o, do))
    if got.shape != want.shape:
        raise AssertionError(f"D has shape {got.shape}; statistics are [batch, heads, seq] = {want.shape}")
    err = np.abs(got - want).max()
    if not err < 1e-12:
        raise AssertionError(f"max error {err:.3g}: D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]")
    return _correct()


def check_backward_bytes_ratio(answer):
    """05, exercise 2: bytes a host sends per backward step / per forward step, with K and V in
    bfloat16 and the dK, dV accumulators in float32 (as ``ringattn_fast.backward`` sends them).

    Measured from the two rings' traces (``ring_attention(..., return_trace=True)`` and
    ``ring_attention_vjp(..., return_trace=True)``), float16 inputs standing in for bfloat16 (same itemsize).
    """
    if _pending(answer, "backward / forward bytes per step"):
        return False
    from ringattn_ref.backward import ring_attention_vjp

    q, k, v = (x.astype(np.float16) for x in _problem(11, seq=8, heads=2, kv_heads=1, dim=4))
    _, fwd = ring_attention(q, k, v, n_hosts=2, return_trace=True)
    *_, bwd = ring_attention_vjp(q, k, v, np.ones(q.shape), n_hosts=2, return_trace=True)
    want = bwd.bytes_sent[0, 0] / fwd.bytes_sent[0, 0]
    _close(answer, want, 1e-12, "the backward sends K and V (2 bytes) plus dK and dV (4 bytes each)")
    return _correct(f"{want:g}x the forward's bytes per step")


def _backward_bound(hardware, **kwargs):
    """The shortest shard whose *backward* hop hides its send on ``hardware``: ``cost.min_block_size``
    (keywords: heads, kv_heads, fill) times the bytes / FLOPs ratio measured from the rings' traces
    (``ringattn_ref.backward_factors``, bf16)."""
    from ringattn_ref.backward import backward_factors

    hw = cost.HARDWARE[hardware]
    flops_ratio, bytes_ratio = backward_factors(2)
    return cost.min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, **kwargs) * bytes_ratio / flops_ratio


def check_backward_min_block(answer, *, hardware="A100 NVLink"):
    """05, exercise 3: the backward's minimal shard length ``c`` (tokens per host; the paper's "block
    size") on A100 + NVLink: FA-2's backward computes more FLOPs per tile and sends more bytes (float32
    dK/dV) than the forward, both ratios measured from the traces (:func:`_backward_bound`)."""
    if _pending(answer, "minimal block size for the backward ring"):
        return False
    want = _backward_bound(hardware)
    forward = cost.HARDWARE[hardware]
    f_b = cost.min_block_size(forward.flops_per_s, forward.bandwidth_bytes_per_s)
    _close(answer, want, 1e-3, "10 d c^2 / F >= 12 c d / B")
    return _correct(f"c >= {want:.0f} tokens: {want / f_b:g} F/B, the backward binds, not the forward")


def check_window_dk_blocks(dk_blocks, *, shard=8, window=(4, 0)):
    """05, exercise 4: ``dk_blocks(n_hosts)``: bool [host, shard], which K/V shards a host's queries
    contribute to under ``window=(4, 0)``, measured by linearity with ``ringattn_ref.ring_attention_vjp``."""
    if _pending(dk_blocks, "dk_blocks(n_hosts)"):
        return False
    from ringattn_ref.backward import ring_attention_vjp

    for n in (1, 2, 4, 5):
        q, k, v = _problem(12, seq=shard * n, heads=2, kv_heads=1)
        do = np.random.default_rng(13).standard_normal(q.shape)
        want = np.zeros((n, n), bool)
        for i in range(n):
            do_i = np.zeros_like(do)
            do_i[:, i * shard:(i + 1) * shard] = do[:, i * shard:(i + 1) * shard]  # host i's queries only
            _, dk, _ = ring_attention_vjp(q, k, v, do_i, n_hosts=n, window=window)
            want[i] = [np.abs(dk[:, j * shard:(j + 1) * shard]).max() > 0 for j in range(n)]
        got = np.asarray(dk_blocks(n))
        if got.shape != want.shape or got.dtype != bool or not np.array_equal(got, want):
            raise AssertionError(f"n_hosts={n}: host i's queries reach shards\n{want.astype(int)}\nyou predict\n"
                                 f"{np.asarray(got)} (a bool matrix [host, shard]; hint: how far back does "
                                 f"a host's first query see?)")
    return _correct("its own shard and its left neighbour's: two busy hops of N")


# ---- 06 overlap of communication and compute -------------------------------------------------------

def check_min_block(answer, flops_per_s=989e12, bandwidth_bytes_per_s=450e9):
    """06, exercise 1: minimal block size in bf16 for a host with 989 TFLOP/s and 450 GB/s links."""
    if _pending(answer, "minimal block size c for F = 989 TFLOP/s, B = 450 GB/s"):
        return False
    want = cost.min_block_size(flops_per_s, bandwidth_bytes_per_s)
    _close(answer, want, 1e-3, "c = F / B in tokens")
    return _correct(f"c >= {want:.0f} tokens, so s = 6c = {6 * want / 1e3:.1f}K tokens per host")


def check_min_block_float32(answer):
    """06, exercise 2: the same host, K/V sent in float32 (4 bytes) instead of bf16."""
    if _pending(answer, "minimal block size with float32 K/V"):
        return False
    want = cost.min_block_size(989e12, 450e9, dtype_bytes=4)
    _close(answer, want, 1e-3, "bytes per step double while FLOPs stay")
    return _correct(f"c >= {want:.0f}: twice the bf16 block")


def check_min_block_causal_gqa(answer):
    """06, exercise 3: minimal block for the causal diagonal hop (half its tiles) with GQA 32:8 on a
    host achieving 60% of 989 TFLOP/s and 80% of 450 GB/s, bf16 K/V."""
    if _pending(answer, "minimal block for the causal GQA hop at achieved rates"):
        return False
    want = cost.min_block_size(0.6 * 989e12, 0.8 * 450e9, heads=32, kv_heads=8, fill=0.5)
    _close(answer, want, 1e-3, "c >= (kv_heads / heads) x (1 / fill) x F_achieved / B_achieved")
    return _correct(f"c >= {want:.0f} tokens")


def check_hop_intensity(hop_intensity):
    """06, exercise 4: ``hop_intensity(c, dim, heads, kv_heads)``: FLOPs per HBM byte of a bf16
    FlashAttention hop, checked against ``ringattn_course.physics.attention_flops_bytes``."""
    if _pending(hop_intensity, "hop_intensity(c, dim, heads, kv_heads)"):
        return False
    from ringattn_course import physics

    for c, dim, heads, kv_heads in ((256, 128, 32, 8), (512, 128, 32, 8), (4096, 128, 1, 1), (64, 16, 4, 2),
                                    (1000, 64, 8, 8)):
        flops, hbm = physics.attention_flops_bytes(c, c, dim=dim, heads=heads, kv_heads=kv_heads)
        _close(hop_intensity(c, dim, heads, kv_heads), flops / hbm, 1e-9,
               f"c={c}, dim={dim}, heads={heads}, kv_heads={kv_heads} (hint: 4 h c^2 d FLOPs; q and o on h heads, "
               f"k and v on hk heads, 2 bytes each, read or written once)")
    v5e = physics.CHIPS["TPU v5e"]
    verdict = {c: physics.bound(*physics.attention_flops_bytes(c, c, dim=128, heads=32, kv_heads=8), v5e)
               for c in (256, 512)}
    return _correct(f"h c / (h + hk); on TPU v5e c = 256 is {verdict[256]}-bound, c = 512 {verdict[512]}-bound")



# A made-up schedule for check_exposed_transfers: hidden behind a kernel, behind a loop, behind other compute;
# exposed with only other work between, with nothing between, and a synchronous (unsplit) one.
_SCHEDULE_DRILL = [
    dict(kind="start", id="a", sends="bf16[8]", bytes=16, backward=False, hidden=True),
    dict(kind="start", id="b", sends="bf16[8]", bytes=16, backward=False, hidden=False),
    dict(kind="done", id="b"),
    dict(kind="kernel", name="hop"),
    dict(kind="done", id="a"),
    dict(kind="start", id="c", sends="f32[8]", bytes=32, backward=True, hidden=False),
    dict(kind="other", ops=3),
    dict(kind="done", id="c"),
    dict(kind="start", id="d", sends="f32[8]", bytes=32, backward=True, hidden=True),
    dict(kind="loop", name="while", body="body", backward=True),
    dict(kind="start", id="e", sends="f32[8]", bytes=32, backward=True, hidden=False, synchronous=True),
    dict(kind="done", id="e"),
    dict(kind="done", id="d"),
    dict(kind="start", id="f", sends="s32[8]", bytes=32, backward=True, hidden=True),
    dict(kind="compute", name="dot", op="dot"),
    dict(kind="done", id="f"),
]


def check_exposed_transfers(exposed_transfers):
    """06, exercise 5: ``exposed_transfers(events) -> positions`` in ``events`` (one computation's schedule,
    without the ``hidden`` flags) of the ``start`` events whose transfer no kernel, loop or other compute
    overlaps. Checked on a made-up schedule and on every computation of the two saved v5e schedules, against
    the flags ``benchmarks/overlap.py`` read from the compiled HLO (``ringattn_course.schedules``)."""
    if _pending(exposed_transfers, "exposed_transfers(events)"):
        return False
    from ringattn_course import schedules

    cases = [("a made-up schedule", _SCHEDULE_DRILL)]
    cases += [(f"the {name} schedule's {c['role']}", c["events"]) for name in schedules.SAVED
              for c in schedules.load(name)["computations"]]
    for what, events in cases:
        want = [i for i, e in enumerate(events) if e["kind"] == "start" and not e["hidden"]]
        got = exposed_transfers(schedules.without_flags(events))
        got = sorted(np.asarray(list(got)).tolist()) if got is not None else None
        if got != want:
            raise AssertionError(f"{what}: the exposed starts are at {want}, you say {got} (hint: a transfer "
                                 f"is hidden when a kernel, loop or compute event lies between its start and the "
                                 f"done with the same id)")
    before = schedules.counts(schedules.load("before"))["bwd"]
    return _correct(f"before the fix {before[0] - before[1]} of the backward's {before[0]} transfers are exposed; "
                    f"after it none")


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
        want = np.roll(held, -1)  # device i now holds shard i + 1: it came from the right
        if not np.array_equal(after, want):
            raise AssertionError(f"n={n}: after one ppermute the devices hold blocks {after.tolist()}; "
                                 f"a ring run backwards gives {want.tolist()} (device i receives from i + 1)")
    _run_on_devices(pairs)
    return _correct("K/V would travel i -> i - 1, and host i holds shard (i + step) % n at step `step`")


def _run_on_devices(pairs):
    """Run the learner's permutation with a real ``lax.ppermute`` on ``len(pairs)`` simulated devices."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from ringattn_fast.mesh import make_mesh

    n = len(pairs)
    if n > len(jax.devices()):
        return
    mesh = make_mesh(n)
    out = jax.shard_map(lambda x: lax.ppermute(x, "sp", pairs), mesh=mesh, in_specs=jax.P("sp"),
                        out_specs=jax.P("sp"))(jnp.arange(n, dtype=jnp.int32))
    if not np.array_equal(np.asarray(out), np.roll(np.arange(n), -1)):
        raise AssertionError(f"lax.ppermute with your pairs gave {np.asarray(out).tolist()}")


def _ring_traces(*, batch, seq, kv_heads, dim, n_devices, itemsize):
    """The forward and backward traces of ``ringattn_ref``'s ring on the exercise's shapes (one query head
    per K/V head: the query heads do not travel), inputs of ``itemsize`` bytes: what a device sends, measured."""
    from ringattn_ref.backward import ring_attention_vjp

    dtype = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    x = np.random.default_rng(0).standard_normal((batch, seq, kv_heads, dim)).astype(dtype)
    _, fwd = ring_attention(x, x, x, n_hosts=n_devices, return_trace=True)
    *_, bwd = ring_attention_vjp(x, x, x, np.ones(x.shape), n_hosts=n_devices, return_trace=True)
    return fwd, bwd


def check_kv_bytes_sent(answer, *, batch=1, seq=256, kv_heads=2, dim=16, n_devices=8, itemsize=4):
    """07, exercise 2: bytes of K and V one device sends over a whole forward ring (positions aside).

    Defaults: the notebook's problem (batch 1, seq 256, 2 kv heads, dim 16, float32, 8 devices). Measured
    on the simulated ring's trace (``bytes_sent`` of device 0, every step), the ring ``ringattn_fast``
    compiles to the same schedule (notebook 07).
    """
    if _pending(answer, "bytes of K and V one device sends in the forward"):
        return False
    fwd, _ = _ring_traces(batch=batch, seq=seq, kv_heads=kv_heads, dim=dim, n_devices=n_devices, itemsize=itemsize)
    want, sends = int(fwd.bytes_sent[0].sum()), int((fwd.bytes_sent[0] > 0).sum())
    got = _as_int(answer, "the number of bytes")
    if got != want:
        raise AssertionError(f"got {got}; hint: how many ppermute sends does the scan make (no send after the "
                             f"last step), and how large are one device's K and V shards?")
    return _correct(f"{sends} sends x {want // sends} bytes (K and V) = {want} bytes; the queries never move")


def check_bwd_bytes_sent(answer, *, batch=1, seq=256, kv_heads=2, dim=16, n_devices=8, itemsize=4):
    """07, exercise 3: bytes of K, V, dK and dV one device sends in the backward ring (float32 all),
    measured on the simulated backward ring's trace (``ring_attention_vjp(..., return_trace=True)``)."""
    if _pending(answer, "bytes one device sends in the backward"):
        return False
    fwd, bwd = _ring_traces(batch=batch, seq=seq, kv_heads=kv_heads, dim=dim, n_devices=n_devices,
                            itemsize=itemsize)
    want = int(bwd.bytes_sent[0].sum())
    if _as_int(answer, "the number of bytes") != want:
        raise AssertionError(f"got {answer}; K/V move N - 1 times, dK/dV N times (the last move brings them "
                             "home): see ringattn_fast.backward's docstring")
    return _correct(f"{want} bytes: {want / fwd.bytes_sent[0].sum():.3g}x the forward's")


def check_ring_step_messages(step_messages):
    """07, exercise 4: ``step_messages(batch, seq, kv_heads, dim, n_devices)``: the sorted byte counts of
    the collective-permutes of one forward ring step, measured in the compiled program's loop body."""
    if _pending(step_messages, "step_messages(batch, seq, kv_heads, dim, n_devices)"):
        return False
    import jax

    import ringattn_fast
    from ringattn_course import hlo

    for batch, seq, kv_heads, dim, n in ((1, 256, 2, 16, 8), (2, 64, 1, 8, 4), (1, 96, 3, 4, 2)):
        mesh = ringattn_fast.make_mesh(n)
        q = jax.ShapeDtypeStruct((batch, seq, 2 * kv_heads, dim), np.float32)
        kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, dim), np.float32)
        text = jax.jit(lambda q, k, v: ringattn_fast.ring_attention(q, k, v, mesh=mesh, causal=True)).lower(
            q, kv, kv).compile().as_text()
        bodies = hlo.while_bodies(text)
        want = sorted(m.nbytes for m in hlo.collective_messages(text) if m.computation in bodies)
        got = sorted(_as_int(x, "a byte count") for x in step_messages(batch, seq, kv_heads, dim, n))
        if got != want:
            raise AssertionError(f"batch={batch}, seq={seq}, kv_heads={kv_heads}, dim={dim}, n_devices={n}: the "
                                 f"compiled loop body sends {want}, you predict {got} (hint: what travels with K "
                                 f"and V, and in which dtype?)")
    return _correct("K and V shards, and their true positions: three messages per step, three latencies")


# ---- 08 Pallas per-hop kernels ---------------------------------------------------------------------

def _tiles_computed(seq, block, causal, window, block_kv=None):
    import jax.numpy as jnp

    from ringattn_fast.kernels.tiles import empty_tiles

    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    return int((~np.asarray(empty_tiles(pos, pos, causal=causal, window=window, block_q=block,
                                        block_kv=block if block_kv is None else block_kv))).sum())


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


def check_causal_tiles_rect(answer, *, seq=1024, block_q=128, block_kv=64):
    """08, exercise 3: tiles a causal one-device hop computes with block_q = 128, block_kv = 64."""
    if _pending(answer, "number of 128 x 64 tiles computed under a causal mask"):
        return False
    want = _tiles_computed(seq, block_q, True, None, block_kv=block_kv)
    if _as_int(answer, "the number of tiles") != want:
        raise AssertionError(f"got {answer}; query tile t ends at key 128 t + 127: which 64-key tiles start "
                             "no later than that?")
    return _correct(f"{want} of {(seq // block_q) * (seq // block_kv)} tiles")


def check_zigzag_host0_tiles(answer, *, n_hosts=4, seq=64, block=4):
    """08, exercise 4: tiles host 0 of a causal zigzag ring computes at each step, measured with the Triton
    kernel's own counter (``pallas_gpu.fwd_tile_counts`` in interpret mode)."""
    if _pending(answer, "tiles host 0 computes at each of the 4 steps"):
        return False
    from ringattn_fast.kernels import pallas_gpu
    from ringattn_fast.schedule import HopConfig, KVShard, QShard

    positions = layout_permutation("zigzag", seq, n_hosts).reshape(n_hosts, -1).astype(np.int32)
    x = np.zeros((1, seq // n_hosts, 1, 8), np.float32)
    cfg = HopConfig(scale=1.0, causal=True, block_q=block, block_kv=block)
    want = [int(np.asarray(pallas_gpu.fwd_tile_counts(QShard(x, positions[0][None]),
                                                      KVShard(x, x, positions[(0 - step) % n_hosts][None]),
                                                      cfg))[0, 0].sum()) for step in range(n_hosts)]
    got = [_as_int(a, "a tile count") for a in answer]
    if got != want:
        raise AssertionError(f"you predict {got} tiles per step; the kernel counted {want} (hint: list host 0's key "
                             f"chunks at each step, then compare each query tile's max with each key tile's min)")
    return _correct(f"{want}: the kernel computed exactly the tiles the bounds test leaves")


# ---- 09 the fused TPU ring -------------------------------------------------------------------------

def _fused_forward_protocol(n):
    """One device's ring protocol in the fused forward, replayed from the kernel's own functions
    (``kernels/fused_ring.py``: ``remote_sends``, ``signal_cap``, ``last_send``) at concrete steps ``0 .. n-1``,
    with recording stand-ins for Pallas' remote copies, semaphores and ``pl.when``: a dict of, per step,
    the slot the left neighbour's copy lands in (``recv``), whether this device starts its copies
    (``sends``), and how many handshake signals it gives (``signals``). Nothing is compiled or run."""
    from types import SimpleNamespace
    from unittest import mock

    from ringattn_fast.kernels import fused_ring as fr

    class Indexed:  # buf.at[i] / sem.at[i, j]: the index, as ints
        def __init__(self):
            self.at = self

        def __getitem__(self, index):
            return tuple(int(i) for i in index) if isinstance(index, tuple) else int(index)

    signals = []
    when = lambda cond: (lambda body: body() if bool(cond) else None)  # noqa: E731 - a concrete step decides
    copy = lambda src, dst, send, recv, device_id: dst  # noqa: E731 - the slot it writes on the right
    cfg = SimpleNamespace(handshake=True, axis_name="sp")
    out = dict(recv=[], sends=[], signals=[])
    with mock.patch.object(fr.pltpu, "make_async_remote_copy", copy), mock.patch.object(fr.pl, "when", when), \
            mock.patch.object(fr.pl, "semaphore_signal", lambda *a, **k: signals.append(1)):
        for step in range(n):
            ring = fr.Ring(step=step, n=n, slot=step % 2, right=1, left=n - 1, kv_idx=None)
            sent_by_left = fr.remote_sends(cfg, ((0, Indexed()),), Indexed(), Indexed(), ring.slot, ring.right)
            out["recv"].append(sent_by_left[0])  # every device runs the same code: my left sends into this slot
            out["sends"].append(n > 1 and step <= fr.last_send(n))
            before = len(signals)
            fr.signal_cap(cfg, ring, Indexed(), fr.last_send(n))
            out["signals"].append(len(signals) - before)
    return out


def check_recv_slot(recv_slot):
    """09, exercise 1: ``recv_slot(step)``: the slot of the double buffer that a device's left
    neighbour writes into (by remote DMA) during ring step ``step``."""
    if _pending(recv_slot, "recv_slot(step)"):
        return False
    recv = _fused_forward_protocol(8)["recv"]  # fused_ring.remote_sends, replayed
    for step in range(8):
        want = recv[step]
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
        want = sum(_fused_forward_protocol(n)["signals"])  # fused_ring.signal_cap, replayed over the steps
        got = _as_int(n_signals(n), f"n_signals({n})")
        if got != want:
            raise AssertionError(f"n_devices={n}: a device signals {want} times, you say {got} (hint: the "
                                 f"left neighbour sends at steps 0 .. n-2; which of its writes need my 'free'?)")
    return _correct("max(n - 2, 0): with 2 devices nobody writes a slot twice, so no handshake is needed")


def check_remote_copies(n_copies):
    """09, exercise 3: ``n_copies(n_devices)``: K/V remote DMAs one device starts in the fused forward."""
    if _pending(n_copies, "n_copies(n_devices)"):
        return False
    for n in range(1, 9):
        want = sum(_fused_forward_protocol(n)["sends"])  # fused_ring.last_send: no send after the last step
        got = _as_int(n_copies(n), f"n_copies({n})")
        if got != want:
            raise AssertionError(f"n_devices={n}: a device starts {want} K/V copies, you say {got}")
    return _correct("n - 1, as in every ring of this course")


def _pallas_buffers(fn, *args):
    """(shape, dtype) of every output, then of every scratch buffer, of the first ``pallas_call`` in
    ``jax.make_jaxpr(fn)(*args)`` (traced only: nothing runs)."""
    import jax

    def calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (list, tuple)) else [param]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from calls(inner)

    eqn = next(calls(jax.make_jaxpr(fn)(*args).jaxpr))
    n = eqn.params["grid_mapping"].num_scratch_operands
    outputs = [(v.aval.shape, getattr(v.aval, "dtype", None)) for v in eqn.outvars]
    scratch = [(v.aval.shape, getattr(v.aval, "dtype", None)) for v in eqn.params["jaxpr"].invars[-n:]]
    return outputs, scratch


def measured_kv_buffer(batch, shard, kv_heads, dim, dtype, *, n=2):
    """``(shape, bytes)`` of the fused ring's K/V double buffer on one device, read from the outputs its
    ``pallas_call`` declares for a ring of ``n`` (traced, nothing runs; 09, exercise 4 and its answer)."""
    import jax.numpy as jnp

    import ringattn_fast

    mesh = ringattn_fast.make_mesh(n)
    q = jnp.zeros((batch, n * shard, 2 * kv_heads, dim), dtype)
    kv = jnp.zeros((batch, n * shard, kv_heads, dim), dtype)
    outputs, _ = _pallas_buffers(lambda q, k, v: ringattn_fast.ring_attention(
        q, k, v, mesh=mesh, causal=True, impl="pallas_tpu_fused", block_q=8, block_kv=8), q, kv, kv)
    slots = (2, 2, batch, kv_heads, shard, dim)                               # (slot, K|V, b, hk, s, d)
    shape, dt = next(o for o in outputs if tuple(o[0]) == slots and o[1] == dtype)
    return tuple(shape), int(np.prod(shape)) * np.dtype(dt).itemsize


def check_kv_double_buffer(kv_buffer_bytes):
    """09, exercise 4: ``kv_buffer_bytes(batch, shard, kv_heads, dim, itemsize)``: bytes of the fused
    forward's K/V double buffer (both slots, K and V), measured from the ``pallas_call``: the buffer is
    one of its HBM outputs (``memory_space=pl.ANY``), the one the left neighbour's remote DMA writes into."""
    if _pending(kv_buffer_bytes, "kv_buffer_bytes(batch, shard, kv_heads, dim, itemsize)"):
        return False
    import jax.numpy as jnp

    import ringattn_fast

    for batch, shard, kv_heads, dim, n, dtype in ((1, 8, 2, 8, 4, jnp.float32), (2, 16, 1, 8, 2, jnp.bfloat16),
                                                  (1, 8, 3, 16, 3, jnp.float32)):
        shape, want = measured_kv_buffer(batch, shard, kv_heads, dim, dtype, n=n)
        itemsize = np.dtype(dtype).itemsize
        got = _as_int(kv_buffer_bytes(batch, shard, kv_heads, dim, itemsize), "the byte count")
        if got != want:
            raise AssertionError(f"batch={batch}, shard={shard}, kv_heads={kv_heads}, dim={dim}, itemsize={itemsize}: "
                                 f"the kernel declares a {shape} buffer of {want} bytes, you say {got}")
    return _correct("2 slots x (K, V) x the shard: in HBM; VMEM holds only tiles of it")


# ---- 10 putting it together ------------------------------------------------------------------------

def check_min_context(answer, *, hardware="TPU v5e", n_hosts=64):
    """10, exercise 1: the shortest total sequence at which a ring of 64 TPU v5e hosts hides every
    transfer (Table 2's minimal sequence per host, ``6c`` with ``c = F/B``, times the hosts)."""
    if _pending(answer, "shortest context that overlaps communication on 64 TPU v5e hosts"):
        return False
    want = n_hosts * cost.table2([hardware])[0].min_seq
    got = float(np.asarray(answer).item())
    if not math.isclose(got, want, rel_tol=1e-3):
        raise AssertionError(f"got {got:.6g}; Table 2 gives the minimal sequence per host (6 c, c = F / B); "
                             f"the ring has {n_hosts} hosts")
    return _correct(f"{want / 1e3:.0f}K tokens: below that, the hosts wait for K/V")


def check_min_block_gqa_infiniband(answer):
    """10, exercise 2: minimal block on A100 + InfiniBand (12.5 GB/s) with GQA 32:8, bf16, full hops."""
    if _pending(answer, "minimal block over InfiniBand with GQA 4:1"):
        return False
    hw = cost.HARDWARE["A100 InfiniBand"]
    want = cost.min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s, heads=32, kv_heads=8)
    _close(answer, want, 1e-3, "c >= (kv_heads / heads) F / B")
    return _correct(f"c >= {want:.0f}: 8K tokens per GPU hides a full hop, not a causal diagonal one")


def check_min_block_backward_causal(answer, *, hardware="TPU v5e"):
    """10, exercise 3: the causal diagonal hop of the backward on TPU v5e, GQA 32:8 (peak rates): the
    question's half-full hop (``fill=0.5``) and GQA factor, the backward's factor measured from the traces
    (:func:`_backward_bound`)."""
    if _pending(answer, "minimal block for the causal backward hop with GQA"):
        return False
    want = _backward_bound(hardware, heads=32, kv_heads=8, fill=0.5)
    _close(answer, want, 1e-3, "backward factor (bytes ratio / FLOPs ratio), causal factor 2, GQA factor 8 / 32")
    return _correct(f"c >= {want:.0f} tokens")


def check_layer_messages(answer, *, batch=1, seq=2048, heads=4, kv_heads=2, dim=16, n_devices=8):
    """10, exercise 4: the sorted byte counts of every collective-permute of the compiled gradient of the
    ring (notebook 10's attention shapes), measured with ``hlo.collective_messages``."""
    if _pending(answer, "the byte counts of every collective-permute in the gradient program"):
        return False
    import jax

    import ringattn_fast
    from ringattn_course import hlo

    mesh = ringattn_fast.make_mesh(n_devices)
    q = jax.ShapeDtypeStruct((batch, seq, heads, dim), np.float32)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, dim), np.float32)
    loss = lambda q, k, v: ringattn_fast.ring_attention(q, k, v, mesh=mesh, causal=True).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    want = sorted(m.nbytes for m in hlo.collective_messages(text) if m.opcode.startswith("collective-permute"))
    got = sorted(_as_int(x, "a byte count") for x in answer)
    if got != want:
        raise AssertionError(f"the compiled program's collective-permutes move {want} bytes; you predict {got} "
                             f"(hint: {len(want)} messages: count the forward loop's, the backward loop's, the "
                             f"backward's first and last steps', and what brings dK/dV home)")
    return _correct(f"{len(want)} messages: 2 in the forward loop, 3 in the backward loop, 4 around it (the "
                    f"first K/V and positions, the last step's dK/dV, the send home)")


# ---- 11 inference and decoding ---------------------------------------------------------------------

def check_cache_slot(where):
    """11, exercise 1: ``where(position, n_hosts) -> (host, slot)``: where the round-robin KV cache keeps
    a token, checked against the K a prefill stored in ``ringattn_ref.inference``'s cache."""
    if _pending(where, "where(position, n_hosts) -> (host, slot)"):
        return False
    from ringattn_ref import inference
    for n_hosts in (1, 3, 4):
        cache = inference.init_cache(1, 12, 1, 1, n_hosts=n_hosts)
        marks = (np.arange(12, dtype=np.float64) + 1).reshape(1, 12, 1, 1)  # token p holds the value p + 1
        _, cache = inference.prefill(marks, marks, marks, cache)
        for p in range(12):
            host, slot = (int(x) for x in where(p, n_hosts))
            if not (0 <= host < n_hosts and 0 <= slot < cache.slots) or cache.k[host, 0, slot, 0, 0] != p + 1:
                raise AssertionError(f"position {p} with {n_hosts} hosts: you say host {host}, slot {slot}; the "
                                     f"cache keeps it elsewhere (hint: consecutive tokens go to consecutive hosts)")
    return _correct("host p % N, slot p // N: appends take turns over the hosts")


def check_merge_bytes(merge_bytes):
    """11, exercise 2: ``merge_bytes(n_hosts, batch, heads, dim)``: float64 bytes the reduction tree sends
    for one decode step, checked against ``decode_step``'s trace."""
    if _pending(merge_bytes, "merge_bytes(n_hosts, batch, heads, dim)"):
        return False
    from ringattn_ref import inference
    rng = np.random.default_rng(0)
    for n_hosts, batch, heads, dim in ((1, 1, 1, 2), (2, 2, 4, 8), (5, 1, 2, 3), (8, 3, 2, 4)):
        cache = inference.init_cache(batch, 4 * n_hosts, 1, dim, n_hosts=n_hosts)
        q = rng.standard_normal((batch, 1, heads, dim))
        k, v = rng.standard_normal((2, batch, 1, 1, dim))
        _, _, trace = inference.decode_step(q, k, v, cache, return_trace=True)
        got = int(np.asarray(merge_bytes(n_hosts, batch, heads, dim)).item())
        if got != trace.total_bytes:
            raise AssertionError(f"n_hosts={n_hosts}, batch={batch}, heads={heads}, dim={dim}: the tree sends "
                                 f"{trace.total_bytes} bytes, you say {got} (hint: how many messages has a tree "
                                 f"over N hosts, and what is in one?)")
    return _correct("(N - 1) messages of one o row and one lse per head: b h (d + 1) 8 bytes, whatever S")


def check_cache_bytes_per_host(cache_bytes_per_host):
    """11, exercise 3: ``cache_bytes_per_host(seq, n_hosts, layers, kv_heads, dim, dtype_bytes)``: K and V
    bytes one host keeps for one sequence over all layers, checked against the arrays of
    ``ringattn_ref.inference.init_cache`` (one layer's cache; a model has one per layer)."""
    if _pending(cache_bytes_per_host, "cache_bytes_per_host(seq, n_hosts, layers, kv_heads, dim, dtype_bytes)"):
        return False
    from ringattn_ref import inference
    dtypes = {2: np.float16, 4: np.float32, 8: np.float64}
    for seq, n_hosts, layers, kv_heads, dim, dtype_bytes in (
            (8, 1, 1, 1, 2, 2), (12, 4, 3, 2, 4, 4), (64, 8, 2, 3, 8, 8), (30, 5, 4, 1, 6, 2)):
        cache = inference.init_cache(1, seq, kv_heads, dim, n_hosts=n_hosts, dtype=dtypes[dtype_bytes])
        want = layers * (cache.k[0].nbytes + cache.v[0].nbytes)   # host 0's K and V, one per layer
        got = _as_int(cache_bytes_per_host(seq, n_hosts, layers, kv_heads, dim, dtype_bytes), "the byte count")
        if got != want:
            raise AssertionError(f"seq={seq}, n_hosts={n_hosts}, layers={layers}, kv_heads={kv_heads}, dim={dim}, "
                                 f"dtype_bytes={dtype_bytes}: a host holds {want} bytes, you say {got} (hint: "
                                 f"seq / N slots per host, K and V, every layer)")
    return _correct("2 · layers · (S / N) · kv_heads · dim · bytes: 128 KiB per token for a 7B-class model, "
                    "so 1M tokens need 128 GiB on one host, 2 GiB each on 64")


def decode_collectives(batch, heads, kv_heads, dim, *, n_devices=8):
    """The collectives (``hlo.collective_messages``) of ``ringattn_fast.decode_step``'s compiled program for
    one float32 token against a cache over ``n_devices`` hosts (11, exercise 4 and its answer)."""
    import jax
    import jax.numpy as jnp

    import ringattn_fast
    from ringattn_course import hlo

    mesh = ringattn_fast.make_mesh(n_devices)
    cache = ringattn_fast.init_cache(batch, 8 * n_devices, kv_heads, dim, mesh=mesh)
    q, kv = jnp.zeros((batch, 1, heads, dim)), jnp.zeros((batch, 1, kv_heads, dim))
    text = jax.jit(lambda q, k, v, c: ringattn_fast.decode_step(q, k, v, c, mesh=mesh)).lower(
        q, kv, kv, cache).compile().as_text()
    return hlo.collective_messages(text)


def check_decode_collective_bytes(decode_collective_bytes, *, n_devices=8):
    """11, exercise 4: ``decode_collective_bytes(batch, heads, dim)``: the sorted operand bytes of the all-reduces
    of ``ringattn_fast.decode_step``'s compiled program, measured with ``hlo.collective_messages``."""
    if _pending(decode_collective_bytes, "decode_collective_bytes(batch, heads, dim)"):
        return False
    for batch, heads, kv_heads, dim in ((2, 4, 2, 8), (1, 8, 2, 16), (3, 2, 1, 4)):
        messages = decode_collectives(batch, heads, kv_heads, dim, n_devices=n_devices)
        want = sorted(m.nbytes for m in messages if m.opcode.startswith("all-reduce"))
        got = sorted(_as_int(x, "a byte count") for x in decode_collective_bytes(batch, heads, dim))
        if len(want) != len(messages) or got != want:
            raise AssertionError(f"batch={batch}, heads={heads}, dim={dim}: the compiled step's collectives move "
                                 f"{[(m.opcode, m.nbytes) for m in messages]}, you predict {got} (hint: one lse per "
                                 f"row and head; then o and the denominator together)")
    return _correct("b h 4 and b h (d + 1) 4 bytes: two tiny all-reduces per token, whatever the cache length")


# ---- 12 training with a long context ------------------------------------------------------------

def check_last_fact_position(answer, *, seq=512, shard=64):
    """12, exercise 1: the largest position of a fact in ``RecallTask(seq=512, shard=64)``."""
    if _pending(answer, "the largest position a fact may take"):
        return False
    from examples.recall.tasks import RecallTask
    task = RecallTask(seq=seq, shard=shard)
    want = task.fact_limit - 1
    got = _as_int(answer, "the position")
    if got != want:
        raise AssertionError(f"got {got}; the {task.n_queries} questions and their answers fill the last "
                             f"{2 * task.n_queries} positions, and a fact must be MORE than {shard} before the first")
    return _correct(f"{want}: from the first question at {seq - 2 * task.n_queries}, {want} is {shard + 1} back")


def check_kept_scale(answer, *, rate=0.2):
    """12, exercise 2: the multiplier of a kept attention probability at ``dropout_rate=0.2``."""
    if _pending(answer, "the factor of a kept probability"):
        return False
    from ringattn_ref.dropout import dropout_mask
    pos = np.arange(64)[None]
    want = float(dropout_mask(np.zeros(2, np.uint32), rate, 1, 1, pos, pos).max())  # what a kept entry gets
    _close(answer, want, 1e-9, "the kept probability's factor (the expectation must not change)")
    return _correct(f"{want}: kept with probability {1 - rate}, so E[factor * p] = p")


def check_guess_loss(guess_loss):
    """12, exercise 3: ``guess_loss(n_values)``: the lowest loss of a model that can only guess the answer,
    checked against ``train.loss_and_accuracy`` on logits uniform over the answer tokens."""
    if _pending(guess_loss, "guess_loss(n_values)"):
        return False
    from examples.recall.tasks import RecallTask
    from examples.recall.train import loss_and_accuracy
    for n_values in (2, 5, 16, 64):
        task = RecallTask(seq=64, shard=16, n_values=n_values)
        logits = np.full((1, 4, task.vocab), -1e9, np.float32)
        logits[..., task.answer_base:] = 0.0                    # every answer equally likely, nothing else
        targets = np.full((1, 4), task.answer_base + 1, np.int32)
        want = float(loss_and_accuracy(logits, targets, np.ones((1, 4), np.float32), task.answer_base,
                                       n_values)[0])
        _close(guess_loss(n_values), want, 1e-5, f"the loss of a uniform guess over {n_values} answers "
               f"(hint: the cross-entropy when the right answer gets probability 1 / n_values)")
    return _correct("log(n_values): 2.77 for 16 answers, the flat line of the local model in the figure")


def check_true_positions(true_positions, *, seq=64, n_devices=4):
    """12, exercise 4: ``true_positions(layout, seq, n_devices)``: the true position of each token in layout
    order; measured by running the ring model on tokens in that layout with those positions against the
    one-device model (notebook 12's configuration)."""
    if _pending(true_positions, "true_positions(layout, seq, n_devices)"):
        return False
    import jax

    import ringattn_fast
    from examples.recall.tasks import RecallTask
    from ringattn_fast import model

    task = RecallTask(seq=seq, shard=seq // n_devices)
    tokens = task.batch(np.random.default_rng(0), 2).tokens
    cfg = model.ModelConfig(vocab=task.vocab, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, ffn_block=16)
    params = model.init_params(jax.random.key(0), cfg)
    forward = jax.jit(model.sharded_forward, static_argnums=(3, 4))
    dense = np.asarray(forward(params, tokens, np.broadcast_to(np.arange(seq), tokens.shape), cfg,
                               ringattn_fast.make_mesh(1)))
    mesh = ringattn_fast.make_mesh(n_devices)
    for layout in ("contiguous", "striped", "zigzag"):
        perm = layout_permutation(layout, seq, n_devices)
        raw = np.asarray(true_positions(layout, seq, n_devices)).reshape(-1)
        if raw.shape != (seq,) or not np.all(np.mod(raw, 1) == 0):
            raise AssertionError(f"{layout}: true_positions must give {seq} integer positions; got {raw[:8]}...")
        got = raw.astype(np.int32)
        logits = np.asarray(forward(params, tokens[:, perm], np.broadcast_to(got, tokens.shape), cfg, mesh))
        err = float(np.abs(logits - dense[:, perm]).max())
        if not err < 2e-4:
            raise AssertionError(f"{layout}: with your positions the ring model's logits differ from the one-device "
                                 f"model's by {err:.3g} (hint: which true positions does device 0 hold?)")
    return _correct("the ring model with true positions is the one-device model, in every layout")


# ---- 13 which sequence parallelism -----------------------------------------------------------------

def check_ulysses_bytes(answer, *, seq=2**17, heads=128, kv_heads=8, dim=128, devices=8, dtype_bytes=2):
    """13, exercise 1: bytes one device sends in Ulysses's two all-to-alls (one forward, bf16)."""
    if _pending(answer, "bytes a device sends with Ulysses"):
        return False
    from ringattn_ref.strategy_cost import strategy_costs

    want = strategy_costs(seq=seq, heads=heads, kv_heads=kv_heads, dim=dim, devices=devices,
                          hardware="A100 NVLink", dtype_bytes=dtype_bytes)["ulysses"].bytes_sent
    got = float(np.asarray(answer).item())
    if abs(got - want) > 0.5:  # a whole number of bytes
        raise AssertionError(f"got {got:.6g}; to each of the N - 1 others a device sends its c tokens of q on "
                             f"their heads/N heads and of k, v on their kv heads, then the same size of o back")
    return _correct(f"{want / 2**20:.0f} MiB, against the ring's "
                    f"{(devices - 1) * 2 * (seq // devices) * kv_heads * dim * dtype_bytes / 2**20:.0f} MiB")


def check_allgather_max_seq(answer, *, kv_heads=8, dim=128, dtype_bytes=2, budget=16 * 2**30):
    """13, exercise 2: the sequence at which the all-gathered K/V alone fill 16 GiB per device."""
    if _pending(answer, "sequence length at which all-gathered K/V take 16 GiB"):
        return False
    want = budget / (2 * kv_heads * dim * dtype_bytes)  # K and V of every token on every device
    got = float(np.asarray(answer).item())
    if not math.isclose(got, want, rel_tol=1e-3):
        raise AssertionError(f"got {got:.6g}; every device holds K and V of all S tokens: "
                             f"2 * S * kv_heads * dim * dtype_bytes bytes")
    return _correct(f"{want / 2**20:.0f}M tokens: the all-gather's limit, whatever the number of devices")


def check_ring_min_seq(ring_min_seq):
    """13, exercise 3: ``ring_min_seq(heads, kv_heads, devices, hardware)``: the shortest total sequence
    at which a bf16 ring forward hides every hop's K/V transfer, ``N (hk/h) F/B``, checked on several
    models and rows of Table 2 (the condition ``strategy_costs`` marks as ``overlapped``)."""
    if _pending(ring_min_seq, "ring_min_seq(heads, kv_heads, devices, hardware)"):
        return False
    for heads, kv_heads, devices, hardware in ((32, 8, 8, "TPU v5e"), (128, 8, 8, "A100 InfiniBand"),
                                              (128, 128, 8, "A100 InfiniBand"), (16, 16, 4, "A100 NVLink"),
                                              (8, 2, 64, "TPU v4")):
        hw = cost.HARDWARE[hardware]
        want = devices * kv_heads / heads * cost.min_block_size(hw.flops_per_s, hw.bandwidth_bytes_per_s)
        _close(ring_min_seq(heads, kv_heads, devices, hardware), want, 1e-3,
               f"{heads} heads, {kv_heads} kv heads, {devices} devices, {hardware} (hint: c >= (hk/h) F/B "
               f"tokens per device, and the sequence is N blocks)")
    return _correct("S >= N (hk/h) F/B: only kv heads travel while all query heads compute")


def check_ulysses_messages(ulysses_messages):
    """13, exercise 4: ``ulysses_messages(batch, seq, heads, kv_heads, dim, devices)``: the sorted operand bytes
    of the all-to-alls of ``ringattn_fast.ulysses_attention``'s compiled forward (float32)."""
    if _pending(ulysses_messages, "ulysses_messages(batch, seq, heads, kv_heads, dim, devices)"):
        return False
    import jax

    import ringattn_fast
    from ringattn_course import hlo

    for batch, seq, heads, kv_heads, dim, n in ((1, 1024, 16, 8, 32, 8), (2, 64, 4, 4, 8, 4), (1, 96, 6, 3, 4, 3)):
        mesh = ringattn_fast.make_mesh(n)
        q = jax.ShapeDtypeStruct((batch, seq, heads, dim), np.float32)
        kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, dim), np.float32)
        text = jax.jit(lambda q, k, v: ringattn_fast.ulysses_attention(q, k, v, mesh=mesh, causal=True)).lower(
            q, kv, kv).compile().as_text()
        want = sorted(m.nbytes for m in hlo.collective_messages(text) if m.opcode == "all-to-all")
        got = sorted(_as_int(x, "a byte count") for x in ulysses_messages(batch, seq, heads, kv_heads, dim, n))
        if got != want:
            raise AssertionError(f"batch={batch}, seq={seq}, heads={heads}, kv_heads={kv_heads}, dim={dim}, "
                                 f"devices={n}: the compiled all-to-alls take {want} bytes, you predict {got} "
                                 f"(hint: each takes a device's whole local buffer of q, k, v or o)")
    return _correct("q, k, v and o, each a device's local buffer; (N - 1) / N of each leaves the device")


# ---- 14 programming attention ----------------------------------------------------------------------

def check_sink_as_key(sink_as_key):
    """14, exercise 1: ``sink_as_key(q, k, v, sinks)``: attention with sinks from the oracle *without* them
    (one more key and a bias), against ``attention(q, k, v, sinks=sinks)``; GQA and ``t != s`` included."""
    if _pending(sink_as_key, "sink_as_key(q, k, v, sinks)"):
        return False
    for seed, (t, s, h, hk, d, d_v) in enumerate(((16, 16, 2, 2, 4, 4), (8, 24, 4, 2, 8, 3), (5, 7, 3, 1, 4, 6))):
        rng = np.random.default_rng(140 + seed)
        q, k = rng.standard_normal((1, t, h, d)), rng.standard_normal((1, s, hk, d))
        v, sinks = rng.standard_normal((1, s, hk, d_v)), 2 * rng.standard_normal(h)
        want = attention(q, k, v, sinks=sinks)
        got = np.asarray(sink_as_key(q, k, v, sinks))
        if got.shape != want.shape or not np.abs(got - want).max() < 1e-12:
            raise AssertionError(f"t={t}, s={s}, heads={h}, kv_heads={hk}: your output (shape {got.shape}) differs "
                                 f"from attention(q, k, v, sinks=sinks) (shape {want.shape}) (hint: a key whose "
                                 f"logit is exactly the sink and whose value is 0; what logit does a zero key give, "
                                 f"and which keyword adds a per-head number to one column?)")
    return _correct("a sink is one more key: logit sigma_h, value 0, seen by every query")


def _dilated_rule(window, dilation, q_pos, k_pos):
    """The dilated window pair by pair: keys at distances 0, dilation, ..., (window - 1) dilation before."""
    return np.array([[0 <= i - j < window * dilation and (i - j) % dilation == 0 for j in k_pos] for i in q_pos])


def check_dilated(dilated):
    """14, exercise 2: ``dilated(window, dilation)`` -> a ``mask_fn``, checked in the oracle against the rule
    written pair by pair (self- and cross-attention, true positions), and in ``jax.numpy`` under ``jax.jit``
    (the ring calls it per tile there)."""
    if _pending(dilated, "dilated(window, dilation)"):
        return False
    import jax
    import jax.numpy as jnp

    for seed, (window, dilation, t, s) in enumerate(((4, 2, 32, 32), (3, 5, 40, 40), (8, 1, 24, 24),
                                                    (2, 3, 12, 36))):
        q_pos, k_pos = np.arange(s - t, s), np.arange(s)  # queries: the last t positions
        args = (q_pos[None, None, :, None], k_pos[None, None, None, :], np.zeros((1, 1, t, 1), np.int64),
                np.zeros((1, 1, 1, s), np.int64), np.zeros((1, 1, 1, 1), np.int64))
        try:
            mask_fn = dilated(window, dilation)
            got = np.asarray(mask_fn(*args))
        except Exception as e:  # noqa: BLE001 - the learner's code: report it as a wrong answer
            raise AssertionError(f"dilated({window}, {dilation}) and then its mask_fn(q_pos, k_pos, q_seg, k_seg, head) "
                                 f"on arrays of shapes {[a.shape for a in args]} raised {type(e).__name__}: {e}") from e
        if got.dtype != np.bool_:
            raise AssertionError(f"mask_fn must return bools (comparisons joined with jnp.logical_and / jnp.logical_or, or & and |); got {got.dtype}")
        want = _dilated_rule(window, dilation, q_pos, k_pos)
        if not np.array_equal(np.broadcast_to(got, (1, 1, t, s))[0, 0], want):
            raise AssertionError(f"window={window}, dilation={dilation}, {t} queries at positions {s - t}..{s - 1}: "
                                 f"your mask differs from the rule (hint: the distance q - k is >= 0, a multiple of "
                                 f"the dilation and below window * dilation)")
        traced = np.asarray(jax.jit(mask_fn)(*(jnp.asarray(a, jnp.int32) for a in args)))
        if not np.array_equal(np.broadcast_to(traced, (1, 1, t, s))[0, 0], want):
            raise AssertionError("under jax.jit with jax.numpy arrays your mask_fn gives another mask: use only "
                                 "elementwise operators (the ring evaluates it per tile in JAX)")
        rng = np.random.default_rng(150 + seed)
        q, k, v = (rng.standard_normal((1, n, 2, 4)) for n in (t, s, s))
        o = attention(q, k, v, mask_fn=mask_fn)
        assert np.abs(o - attention(q, k, v, bias=np.where(want, 0.0, -np.inf)[None, None])).max() < 1e-12, "the oracle"
    return _correct("the oracle with your mask_fn equals the rule; it traces in jax.numpy, so the ring runs it too")


def check_chunked_empty_hops(chunked_empty_hops):
    """14, exercise 3: ``chunked_empty_hops(seq, n_hosts, chunk)``: how many of the ``n_hosts**2`` hops of a
    contiguous ring ``variants.chunked_local(chunk)`` leaves empty, measured by ``ring_block_mask``."""
    if _pending(chunked_empty_hops, "chunked_empty_hops(seq, n_hosts, chunk)"):
        return False
    from ringattn_ref import variants
    from ringattn_ref.block_mask import ring_block_mask

    # (256, 8, 24): a chunk smaller than the shard that does not divide it straddles shards (not N^2 - N)
    for seq, n, chunk in ((256, 8, 64), (256, 8, 16), (256, 8, 48), (256, 8, 24), (96, 4, 40), (64, 8, 64),
                          (128, 4, 256)):
        shard = seq // n
        bm = ring_block_mask(variants.chunked_local(chunk), seq, n, block_q=shard, block_kv=shard)
        want = int((~bm.hops).sum())
        got = _as_int(chunked_empty_hops(seq, n, chunk), "the number of empty hops")
        if got != want:
            raise AssertionError(f"seq={seq}, n_hosts={n}, chunk={chunk}: the block mask finds {want} empty hops of "
                                 f"{n * n}, you predict {got} (hint: host i sees shard j iff j <= i and some key "
                                 f"of shard j shares a chunk with some query of host i)")
    return _correct("a hop is live iff the shards share a chunk (and the keys come first)")


# ---- 15 two dimensions and balance -----------------------------------------------------------------

def check_ulysses_degrees(ulysses_degrees):
    """15, exercise 1: ``ulysses_degrees(heads, kv_heads, devices)`` -> ``[(U, R, kv_per_host), ...]`` sorted by
    ``U``: every split of the hybrid (``ringattn_ref.hybrid_splits``) and the kv heads a device holds after
    the all-to-all (``kv_heads * kv_repeat(kv_heads, U) / U``)."""
    if _pending(ulysses_degrees, "ulysses_degrees(heads, kv_heads, devices)"):
        return False
    from ringattn_ref.hybrid import hybrid_splits, kv_repeat

    for heads, kv_heads, devices in ((4, 4, 8), (4, 2, 8), (12, 3, 16), (8, 1, 8), (6, 6, 4), (32, 8, 64)):
        want = [(float(u), float(r), float(kv_heads * kv_repeat(kv_heads, u) // u))
                for u, r in hybrid_splits(heads, devices)]
        try:
            got = [tuple(float(x) for x in split) for split in ulysses_degrees(heads, kv_heads, devices)]
        except (TypeError, ValueError) as err:
            raise AssertionError(f"ulysses_degrees({heads}, {kv_heads}, {devices}) must return a list of "
                                 f"(U, R, kv_per_host) tuples of numbers; got an error: {err}") from err
        if got != want:
            raise AssertionError(f"heads={heads}, kv_heads={kv_heads}, devices={devices}: expected {len(want)} "
                                 f"splits {[tuple(int(x) for x in w) for w in want]}, got {got} (hint: U divides "
                                 f"the devices and the heads; each kv head is repeated U / gcd(kv_heads, U) times, "
                                 f"then split U ways)")
    return _correct("U divides gcd(heads, devices); a device holds lcm(kv_heads, U) / U kv heads")


def _permutation(perm, seq, what):
    """``perm`` as an int64 permutation of ``range(seq)``, or AssertionError saying what is wrong."""
    try:
        arr = np.asarray(perm)
    except Exception as err:  # noqa: BLE001 - the learner's value
        raise AssertionError(f"{what} must be an int array; got {type(perm).__name__}") from err
    if arr.shape != (seq,) or not (np.issubdtype(arr.dtype, np.integer) or
                                   (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)))):
        raise AssertionError(f"{what} must be {seq} integer positions; got shape {arr.shape}, dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if not np.array_equal(np.sort(arr), np.arange(seq)):
        raise AssertionError(f"{what} is not a permutation of range({seq}): every position exactly once")
    return arr


def check_two_doc_zigzag(two_doc_zigzag):
    """15, exercise 2: ``two_doc_zigzag(len_a, len_b, n_hosts)``: each host's positions equal those of
    ``ringattn_ref.per_document_zigzag([len_a, len_b], n_hosts)`` (any order inside a host), and the ring with
    that layout equals the oracle (causal, the two documents as segment ids)."""
    if _pending(two_doc_zigzag, "two_doc_zigzag(len_a, len_b, n_hosts)"):
        return False
    from ringattn_ref.layouts import per_document_zigzag

    for seed, (len_a, len_b, n) in enumerate(((32, 64, 4), (48, 16, 2), (96, 32, 8), (16, 16, 8))):
        seq = len_a + len_b
        got = _permutation(two_doc_zigzag(len_a, len_b, n), seq, f"two_doc_zigzag({len_a}, {len_b}, {n})")
        want = per_document_zigzag([len_a, len_b], n).perm
        for r in range(n):
            mine, theirs = (np.sort(x[r * seq // n:(r + 1) * seq // n]) for x in (got, want))
            if not np.array_equal(mine, theirs):
                raise AssertionError(f"len_a={len_a}, len_b={len_b}, n_hosts={n}: host {r} should own "
                                     f"{theirs.tolist()}, yours owns {mine.tolist()} (hint: cut each document "
                                     f"into 2N chunks; host r takes chunks r and 2N - 1 - r of each)")
        q, k, v = _problem(160 + seed, seq=seq)
        seg = np.repeat([[1, 2]], [len_a, len_b], axis=1)
        o = ring_attention(q, k, v, n_hosts=n, causal=True, segment_ids=seg, layout=got)
        assert np.abs(o - attention(q, k, v, causal=True, segment_ids=seg)).max() < 1e-12, "the ring vs the oracle"
    return _correct("each document zigzagged on its own; the ring with layout=perm equals the oracle")


def check_layout_critical_path(layout_critical_path):
    """15, exercise 3: ``layout_critical_path(perm, doc_lengths, n_hosts, block)``: the ring's critical path in
    tiles for packed causal documents, measured by ``balance.layout_block_mask`` + ``balance.critical_path``."""
    if _pending(layout_critical_path, "layout_critical_path(perm, doc_lengths, n_hosts, block)"):
        return False
    from ringattn_ref import balance
    from ringattn_ref.layouts import as_layout, per_document_zigzag

    notebook_batch = [181, 93, 75, 56, 43, 31, 18, 15]
    cases = []
    for lengths, n, block in ((notebook_batch, 8, 16), ([40, 24, 16, 8, 8, 32], 4, 4), ([100, 28], 2, 8)):
        seq = sum(lengths)
        seg = np.repeat(np.arange(1, len(lengths) + 1), lengths)
        rng = np.random.default_rng(seq)
        chunks = rng.permutation(seq // block)
        layouts = {"contiguous": "contiguous", "zigzag": "zigzag",
                   "per-document zigzag": per_document_zigzag(lengths, n),
                   "solver": balance.balanced_layout(None, seq, n, segment_ids=seg, causal=True, block_q=block,
                                                     block_kv=block),
                   "random chunks": (chunks[:, None] * block + np.arange(block)).ravel()}
        for name, lay in layouts.items():
            perm = as_layout(lay, seq, n).perm
            bm = balance.layout_block_mask(perm, seq, n, segment_ids=seg, causal=True, block_q=block, block_kv=block)
            cases.append((name, perm, lengths, n, block, balance.critical_path(bm)))
    for name, perm, lengths, n, block, want in cases:
        got = _as_int(layout_critical_path(perm.copy(), list(lengths), n, block), "the critical path in tiles")
        if got != want:
            raise AssertionError(f"{name} layout, documents {lengths}, {n} hosts, tiles of {block}: the block mask's "
                                 f"critical path is {want:.0f} tiles, you predict {got} (hint: host i holds K/V shard "
                                 f"(i - s) % N at step s; a step lasts as long as its busiest host)")
    return _correct("the critical path: each ring step waits for its busiest host")
