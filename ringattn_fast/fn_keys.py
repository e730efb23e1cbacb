"""Equal user functions share one compiled program: ``mask_fn`` / ``score_fn`` keyed by code and closure values.

Every cache on the way to a compiled ring (``front.cached``'s jitted ``shard_map``, the block-mask
tables of ``block_mask.tables``, ``jax.jit``'s own) keys a function by identity, as ``jax.jit`` does. So
``prefix_lm(8)`` called anew for every step, equal code and equal closure values, compiled afresh each
time (about a second per eager call, against milliseconds for a reused function) and grew the caches.
:func:`canonical` maps a function to the first one seen with the same key: its code object, its
module's globals, its defaults and the values of its closure (numbers, strings, tuples, None,
concrete numpy / jax arrays by dtype, shape and bytes, and nested functions by their own key). A
closure over anything else (an object of the caller's) keys by that object's identity, so nothing is
shared that might differ.

The same function object keeps its first compiled program, as with ``jax.jit``: a closure over a
numpy table mutated in place between calls sees the table it was first called with (its key at the
first call is kept, by a weak reference to the function; a new function object, or a copy of the
table, sees the new values). :data:`MAX_FUNCTIONS` keys are kept, least
recently used dropped first; the caches downstream are bounded on their own (``front._MAPPED_MAX``
programs, ``block_mask.tables``' 32 tables). The function kept has the numpy arrays of its closure, and
of the module globals it reads, as ``jnp`` arrays (:func:`traceable`), so ``table[k_pos]`` works under
``jit`` as it does eagerly.
"""
from __future__ import annotations

import collections
import hashlib
import threading
import types
import weakref

import numpy as np

MAX_FUNCTIONS = 256
_SEEN = collections.OrderedDict()  # key -> the first function seen with it
_KEY_OF = weakref.WeakKeyDictionary()  # function object -> its key at its first call (what it keeps)
_LOCK = threading.Lock()


def _value_key(x, depth=0):
    """A hashable key of a closure value, by value where that is safe, else by identity."""
    if depth > 8:
        return ("id", id(x))
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return (type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_value_key(v, depth + 1) for v in x)
    if callable(x) and getattr(x, "__code__", None) is not None:
        return ("fn", function_key(x, depth + 1))
    if isinstance(x, np.generic) or hasattr(x, "__array__") and hasattr(x, "dtype") and hasattr(x, "shape"):
        try:
            a = np.asarray(x)
        except Exception:  # noqa: BLE001 - a tracer or an array that cannot be read: identity
            return ("id", id(x))
        return ("array", a.dtype.str, a.shape, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest())
    return ("id", id(x))


def function_key(fn, depth=0):
    """The key :func:`canonical` compares: code, globals (and the numpy arrays ``fn`` reads from them, by value),
    defaults and closure values of ``fn``."""
    cells = getattr(fn, "__closure__", None) or ()
    try:
        values = tuple(_value_key(c.cell_contents, depth) for c in cells)
    except ValueError:  # an empty cell (a function defined before its closure variable is set)
        return ("id", id(fn))
    tables = tuple((name, _value_key(fn.__globals__[name], depth)) for name in sorted(_global_names(fn.__code__))
                   if isinstance(fn.__globals__.get(name), np.ndarray))  # read as jnp copies (`traceable`)
    return (fn.__code__, id(fn.__globals__), _value_key(fn.__defaults__, depth),
            _value_key(tuple(sorted((fn.__kwdefaults__ or {}).items())), depth), values, tables)


def _global_names(code):
    """The global names ``code`` and the functions defined inside it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def traceable(fn):
    """``fn`` with each numpy array of its closure, its defaults and the module globals it reads as a ``jnp``
    array (the same values): numpy cannot index with a traced position (``table[k_pos]`` inside a jitted
    ring), ``jnp`` can. A function with no numpy array there is returned as it is; one that reads a numpy
    global gets a copy of its module's globals with those arrays swapped (a snapshot, as the closure's)."""
    import jax
    import jax.numpy as jnp

    cells = getattr(fn, "__closure__", None) or ()
    try:
        values = [c.cell_contents for c in cells]
    except ValueError:  # an empty cell: leave the function as it is
        return fn
    def swap(x):  # concrete even when called inside a trace (a tracer kept here would leak into later calls)
        if not isinstance(x, np.ndarray):
            return x
        with jax.ensure_compile_time_eval():
            return jnp.asarray(x)
    defaults = fn.__defaults__ or ()
    tables = [name for name in _global_names(fn.__code__) if isinstance(fn.__globals__.get(name), np.ndarray)]
    if not tables and not any(isinstance(x, np.ndarray) for x in (*values, *defaults)):
        return fn
    module = fn.__globals__
    if tables:
        module = dict(module)
        module.update({name: swap(module[name]) for name in tables})
    new = types.FunctionType(fn.__code__, module, fn.__name__, tuple(map(swap, defaults)) or None,
                             tuple(types.CellType(swap(x)) for x in values) or None)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return new


def canonical(fn):
    """The first function seen with ``fn``'s key (``fn`` itself, made :func:`traceable`, when it is the
    first; ``fn`` as it is when it is not a plain Python function, or None)."""
    if fn is None or getattr(fn, "__code__", None) is None:
        return fn
    with _LOCK:
        key = _KEY_OF.get(fn)  # the same object keeps its first key: a table mutated since is not seen
    if key is None:
        key = function_key(fn)
        try:
            hash(key)
        except TypeError:
            return fn
        try:
            with _LOCK:
                _KEY_OF[fn] = key
        except TypeError:  # a function that cannot be weakly referenced: keyed afresh each call
            pass
    with _LOCK:
        first = _SEEN.pop(key, None) or traceable(fn)
        _SEEN[key] = first  # most recently used last
        while len(_SEEN) > MAX_FUNCTIONS:
            _SEEN.popitem(last=False)
    return first
