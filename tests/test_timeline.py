"""The profiler timeline (notebooks/ringattn_course/timeline.py): trace parsing, HLO reading, one real
profile of the ring's forward+backward on the 8 simulated devices."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ringattn_course import timeline as tl

HLO = """HloModule jit_loss, entry_computation_layout={()}

%body.1 (param.0: (s32[], f32[4])) -> (s32[], f32[4]) {
  %param.0 = (s32[], f32[4]{0}) parameter(0)
  %gte.1 = f32[4]{0} get-tuple-element(%param.0), index=1
  %gte.0 = s32[] get-tuple-element(%param.0), index=0
  %ppermute.7 = f32[4]{0} collective-permute(%gte.1), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %fusion.3 = f32[4]{0} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  ROOT %tuple.9 = (s32[], f32[4]{0}) tuple(%gte.0, %ppermute.7)
}

ENTRY %main.5 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %cps.1 = (f32[4]{0}, f32[4]{0}) collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}
  %dot.2 = f32[4]{0} fusion(%p), kind=kOutput, calls=%fused_dot
  %cpd.1 = f32[4]{0} collective-permute-done(%cps.1)
  ROOT %add.4 = f32[4]{0} add(%cpd.1, %dot.2)
}
"""


def _event(name, ts, dur, device, module="jit_loss"):
    return {"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": name, "hlo_module": module, "device_ordinal": str(device)}}


def test_hlo_reading():
    assert tl.hlo_opcodes(HLO)["ppermute.7"] == "collective-permute"
    assert tl.collective_ops(HLO) == {"collective-permute": 1, "collective-permute-start": 1,
                                      "collective-permute-done": 1}
    users = tl.collective_users(HLO)
    assert users == {"ppermute.7": ["tuple"]}  # the body's permute only feeds the next iteration
    assert tl.collective_users(HLO, "collective-permute-start") == {"cps.1": ["collective-permute-done"]}


def test_spans_from_events():
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:3"}},
        _event("while.1", 100.0, 50.0, 0),  # control flow: contains the others, dropped
        _event("fusion.3", 110.0, 10.0, 0),
        _event("ppermute.7", 120.0, 30.0, 0),
        _event("fusion.3", 105.0, 5.0, 1),
        _event("fusion.3", 90.0, 5.0, 1, module="jit_other"),  # another program
        {"ph": "X", "pid": 1, "tid": 7, "ts": 130.0, "dur": 0.1, "name": "end: fusion.3", "args": {}},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 140.0, "dur": 2.0, "name": "all-gather.2",
         "args": {"hlo_op": "all-gather.2", "hlo_module": "jit_loss"}},  # a GPU event: device from pid
    ]
    spans = tl.spans_from_events(events, module="jit_loss", opcodes=tl.hlo_opcodes(HLO))
    assert [(s.device, s.kind, s.name, s.start_us, s.dur_us) for s in spans] == [
        (0, "compute", "fusion.3", 5.0, 10.0), (0, "collective", "ppermute.7", 15.0, 30.0),
        (1, "compute", "fusion.3", 0.0, 5.0), (3, "collective", "all-gather.2", 35.0, 2.0)]
    assert len(tl.spans_from_events(events)) == 5  # no module filter: jit_other's op too


def test_overlap_and_busy_time():
    spans = [tl.Span(0, "collective", "p", 0.0, 10.0), tl.Span(0, "compute", "f", 5.0, 10.0),
             tl.Span(0, "compute", "g", 6.0, 2.0), tl.Span(1, "collective", "p", 0.0, 4.0),
             tl.Span(1, "compute", "f", 4.0, 4.0)]
    assert tl.overlap_fraction(spans) == {0: 0.5, 1: 0.0}
    assert tl.busy_time(spans, "compute") == {0: 10.0, 1: 4.0}
    assert tl.busy_time(spans, "collective") == {0: 10.0, 1: 4.0}


_PROFILE_CHILD = """
import pickle, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
from ringattn_course import timeline as tl
n = len(jax.devices())
prof = tl.profile_ring(seq=32 * n, heads=2, kv_heads=1, dim=8, log_dir=sys.argv[1])
pickle.dump((n, jax.default_backend(), prof), open(sys.argv[2], "wb"))
"""


def _profile_in_child(tmp_path):
    """One profile of the ring in a fresh process: after ``jax.profiler.trace`` (JAX 0.12, CPU), a later
    multi-device program with an all-reduce in the *same* process was seen to stall in its rendezvous
    and abort the process (tests/test_training.py after this module), so the profiler never runs here."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), str(root / "notebooks"),
                                                                   os.environ.get("PYTHONPATH")])))
    out = tmp_path / "profile.pkl"
    proc = subprocess.run([sys.executable, "-c", _PROFILE_CHILD, str(tmp_path), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def test_profile_ring_on_8_devices(tmp_path):
    n, backend, prof = _profile_in_child(tmp_path)
    assert n == 8
    assert prof.trace_path.startswith(str(tmp_path)) and prof.module.startswith("jit")
    devices = {s.device for s in prof.spans}
    assert devices == set(range(n))
    for d in devices:
        kinds = [s.kind for s in prof.spans if s.device == d]
        assert kinds.count("collective") >= 2 * (n - 1)  # forward and backward hops
        assert "compute" in kinds
    assert all(s.dur_us >= 0 and s.start_us >= 0 for s in prof.spans)
    ops = tl.collective_ops(prof.hlo_text)
    assert ops.get("collective-permute", 0) + ops.get("collective-permute-start", 0) > 0
    if backend == "cpu":  # the CPU backend runs collectives synchronously
        assert "collective-permute-start" not in ops
    from benchmarks.timeline import summary  # the benchmark's numbers come from the same profile

    numbers = summary(prof)
    assert [row["device"] for row in numbers["per_device"]] == list(range(n))
    users = tl.collective_users(prof.hlo_text).values()
    assert numbers["permutes_feed_only_next_hop"] is all(u == ["tuple"] for u in users)
    fig = tl.plot_timeline(prof.spans, title="test")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [f"device {d}" for d in range(n)]


@pytest.mark.parametrize("bad", ["not a trace", ""])
def test_read_trace_rejects_garbage(tmp_path, bad):
    path = tmp_path / "t.json"
    path.write_text(bad)
    with pytest.raises(ValueError):
        tl.read_trace(path)
