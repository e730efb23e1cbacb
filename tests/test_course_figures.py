"""ringattn_course.figures: the figures of notebooks 07-09 draw what their data says, and reject bad input."""
import numpy as np
import pytest

pytest.importorskip("matplotlib")

from ringattn_course import figures  # noqa: E402


def test_memory_vs_devices_plots_one_line_per_series():
    fig = figures.plot_memory_vs_devices([2, 4, 8], {"forward": [2**20] * 3, "fwd+bwd": [2**21] * 3},
                                         {"forward": [2**20, 2**22, 2**24]}, local_seq=256)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    assert np.allclose(lines[2].get_ydata(), [1, 4, 16])  # MiB
    with pytest.raises(ValueError, match="expected one per device count"):
        figures.plot_memory_vs_devices([2, 4], {"forward": [1, 2, 3]}, local_seq=8)


def test_empty_tiles_figure_counts_tiles_per_host():
    visible = np.zeros((2, 2, 3, 3), dtype=bool)
    visible[0, 0] = np.tril(np.ones((3, 3), dtype=bool))  # host 0: 6 tiles, host 1: 9 + 0
    visible[1, 0] = True
    fig = figures.plot_empty_tiles(~visible)
    assert len(fig.axes) == 2 * 2 + 2  # a panel per (host, step) + the twin axes of the totals
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel().endswith("tiles")]
    assert labels == ["6 tiles", "9 tiles"]
    assert "1.20" in fig._suptitle.get_text()  # critical path 9 / mean 7.5
    with pytest.raises(ValueError, match="empty must be bool"):
        figures.plot_empty_tiles(np.zeros((2, 3, 3), dtype=bool))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_double_buffer_draws_every_hop(n):
    fig = figures.plot_double_buffer(n)
    ax = fig.axes[0]
    assert len(ax.patches) == n * n and len([t for t in ax.texts if t.get_text().startswith("K/V")]) == n * n
    texts = [t.get_text() for t in ax.texts if t.get_text().startswith("K/V")]  # not the arrows
    assert texts[0] == "K/V 0\nslot 0"  # device 0, step 0: its own shard in slot 0
    if n > 1:
        assert texts[n + 1] == "K/V 0\nslot 1"  # device 1, step 1: shard (1 - 1) % n, slot 1
    racy = figures.plot_double_buffer(n, handshake=False)
    marks = [line for line in racy.axes[0].get_lines() if line.get_marker() == "x"]
    assert len(marks) == n * max(n - 2, 0)  # one unordered write per device and step < n - 2
    with pytest.raises(ValueError, match="n_devices"):
        figures.plot_double_buffer(0)


def test_decode_schedules_plots_both_schedules_and_their_ratio():
    fig = figures.plot_decode_schedules([2, 4], {"32K": [4e-6, 8e-6]}, {"32K": [1e-6, 1e-6]}, hardware="(v5e)")
    left, right = fig.axes
    assert len(left.get_lines()) == 2 and np.allclose(left.get_lines()[0].get_ydata(), [4, 8])  # µs
    assert np.allclose(right.get_lines()[0].get_ydata(), [4, 8])
    with pytest.raises(ValueError, match="one per host count"):
        figures.plot_decode_schedules([2, 4], {"32K": [1.0]}, {"32K": [1.0, 1.0]})


def _trace(n_hosts, causal=False, seq=None):
    from ringattn_ref import ring_attention
    x = np.random.default_rng(0).standard_normal((1, seq or 4 * n_hosts, 1, 2))
    return ring_attention(x, x, x, n_hosts=n_hosts, causal=causal, return_trace=True)[1]


@pytest.mark.parametrize("n", [1, 3, 4])
def test_ring_timeline_runs_at_the_slower_of_compute_and_links(n):
    from ringattn_ref.gantt import ring_timeline
    trace = _trace(n)
    t_c, t_x = trace.flops[0, 0], trace.bytes_sent[0, 0] if n > 1 else 0.0
    fast_links = ring_timeline(trace, 1.0, 4.0 * max(t_x, 1))  # transfer = t_x / B < compute = t_c
    assert np.isclose(fast_links.total_s, n * t_c) and np.allclose(fast_links.busy_fraction(), 1.0)
    slow_links = ring_timeline(trace, 1.0, t_x / (3 * t_c) if n > 1 else 1.0)  # transfer = 3 x compute
    assert np.isclose(slow_links.total_s, (n - 1) * 3 * t_c + t_c)
    assert np.all(slow_links.compute_start[:, 1:] >= slow_links.send_end[:, :-1] - 1e-12)  # waits for its block
    with pytest.raises(ValueError, match="flops_per_s"):
        ring_timeline(trace, 0.0, 1.0)


def test_ring_timeline_causal_contiguous_idles_the_first_host():
    from ringattn_ref.gantt import ring_timeline
    tl = ring_timeline(_trace(4, causal=True), 1.0, 1e30)  # free links: only compute and waiting
    busy = tl.busy_fraction()
    assert busy[-1] > 0.99 and busy[0] < 0.3 and np.all(np.diff(busy) > 0)  # host r computes r + 1 hops


def test_ring_gantt_draws_one_bar_per_hop_and_send():
    from ringattn_ref import viz
    trace = _trace(4, causal=True)
    fig = viz.plot_ring_gantt(trace, 1e9, 1e9)
    ax = fig.axes[0]
    n_bars = len(ax.collections)  # one BrokenBarHCollection per bar
    assert n_bars == int((~trace.hop_skipped).sum()) + int((trace.bytes_sent > 0).sum())
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("0") == 4  # block 0 is used by every host under the causal mask
