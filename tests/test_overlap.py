"""``benchmarks/overlap.py``'s reader of scheduled HLO, on a small text (no libtpu): a transfer is hidden when some
compute (a Mosaic kernel, a matmul) runs between its ``collective-permute-start`` and ``-done``. The compiled
ring's own transfers, on 8-chip TPU slices, are checked in tests/test_compile.py (issue 45).
"""
from benchmarks import overlap

HLO = """HloModule m, is_scheduled=true

%kernel_body (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  ROOT %k = f32[8] custom-call(%p), custom_call_target="tpu_custom_call"
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %s0 = (f32[8], f32[8]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %f = f32[8] fusion(%a), kind=kCustom, calls=%kernel_body
  %d0 = f32[8] collective-permute-done(%s0)
  %s1 = (f32[8], f32[8]) collective-permute-start(%f), source_target_pairs={{0,1},{1,0}}
  %d1 = f32[8] collective-permute-done(%s1)
  %c = f32[8] collective-permute(%d1), source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[8] add(%d0, %c)
}
"""


def test_the_parser_reads_hidden_exposed_and_synchronous_transfers():
    ts = {t.start: t for t in overlap.transfers(HLO)}
    assert ts["s0"].hidden and ts["s0"].between == ("f",)
    assert not ts["s1"].hidden and not ts["s1"].synchronous
    assert ts["c"].synchronous and not ts["c"].hidden
    assert overlap.summary(HLO)["hidden"] == 1
