"""Child side: the library's functions run, when the student calls them, only if the lab allows it.

An import hook (:class:`_Finder`, first on ``sys.meta_path``) registers every function and method of
``ringattn_ref``, ``ringattn_fast`` and ``ringattn_course`` as its module is loaded (modules loaded
before the hook are registered when it is installed), and ``sys.monitoring`` reports the start of
each of their code objects. On each start the guard looks at the callers: skipping frames of other
files (jax, numpy, the standard library), the nearest frame that is either the student's file or
the library (or the grader) decides. The library calling its own helpers is fine; the student's
file calling a function the lab does not allow is a violation, however the function was reached:
``ringattn_ref.merge``, ``ringattn_ref.softmax.merge``, an alias, a wrapper, ``functools.partial``,
``jax.jit(merge)``. A violation raises :class:`ForbiddenCall` in the student's code and is also
recorded, so catching the exception does not hide it (the child checks after every task).

Not a sandbox: see the threat model in ``common.py``.
"""
from __future__ import annotations

import importlib.abc
import inspect
import os
import sys
import types

LIBRARY = ("ringattn_ref", "ringattn_fast", "ringattn_course")
_MON = sys.monitoring
_TOOL = 3  # a tool id no debugger, profiler or coverage tool uses by default (0, 1, 2, 5 are theirs)


class ForbiddenCall(Exception):
    """The student's code called a library function that the lab forbids."""


def _unwrap(obj):
    """The Python functions behind ``obj`` (jit wrappers, custom_vjp/jvp, partial, staticmethod ...)."""
    seen, todo, out = set(), [obj], []
    while todo:
        x = todo.pop()
        if id(x) in seen or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, types.FunctionType):
            out.append(x)
        for attr in ("__wrapped__", "__func__", "func", "fun", "fwd", "bwd", "fget", "fset", "_fun"):
            try:
                inner = inspect.getattr_static(x, attr, None)
            except Exception:  # noqa: BLE001 - odd descriptors
                inner = None
            if inner is not None and not isinstance(inner, (str, int, bool, tuple, dict)):
                todo.append(inner)
    return out


class Guard:
    """Watches the library; ``allowed`` holds dotted names the student may call: a function
    (``ringattn_fast.kernels.xla.hop_fwd``), a class (all its methods) or a module (all of it)."""

    def __init__(self, solution_path, allowed, trusted_dirs):
        self.solution = os.path.realpath(solution_path)
        self.allowed = tuple(allowed)
        self.trusted = tuple(os.path.realpath(d) + os.sep for d in trusted_dirs)
        self.names, self.ok_codes, self.kinds = {}, set(), {}
        self.violation = None
        self.registered = set()

    def _kind(self, filename):
        """'student', 'trusted' (library, grader) or None (anything else), cached per file."""
        kind = self.kinds.get(filename, 0)
        if kind == 0:
            path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
            kind = "student" if path == self.solution else "trusted" if path.startswith(self.trusted) else None
            self.kinds[filename] = kind
        return kind

    def _is_allowed(self, dotted):
        return any(dotted == a or dotted.startswith(a + ".") for a in self.allowed)

    def register(self, module):
        name = getattr(module, "__name__", "")
        if name in self.registered or name.split(".")[0] not in LIBRARY:
            return
        self.registered.add(name)
        home = os.path.realpath(getattr(module, "__file__", None) or "?")
        for attr, obj in list(vars(module).items()):
            members = [(attr, obj)]
            if isinstance(obj, type) and obj.__module__ == name:
                members = [(f"{attr}.{k}", v) for k, v in vars(obj).items()]
            elif getattr(obj, "__module__", None) != name:
                continue  # imported from elsewhere: registered where it is defined
            for dotted, member in members:
                for fn in _unwrap(member):
                    code = fn.__code__
                    if code in self.names or os.path.realpath(code.co_filename) != home:
                        continue  # seen, or not the library's code (a namedtuple's _replace, a dataclass __init__)
                    self.names[code] = f"{name}.{dotted}"
                    if self._is_allowed(f"{name}.{dotted}"):
                        self.ok_codes.add(code)
                    _MON.set_local_events(_TOOL, code, _MON.events.PY_START)

    def _on_start(self, code, offset):
        if code in self.ok_codes or self.violation is not None:
            return None
        frame = sys._getframe(1).f_back  # the caller of the watched function
        while frame is not None:
            kind = self._kind(frame.f_code.co_filename)
            if kind == "trusted":
                return None  # the library (or the grader) calling its own function
            if kind == "student":
                self.violation = (f"{os.path.basename(self.solution)} calls {self.names[code]} (line "
                                  f"{frame.f_lineno}); the lab does not allow it: that is the answer, write "
                                  f"it yourself")
                raise ForbiddenCall(self.violation)
            frame = frame.f_back
        return None

    def install(self):
        _MON.use_tool_id(_TOOL, "ringattn-grader")
        _MON.register_callback(_TOOL, _MON.events.PY_START, self._on_start)
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] in LIBRARY:
                self.register(module)
        sys.meta_path.insert(0, _Finder(self))
        return self


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then registers the fresh module with the guard."""

    def __init__(self, loader, guard):
        self.loader, self.guard = loader, guard

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.guard.register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """The import hook: library modules get a :class:`_Loader`."""

    def __init__(self, guard):
        self.guard = guard

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in LIBRARY:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.guard)
                return spec
        return None
