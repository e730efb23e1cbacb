"""ringattn_course.hlo: reads which collective-permutes a loop body could overlap with its compute."""
from ringattn_course import hlo

BODY = """HloModule m

%body (p: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %p = (f32[4]{0}, f32[4]{0}) parameter(0)
  %kv = f32[4]{0} get-tuple-element(%p), index=0
  %acc = f32[4]{0} get-tuple-element(%p), index=1
  %copy.1 = f32[4]{0} copy(%kv)
  %sent = f32[4]{0} collective-permute(%copy.1), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %hop = f32[4]{0} fusion(%copy.1, %acc), kind=kLoop, calls=%fused
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%sent, %hop)
}

%serial (p: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %p = (f32[4]{0}, f32[4]{0}) parameter(0)
  %kv = f32[4]{0} get-tuple-element(%p), index=0
  %acc = f32[4]{0} get-tuple-element(%p), index=1
  %grad = f32[4]{0} add(%kv, %acc)
  %sent = f32[4]{0} collective-permute(%grad), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %hop = f32[4]{0} multiply(%sent, %acc)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%sent, %hop)
}

ENTRY %main (a: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %a = (f32[4]{0}, f32[4]{0}) parameter(0)
  %w = (f32[4]{0}, f32[4]{0}) while(%a), condition=%cond, body=%body
  ROOT %w2 = (f32[4]{0}, f32[4]{0}) while(%w), condition=%cond, body=%serial
}
"""


def test_a_send_from_the_carry_that_only_the_next_step_needs_can_overlap():
    deps = {d.computation: d for d in hlo.loop_permutes(BODY)}
    assert set(deps) == {"body", "serial"} and hlo.while_bodies(BODY) == {"body", "serial"}
    assert deps["body"].can_overlap and deps["body"].computed_from == () and deps["body"].awaited_by == ()


def test_a_send_of_computed_data_that_the_step_waits_for_cannot():
    serial = next(d for d in hlo.permute_deps(BODY) if d.computation == "serial")
    assert not serial.can_overlap
    assert serial.computed_from == ("grad",) and serial.awaited_by == ("hop",)
