"""The fused TPU ring hides its transfers, read from its own program (issue 45): ``benchmarks/fused_overlap.py``
lowers the fused ring's forward+backward for 4 abstract v5e chips (no chip, no libtpu; ~1.5 s each), decodes the
Mosaic module of each kernel and checks, in the one ring step that the kernel's body is, that the remote copy of
the K/V (and key positions) the next hop reads starts before every matmul of the step and is waited on (send and
receive) after all of them; that the backward's dK/dV copies fly under compute; and that a control ring whose
copies are waited on at their start reads as nothing hidden. The reader's ordering rules are checked on paths
written by hand.
"""
import pytest

from benchmarks import fused_overlap as fo
from benchmarks.fused_overlap import Step


def _by_dtype(row):
    kv = [c for c in row["copies"] if "xf32" not in c["buffer"]]
    dkv = [c for c in row["copies"] if "xf32" in c["buffer"]]
    return kv, dkv


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_the_next_hops_copy_flies_under_the_hops_compute(whole):
    """Forward and backward, each kernel form: K/V and key positions sent before the step's first matmul and
    waited on after its last; dK/dV sent under the next heads' compute (one pass: each (batch row, kv head)'s
    dK/dV leaves when that head is done, all waited on at the step's end) or under pass A (two passes: pass B's
    matmuls make what is sent, so they come before)."""
    rows = {r["kernel"]: r for r in fo.check("v5e", whole=whole)}
    bwd = "ring_fused_bwd_one_pass_tpu" if whole else "ring_fused_bwd_tpu"
    assert set(rows) == {"ring_fused_fwd_tpu", bwd}
    for name, row in rows.items():
        assert row["ok"], row
        assert row["steps"] == [4] and row["matmuls"] > 0
        kv, dkv = _by_dtype(row)
        assert len(kv) == 2  # stack(K, V) and the key positions
        for c in kv:
            assert (c["before"], c["under"], c["carried"], c["after"]) == (0, row["matmuls"], 0, 0), (name, c)
            assert c["waits"] == ["send", "recv"]
        if name == "ring_fused_fwd_tpu":
            assert not dkv  # nothing else travels forward
            continue
        (c,) = dkv
        assert c["after"] == 0 and set(c["waits"]) == {"send", "recv"}
        if whole:  # dK and dV of each head, in a loop (JAX 0.10 lowers it as two scf.for: the first's flies under both)
            assert c["starts"] >= 2 and c["carried"] > 0 and c["before"] == 0, c
            assert c["carried"] + c["under"] == row["matmuls"], c
        else:
            assert c["before"] > 0 and c["under"] > 0 and c["before"] + c["under"] == row["matmuls"], c


def test_the_control_ring_hides_nothing():
    """The same kernels with every remote copy waited on as soon as it starts (``fused_overlap.serialized``):
    the reader finds no matmul under any copy; the K/V copies' matmuls all come after their waits."""
    rows = fo.check("v5e", whole=True, control=True)
    assert len(rows) == 2 and all(r["ok"] for r in rows)
    for row in rows:
        for c in row["copies"]:
            assert c["under"] == c["carried"] == 0, (row["kernel"], c)
        for c in _by_dtype(row)[0]:
            assert c["after"] == row["matmuls"] > 0


def _path(*steps):
    """A path from (index, region, loop) triples; the last one is the op itself (region None)."""
    return tuple(Step(i, r, loop) for i, r, loop in steps)


def test_the_reader_orders_paths_through_branches_and_loops():
    """Program order on paths by hand: an op in a later top-level op runs after; the two branches of an
    ``scf.if`` are unordered; a matmul before a start inside a loop that holds the start but not the wait
    runs again in the loop's later iterations (``carried``); with the wait in the same loop it does not."""
    start_top, wait_top = _path((1, None, False)), _path((5, None, False))
    in_if = _path((3, (0, 0), False), (0, None, False))
    assert fo.order(start_top, in_if) == (-1, 0) and fo.order(in_if, wait_top) == (-1, 0)
    then, other = _path((3, (0, 0), False), (2, None, False)), _path((3, (1, 0), False), (0, None, False))
    assert fo.order(then, other) == (None, 0)

    loop = lambda *rest: _path((2, (0, 0), True), *rest)  # noqa: E731  an scf.for at index 2
    mm, start, wait_in_loop = loop((1, None, False)), loop((4, None, False)), loop((5, None, False))
    carried = fo._copy("b", [("start", start), ("send", wait_top)], [mm])
    assert (carried.carried, carried.before, carried.hidden) == (1, 0, True)
    serial = fo._copy("b", [("start", start), ("send", wait_in_loop)], [mm])
    assert (serial.before, serial.hidden) == (1, False)
    plain = fo._copy("b", [("start", start_top), ("recv", wait_top)], [in_if, then, _path((7, None, False))])
    assert (plain.under, plain.after, plain.waits) == (2, 1, ("recv",))
    unwaited = fo._copy("b", [("send", start_top), ("start", wait_top)], [in_if])
    assert not unwaited.waited and not unwaited.hidden
