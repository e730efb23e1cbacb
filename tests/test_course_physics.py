"""ringattn_course.physics (roofline, alpha-beta) and hlo.collective_messages: the formulas, their agreement
with ringattn_ref's cost models where they overlap, the bytes of compiled collectives, and bad input."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringattn_fast
import ringattn_ref
from ringattn_course import hlo, physics
from ringattn_ref import cost

V5E = physics.CHIPS["TPU v5e"]


def test_chips_extend_table2_with_hbm_and_latency():
    assert set(physics.CHIPS) == set(cost.HARDWARE)
    for name, chip in physics.CHIPS.items():
        hw = cost.HARDWARE[name]
        assert (chip.flops_per_s, chip.link_bytes_per_s) == (hw.flops_per_s, hw.bandwidth_bytes_per_s)
        assert chip.hbm_bytes_per_s > 2 * chip.link_bytes_per_s and chip.latency_s > 0
    assert math.isclose(V5E.ridge, 196e12 / 819e9) and math.isclose(V5E.hbm_bytes_per_s / V5E.link_bytes_per_s, 4.403,
                                                                   rel_tol=1e-3)
    assert V5E.with_latency(0).latency_s == 0 and physics.chip("TPU v5e") is V5E


def test_attention_flops_bytes_and_the_roofline():
    flops, hbm = physics.attention_flops_bytes(4096, 4096, dim=128, heads=1)
    assert flops == 4 * 4096**2 * 128 and hbm == 2 * 128 * (2 * 4096 + 2 * 4096)  # intensity c / 2
    f_gqa, b_gqa = physics.attention_flops_bytes(256, 256, dim=128, heads=32, kv_heads=8, batch=2, dtype_bytes=4)
    assert f_gqa == 4 * 2 * 32 * 256**2 * 128 and b_gqa == 4 * 2 * 128 * (2 * 32 * 256 + 2 * 8 * 256)
    f_mat, b_mat = physics.attention_flops_bytes(4096, 4096, dim=128, heads=1, materialized=True)
    assert f_mat == flops and b_mat == hbm + 4 * 2 * 4096**2 and 60 < f_mat / b_mat < 64      # -> d / 2
    decode = physics.attention_flops_bytes(1, 4096, dim=128, heads=1)
    assert physics.bound(*decode, V5E) == "memory" and physics.bound(flops, hbm, V5E) == "compute"
    assert physics.roofline_s(flops, hbm, V5E) == flops / V5E.flops_per_s
    assert physics.roofline_s(*decode, V5E) == decode[1] / V5E.hbm_bytes_per_s


def test_messages_and_collectives():
    n = 2**20
    assert physics.message_s(0, V5E) == 0 and physics.message_s(n, V5E) == 1e-6 + n / 186e9
    one = lambda size: physics.message_s(size, V5E)  # noqa: E731
    assert physics.collective_s("ppermute", n, 8, V5E) == one(n)
    assert math.isclose(physics.collective_s("all-gather", n, 8, V5E), 7 * one(n))
    assert math.isclose(physics.collective_s("reduce-scatter", n, 8, V5E), 7 * one(n / 8))
    assert math.isclose(physics.collective_s("all-to-all", n, 8, V5E), 7 * one(n / 8))
    assert math.isclose(physics.collective_s("tree-reduce", n, 5, V5E), 3 * one(n))
    assert math.isclose(physics.collective_s("all-reduce", 4, 64, V5E), 2 * 6 * one(4))           # small: tree
    assert math.isclose(physics.collective_s("all-reduce", 2**30, 8, V5E), 14 * one(2**30 / 8))  # large: ring
    assert all(physics.collective_s(kind, n, 1, V5E) == 0 for kind in physics.COLLECTIVES)


def test_ring_and_strategies_agree_with_the_bandwidth_only_models_when_latency_is_zero():
    chip = V5E.with_latency(0)
    for seq, devices in ((2**17, 8), (2**16, 4)):
        costs = ringattn_ref.strategy_costs(seq=seq, heads=8, kv_heads=8, dim=128, devices=devices, hardware="TPU v5e")
        assert math.isclose(physics.ring_s(seq, devices, chip, dim=128, heads=8), costs["ring"].time_s, rel_tol=1e-9)
        times = physics.strategy_times(costs, devices, chip)
        assert all(math.isclose(times[k], c.time_s, rel_tol=1e-12) for k, c in costs.items())
        with_alpha = physics.strategy_times(costs, devices, V5E)
        assert all(with_alpha[k] >= times[k] for k in costs)


def test_min_block_is_the_papers_bound_without_latency_and_larger_with_it():
    for name, chip in physics.CHIPS.items():
        paper = cost.min_block_size(chip.flops_per_s, chip.link_bytes_per_s)
        assert math.isclose(physics.min_block(chip.with_latency(0), dim=128, heads=1), paper, rel_tol=1e-6), name
        assert physics.min_block(chip, dim=128, heads=1) > paper
    compute, transfer = physics.ring_step_s(physics.min_block(V5E, dim=128, heads=32, kv_heads=8), V5E, dim=128,
                                            heads=32, kv_heads=8)
    assert math.isclose(compute, transfer, rel_tol=1e-6)


def test_decode_is_memory_bound_and_the_reduction_wins():
    t = physics.decode_s(2**20, 64, V5E, dim=128, heads=1)
    c = 2**20 / 64
    assert math.isclose(t.local_s, (4 * 128 + 4 * c * 128) / V5E.hbm_bytes_per_s)  # q, o; K, V of c tokens
    assert math.isclose(t.ring_s, 63 * (1e-6 + 4 * c * 128 / 186e9) + t.local_s)
    assert math.isclose(t.tree_s, t.local_s + 6 * physics.message_s(129 * 4, V5E))
    assert t.local_s < t.tree_s < t.allreduce_s < t.ring_s and 100 < t.ring_s / t.tree_s < 500


@pytest.mark.parametrize("call, match", [
    (lambda: physics.chip("TPU v9"), "chip must be"),
    (lambda: physics.collective_s("broadcast", 1, 2, V5E), "kind must be"),
    (lambda: physics.collective_s("ppermute", 1, 0, V5E), "devices must be"),
    (lambda: physics.collective_s("ppermute", 1, 2.5, V5E), "devices must be"),
    (lambda: physics.message_s(-1, V5E), "nbytes must be"),
    (lambda: physics.attention_flops_bytes(0, 4, dim=8, heads=1), "q_rows must be"),
    (lambda: physics.attention_flops_bytes(4, 4, dim=8, heads=True), "heads must be"),
    (lambda: physics.roofline_s(float("nan"), 1, V5E), "flops must be"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_collective_messages_read_operand_bytes_of_compiled_collectives():
    mesh = ringattn_fast.make_mesh(4)

    def per_device(x, y):
        sent = jax.lax.ppermute(x, "sp", [(i, (i + 1) % 4) for i in range(4)])
        return sent, jax.lax.all_gather(y, "sp"), jax.lax.psum(y, "sp")

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P("sp"), jax.P("sp")),
                              out_specs=(jax.P("sp"), jax.P(), jax.P()), check_vma=False))
    text = f.lower(jnp.zeros((4, 3, 5), jnp.float32), jnp.zeros((4, 7), jnp.int32)).compile().as_text()
    got = sorted((m.opcode, m.nbytes) for m in hlo.collective_messages(text))
    assert got == [("all-gather", 28), ("all-reduce", 28), ("collective-permute", 60)]  # operands, not results


def test_shape_bytes():
    assert hlo.shape_bytes("f32[1,32,2,16]{3,2,1,0}") == 4096
    assert hlo.shape_bytes("(bf16[4]{0}, s32[1,32]{1,0})") == 8 + 128 and hlo.shape_bytes("f32[]") == 4
    with pytest.raises(ValueError, match="unknown HLO element type"):
        hlo.shape_bytes("q7[4]")


def test_roofline_figure():
    pytest.importorskip("matplotlib")
    from ringattn_course import figures

    fig = figures.plot_roofline([V5E], {"hop": physics.attention_flops_bytes(512, 512, dim=128, heads=1)})
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 3 and np.isclose(ax.get_lines()[-1].get_xdata()[0], 256)  # roof, ridge, point
    with pytest.raises(ValueError, match="at least one chip"):
        figures.plot_roofline([], {"hop": (1, 1)})
