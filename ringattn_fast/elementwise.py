"""The elementwise contract of ``mask_fn`` / ``score_fn``: each (query, key) pair's value depends on that pair only.

The ring evaluates a user function per tile (per hop, per kernel tile), never on the whole ``T x S`` grid
at once, so a function whose value at one pair depends on other pairs (a reduction such as
``s.max(-1)`` or ``q_pos.max()``, a cumulative op, a sort, a matmul, a gather or slice that reads other
pairs' values) sees a tile instead of the row and is silently wrong. :func:`first_cross_pair_op` reads the
function's jaxpr and names the first operation that mixes pairs; ``front.check_user_fns`` refuses it.

What is allowed (an allow-list: a primitive not named below, applied to values computed from the
arguments, is refused, so a new or rare primitive such as ``split``, ``searchsorted`` or ``approx_top_k``
cannot slip through): the elementwise ops of :data:`ELEMENTWISE` (arithmetic, comparisons, logic,
``where``, casts, transcendental functions), broadcasting and reshapes of the arguments, constants, calls
(``jit``, ``custom_jvp``, ``cond``) whose bodies obey the same rule, and reading a *constant* array (a
closure over a concrete jnp or numpy table) at indices computed from the arguments (``table[k_pos]``: a
gather whose operand is the constant). A slice, split or gather that reads an argument across pairs is
refused. The check is by primitive, not by axis: an elementwise maximum written as a reduction over a
stacked axis (``jnp.stack([a, b]).max(0)``) is refused too; write ``jnp.maximum(a, b)``.
"""
from __future__ import annotations

# Primitives whose every output element depends on the same element of each operand (or that only
# broadcast, reshape or relabel it), by their names in JAX 0.10-0.12.
ELEMENTWISE = frozenset({
    # arithmetic and comparisons
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "neg", "sign", "abs",
    "floor", "ceil", "round", "nextafter", "square", "sqrt", "rsqrt", "cbrt", "clamp", "eq", "ne", "lt", "le",
    "gt", "ge", "eq_to", "lt_to", "le_to", "is_finite", "select_n", "mulhi",
    # logic and bits
    "and", "or", "xor", "not", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "clz",
    # transcendental
    "exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos",
    "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "one_minus_square", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "polygamma", "zeta", "igamma", "igammac", "igamma_grad_a", "regularized_incomplete_beta",
    "bessel_i0e", "bessel_i1e", "real", "imag", "conj", "complex",
    # dtypes, shapes and annotations
    "convert_element_type", "bitcast_convert_type", "reduce_precision", "copy", "copy_p", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "stop_gradient", "sharding_constraint", "pvary", "pcast",
    "optimization_barrier",
})
# Primitives that read their first operand at positions: fine on a constant table, mixing on the arguments
# (``searchsorted`` of a position into a constant sorted array, ``variants.documents``, reads it so).
READING = frozenset({"gather", "dynamic_slice", "slice", "split", "searchsorted"})
# Call-like primitives: their bodies (sub-jaxprs) are checked instead. Loops are checked apart
# (`_loop_bodies`): a ``scan`` over an argument's axis mixes pairs and is refused.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", "remat", "checkpoint", "cond", "custom_lin"})


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
    """A static slice (or split) that drops part of an axis of size > 1 reads other pairs' values."""
    x = eqn.invars[0]
    return any(n > 1 and m != n for out in eqn.outvars for n, m in zip(x.aval.shape, out.aval.shape))


def _name(eqn):
    """The primitive's name; for JAX 0.12's generic ``call_hi_primitive``, the name of the op it wraps
    (``jnp.searchsorted`` is one: ``SearchSorted``)."""
    name = eqn.primitive.name
    wrapped = eqn.params.get("_prim") if name == "call_hi_primitive" else None
    return name if wrapped is None else type(wrapped).__name__.lower()


def _loop_bodies(eqn, ins):
    """``[(jaxpr, dependent flags of its inputs)]`` of a loop whose iterations do not walk an axis of an
    argument (a ``while``, a ``scan`` with no ``xs``: JAX 0.10's ``jnp.searchsorted`` is a binary search
    so), else None. A carry counts as computed from the arguments whenever any input is."""
    name, carry = eqn.primitive.name, any(ins)
    if name == "scan":
        consts, carried = eqn.params["num_consts"], eqn.params["num_carry"]
        if len(eqn.invars) != consts + carried:
            return None  # it scans over xs: an axis of its operand, pair by pair
        return [(eqn.params["jaxpr"].jaxpr, list(ins[:consts]) + [carry] * carried)]
    if name == "while":
        nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        rest = [carry] * (len(ins) - nc - nb)
        return [(eqn.params["cond_jaxpr"].jaxpr, list(ins[:nc]) + rest),
                (eqn.params["body_jaxpr"].jaxpr, list(ins[nc:nc + nb]) + rest)]
    return None


def first_cross_pair_op(jaxpr, dependent=None):
    """The name of the first operation of ``jaxpr`` (a ``jax.core.Jaxpr``) that mixes pairs of values
    computed from its inputs (``dependent``: which invars count, default all), or None."""
    dep = {id(v) for v, d in zip(jaxpr.invars, dependent or [True] * len(jaxpr.invars)) if d}
    for eqn in jaxpr.eqns:
        ins = [not _is_literal(v) and id(v) in dep for v in eqn.invars]
        name = _name(eqn)
        if any(ins):
            loops = _loop_bodies(eqn, ins)
            if loops is not None:
                found = next((f for body, flags in loops if (f := first_cross_pair_op(body, flags))), None)
                if found:
                    return found
            elif name in READING:
                if ins[0] and (name not in ("slice", "split") or _slice_mixes(eqn)):
                    return name
            elif name not in ELEMENTWISE and name not in CALLS:
                return name
            for sub, _ in _sub_jaxprs(eqn) if name in CALLS else ():
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
