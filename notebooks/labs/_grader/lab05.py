"""Grader of lab 5: the student's Pallas hop kernel, inside the grader's own ``pallas_call``.

The student writes ``hop_kernel``; the grader never calls the student's ``hop_fwd``: the child puts
``hop_kernel`` into ``hop_fwd`` below (the skeleton's, unchanged), so the kernel inside
``pallas_call`` is the student's and it alone computes the output. Child: (1) runs a few hops in the
TPU interpreter with its race detector on and reports what it found; (2) exports the hop for every
example with ``interpret=True`` (plain XLA, traced on shapes). Parent: runs each program on its own
inputs (fixed: causal hops whose host is not the block's, rows and whole hops that see nothing,
logits past float32's ``exp`` range, GQA, b and d > 1, tiles smaller than the shard; plus draws of
hops of every layout) against the float64 hop oracle ``ringattn_ref.hop_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .common import Fail, check_array, check_close, draw, ok

ALLOWED = ()  # jnp, lax, pl and pltpu only
FUNCTIONS = {"hop_kernel": "hop_kernel(q_ref, ..., acc_ref, *, scale, causal) (inside the grader's hop_fwd)"}
EXAMPLES = 4
TOL = 2e-5  # float32 kernel vs float64 oracle; lse relative to its size


@dataclass(frozen=True)
class Hop:
    """Queries at true positions ``rows`` against keys at ``cols``."""
    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    scale: float
    causal: bool
    block_q: int
    block_kv: int

    def __repr__(self):
        return (f"{self.name}(q{self.q.shape}, k{self.k.shape}, q_pos={self.rows.tolist()}, "
                f"k_pos={self.cols.tolist()}, causal={self.causal}, block_q={self.block_q}, block_kv={self.block_kv}, "
                f"max |logit| ~ {np.abs(self.scale * np.einsum('bqhd,bkhd->bqk', self.q[:, :, :1], self.k[:, :, :1])).max():.3g})")


def fixed_hops():
    rng = np.random.default_rng(2405)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    c = 8
    yield Hop("causal, host 2 of 4 against block 0 (contiguous)", f32(2, c, 4, 8), f32(2, c, 2, 8), f32(2, c, 2, 8),
              np.arange(16, 24, dtype=np.int32), np.arange(0, 8, dtype=np.int32), 8 ** -0.5, True, 4, 2)
    yield Hop("causal, host 0 against block 2: every row sees nothing", f32(1, c, 2, 4), f32(1, c, 1, 4),
              f32(1, c, 1, 4), np.arange(0, 8, dtype=np.int32), np.arange(16, 24, dtype=np.int32), 0.5, True, 2, 4)
    striped = np.arange(32).reshape(8, 4).T  # 4 hosts, 32 tokens: host r owns r, r + 4, ...
    yield Hop("causal striped, host 1 against block 3: row 1 sees nothing", f32(2, c, 3, 2), f32(2, c, 1, 2),
              f32(2, c, 1, 2), striped[1].astype(np.int32), striped[3].astype(np.int32), 2 ** -0.5, True, 2, 2)
    big_q, big_k = f32(1, c, 2, 8) * 6, f32(1, c, 2, 8) * 6
    big_k[:, 4:] *= 1.6  # the second K/V tile holds larger logits: the running max must rise
    yield Hop("large logits (past float32's exp range)", big_q, big_k, f32(1, c, 2, 8), np.arange(8, 16, dtype=np.int32),
              np.arange(0, 8, dtype=np.int32), 8 ** -0.5, False, 8, 4)
    yield Hop("large logits, causal, diagonal block", big_q, big_k, f32(1, c, 2, 8), np.arange(8, 16, dtype=np.int32),
              np.arange(8, 16, dtype=np.int32), 8 ** -0.5, True, 4, 4)


def drawn_hops():
    from hypothesis import strategies as st
    from ringattn_ref.layouts import layout_permutation
    from ringattn_ref.testing import attention_problems
    from ringattn_ref.validation import check_scale

    @st.composite
    def hops(draw_):
        p = draw_(attention_problems(max_hosts=4, max_shard=8, max_dim=8, segment_ids=False, bias=False,
                                     window=False, masked_rows=False, dtype=np.float32))
        return p, draw_(st.integers(0, p.n_hosts - 1)), draw_(st.integers(0, p.n_hosts - 1))

    for p, host, block in draw(hops(), EXAMPLES):
        s, c = p.q.shape[1], p.q.shape[1] // p.n_hosts
        perm = layout_permutation(p.layout, s, p.n_hosts).astype(np.int32)
        rows, cols = perm[host * c:(host + 1) * c], perm[block * c:(block + 1) * c]
        yield Hop(f"drawn {p!r}, host {host} against shard {block}", p.q[:, rows], p.k[:, cols], p.v[:, cols], rows,
                  cols, check_scale(p.scale, p.q.shape[-1]), p.causal, p.block_q, p.block_kv)


def _params(hop):
    return dict(shapes=[list(x.shape) for x in (hop.q, hop.k, hop.v, hop.rows, hop.cols)], scale=float(hop.scale),
                causal=hop.causal, block_q=hop.block_q, block_kv=hop.block_kv, example=repr(hop))


def build(tasks):
    hops = list(fixed_hops()) + list(drawn_hops())
    race = [(h, tasks.add("race", dict(q=h.q, k=h.k, v=h.v, rows=h.rows, cols=h.cols), **_params(h)))
            for h in (hops[0], hops[2])]
    plan = [(h, tasks.add("export", **_params(h))) for h in hops]

    def verify(results):
        from ringattn_ref.blockwise import hop_attention
        from ringattn_ref.shards import HopConfig, KVShard, QShard

        from .programs import Program

        for h, task in race:
            if bool(results.arrays(task).get("races", np.ones(()))):
                raise Fail(f"property 'the race detector reports nothing' failed on example {h!r}: the TPU interpreter "
                           f"found a race (a buffer read or written while a DMA into or out of it was still in "
                           f"flight?)")
        ok("the TPU interpreter's race detector reports nothing", len(race))
        for h, task in plan:
            prog = Program(results.blob(task), "hop_kernel (in the grader's hop_fwd)", 1, h)
            o, lse = (prog(h.q, h.k, h.v, h.rows, h.cols) + [None, None])[:2]
            b, c, heads, d = h.q.shape
            o = check_array("hop_fwd's o", o, (b, c, heads, d), np.float32, h)
            lse = check_array("hop_fwd's lse", lse, (b, heads, c), np.float32, h)
            want_o, want_lse = hop_attention(QShard(h.q, h.rows[None]), KVShard(h.k, h.v, h.cols[None]),
                                             HopConfig(scale=h.scale, causal=h.causal))
            if np.isnan(o).any() or np.isnan(lse).any():
                raise Fail(f"property 'no NaN' failed on example {h!r}: o has {int(np.isnan(o).sum())} NaN, lse "
                           f"{int(np.isnan(lse).sum())}")
            empty = np.isneginf(want_lse)  # (b, h, c): rows that see no key of this shard
            if empty.any() and (np.abs(o[np.transpose(empty, (0, 2, 1))]).max() != 0 or not np.isneginf(lse[empty]).all()):
                raise Fail(f"property 'a row that sees nothing gives o = 0, lse = -inf' failed on example {h!r}: "
                           f"{int(empty.sum())} such rows")
            check_close("o", o, want_o, TOL, "o matches the float64 hop oracle", h)
            scale = max(1.0, float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1.0)))
            check_close("lse", lse, want_lse, TOL * scale, "lse matches the float64 hop oracle", h)
        ok("o, lse match the float64 hop oracle: true positions, empty rows 0 / -inf, large logits, no NaN", len(plan))
        return f"the hop kernel matches ringattn_ref.hop_attention on {len(plan)} hops"

    return verify


# ---- the grader's hop_fwd (the skeleton's, with the kernel as an argument) and the child side ----------------

def hop_fwd(kernel, q, k, v, q_pos, k_pos, *, scale, causal, block_q, block_kv, interpret):
    """One hop: o float32 [b, sq, h, d], lse float32 [b, h, sq], computed by ``kernel`` over the grid
    ``(batch, heads, sq // block_q, sk // block_kv)`` (the skeleton's ``hop_fwd``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    qt, kt, vt = (x.swapaxes(1, 2) for x in (q, k, v))  # heads-major: (b, heads, s, d)
    q_tile = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    kv_tile = pl.BlockSpec((None, None, block_kv, d), lambda bi, hi, i, j: (bi, hi // group, j, 0))
    o, lse = pl.pallas_call(
        partial(kernel, scale=scale, causal=causal),
        grid=(b, h, sq // block_q, sk // block_kv),
        in_specs=[q_tile, kv_tile, kv_tile, pl.BlockSpec((block_q,), lambda bi, hi, i, j: (i,)),
                  pl.BlockSpec((block_kv,), lambda bi, hi, i, j: (j,))],
        out_specs=[q_tile, pl.BlockSpec((None, None, block_q), lambda bi, hi, i, j: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct((b, h, sq, d), jnp.float32), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                        pltpu.VMEM((block_q, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(qt, kt, vt, q_pos, k_pos)
    return o.swapaxes(1, 2), lse


def _static(params):
    return dict(scale=params["scale"], causal=params["causal"], block_q=params["block_q"], block_kv=params["block_kv"])


def _race(sol, a, params):
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from ringattn_fast.kernels.races import races_found  # the one home of the private race flag

    kernel = sol.function("hop_kernel", FUNCTIONS["hop_kernel"])
    run = partial(hop_fwd, kernel, **_static(params), interpret=pltpu.InterpretParams(detect_races=True,
                                                                                      on_race="warn"))
    sol.call("hop_kernel (in the race detector)", lambda: jax.block_until_ready(
        run(a["q"], a["k"], a["v"], a["rows"], a["cols"])), example=params["example"])
    return {"races": np.array(bool(races_found()))}


def _export(sol, a, params):
    import jax

    from .child import export

    kernel = sol.function("hop_kernel", FUNCTIONS["hop_kernel"])
    prog = jax.jit(partial(hop_fwd, kernel, **_static(params), interpret=True))
    dtypes = (np.float32,) * 3 + (np.int32,) * 2
    return sol.call("hop_kernel", lambda: export(prog, list(zip(params["shapes"], dtypes))), example=params["example"])


CHILD = {"race": _race, "export": _export}
