"""Parent side: refuse, from the source text and before anything runs, a solution that reaches for the
grading machinery (see the threat model in ``common.py``). Not how library use is caught (that is
``guard.py``, at run time); this only keeps the guard and the child's harness out of reach.
"""
from __future__ import annotations

import ast
import os

from .common import Fail

MODULES = {"inspect", "gc", "ctypes", "importlib", "builtins", "_grader", "grade", "child", "guard", "sys",
           "traceback", "dis", "marshal", "types", "pickle", "subprocess", "signal", "threading", "multiprocessing"}
NAMES = {"exec", "eval", "compile", "__import__", "globals", "vars", "breakpoint", "__builtins__", "__loader__",
         "__spec__"}
ATTRIBUTES = {"f_back", "f_globals", "f_locals", "f_code", "f_builtins", "gi_frame", "cr_frame", "tb_frame",
              "tb_next", "__code__", "__closure__", "__globals__", "__wrapped__", "__self__", "__func__",
              "__subclasses__", "__bases__", "__mro__", "__dict__", "__getattribute__", "_getframe", "monitoring",
              "meta_path", "path_hooks", "modules", "settrace", "setprofile", "_current_frames", "exec_module",
              "__kwdefaults__", "__defaults__", "register_callback", "set_local_events", "violation"}


def check_source(path):
    """Fail naming the line where the solution touches the interpreter's machinery (frames, imports,
    ``sys``, ``exec``/``eval``) or the grader. A syntax error is left to the child ("cannot import")."""
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=name)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            what = next((a.name for a in node.names if a.name.split(".")[0] in MODULES), None)
        elif isinstance(node, ast.ImportFrom):
            what = node.module if (node.module or "").split(".")[0] in MODULES or node.level else None
        elif isinstance(node, ast.Name) and node.id in NAMES:
            what = node.id
        elif isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES:
            what = f".{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr",
                                                                                               "delattr"):
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                what = f"{node.func.id} with a computed name"
            elif str(node.args[1].value) in ATTRIBUTES | NAMES:
                what = f"{node.func.id}(..., {node.args[1].value!r})"
        if what:
            raise Fail(f"{name} line {node.lineno} uses {what}: a solution may not reach into the interpreter "
                       f"or the grader (frames, sys, imports by name, exec/eval); write the lab with numpy, jax "
                       f"and the building blocks it names")
