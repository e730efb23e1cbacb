"""The elementwise contract of ``mask_fn`` / ``score_fn``: each (query, key) pair's value depends on that pair only.

The ring evaluates a user function per tile (per hop, per kernel tile), never on the whole ``T x S`` grid
at once, so a function whose value at one pair depends on other pairs (a reduction such as
``s.max(-1)`` or ``q_pos.max()``, a cumulative op, a sort, a matmul, a gather or slice that reads other
pairs' values) sees a tile instead of the row and is silently wrong. :func:`first_cross_pair_op` reads the
function's jaxpr and names the first operation that mixes pairs; ``front.check_user_fns`` refuses it.

What is allowed: every elementwise op, broadcasting, reshapes of the arguments, constants, and reading a
*constant* array (a closure over a concrete jnp or numpy table) at indices computed from the arguments
(``table[k_pos]``: a gather whose operand is the constant). What is refused: the primitives below applied
to anything computed from the arguments, and a slice / gather that reads such an array across pairs.
"""
from __future__ import annotations

# Primitives that combine several elements of an operand into one (or move them between positions).
MIXING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
    "dot_general", "conv_general_dilated", "fft", "rev", "transpose", "reduce_window", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "scatter", "scatter-add", "scatter_add", "scatter_mul",
    "scatter_min", "scatter_max", "dynamic_update_slice", "concatenate", "pad", "psum", "all_gather",
})
# Primitives that read an operand at positions: fine on a constant table, mixing on the arguments.
READING = frozenset({"gather", "dynamic_slice", "slice"})


def _is_jaxpr(x):
    # duck-typed: importing jax.extend.core would import Pallas with it (`import ringattn_fast` imports none)
    return hasattr(x, "eqns") and hasattr(x, "invars") and hasattr(x, "outvars")


def _is_literal(v):
    return type(v).__name__ == "Literal"


def _sub_jaxprs(eqn):
    """The (jaxpr, its input vars bound to eqn.invars) pairs of a call-like equation (pjit, custom_jvp, cond...)."""
    for name, value in eqn.params.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            jaxpr = getattr(v, "jaxpr", v)
            if _is_jaxpr(jaxpr):
                yield jaxpr, name


def _slice_mixes(eqn):
    """A static slice that drops part of an axis of size > 1 reads other pairs' values."""
    (x,), (out,) = eqn.invars, eqn.outvars
    return any(n > 1 and m != n for n, m in zip(x.aval.shape, out.aval.shape))


def first_cross_pair_op(jaxpr, dependent=None):
    """The name of the first operation of ``jaxpr`` (a ``jax.core.Jaxpr``) that mixes pairs of values
    computed from its inputs (``dependent``: which invars count, default all), or None."""
    dep = {id(v) for v, d in zip(jaxpr.invars, dependent or [True] * len(jaxpr.invars)) if d}
    for eqn in jaxpr.eqns:
        ins = [not _is_literal(v) and id(v) in dep for v in eqn.invars]
        name = eqn.primitive.name
        if any(ins):
            if name in MIXING:
                return name
            if name in READING and ins[0] and (name != "slice" or _slice_mixes(eqn)):
                return name
            for sub, _ in _sub_jaxprs(eqn):
                if len(sub.invars) == len(eqn.invars):
                    found = first_cross_pair_op(sub, ins)
                elif len(sub.invars) < len(eqn.invars):  # cond: the predicate comes first
                    found = first_cross_pair_op(sub, ins[len(eqn.invars) - len(sub.invars):])
                else:
                    found = first_cross_pair_op(sub)
                if found:
                    return found
            dep.update(id(v) for v in eqn.outvars)
    return None
