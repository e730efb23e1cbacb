"""ringattn_course.schedules: notebook 06's saved v5e schedules read as benchmarks/overlap.py wrote them, and
figures.plot_schedule draws every transfer of them (no libtpu: the compile itself is tests/test_compile.py's)."""
import pytest

from ringattn_course import schedules


@pytest.mark.parametrize("name", sorted(schedules.SAVED))
def test_saved_schedules_are_the_case_and_counts_they_claim(name):
    sched = schedules.load(name)
    assert (sched["target"], sched["impl"], sched["causal"], sched["chips"]) == ("v5e", "pallas_tpu", False, 8)
    assert [c["role"] for c in sched["computations"]] == list(schedules.ROLES)
    assert schedules.counts(sched) == {d: sched["summary"][d] for d in ("fwd", "bwd")}
    assert len(schedules.transfers(sched)) == sched["summary"]["transfers"]
    for t in schedules.transfers(sched):  # each done after its start, once
        events = schedules.computation(sched, t.role)["events"]
        assert t.start < t.done and [e.get("id") for e in events].count(t.event["id"]) == 2
    assert all("hidden" not in e for c in sched["computations"] for e in schedules.without_flags(c["events"]))


def test_before_exposes_the_backward_and_after_hides_it():
    before, after = schedules.load("before"), schedules.load("after")
    assert before["summary"]["bwd"][1] == 0 < before["summary"]["bwd"][0]
    assert after["summary"]["hidden"] == after["summary"]["transfers"] > 0


def test_bad_names_raise():
    with pytest.raises(ValueError, match="name must be one of"):
        schedules.load("during")
    with pytest.raises(ValueError, match="role must be one of"):
        schedules.computation(schedules.load("before"), "backward")


def test_plot_schedule_draws_a_bar_per_transfer_coloured_by_its_flag():
    pytest.importorskip("matplotlib")
    from ringattn_course import figures

    before, after = schedules.load("before"), schedules.load("after")
    fig = figures.plot_schedule({"before": before, "after": after})
    assert len(fig.axes) == 2 * len(schedules.ROLES)
    for col, sched in enumerate((before, after)):
        for row, role in enumerate(schedules.ROLES):
            ax = fig.axes[row * 2 + col]
            colours = [tuple(c.get_facecolor()[0][:3]) for c in ax.collections]
            for hidden, colour in figures.TRANSFER_COLOR.items():
                want = sum(t.hidden == hidden for t in schedules.transfers(sched, role))
                rgb = tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
                assert sum(all(abs(a - b) < 1e-6 for a, b in zip(c, rgb)) for c in colours) == want
    with pytest.raises(ValueError, match="at least one"):
        figures.plot_schedule({})
