"""Does the fused TPU ring hide its transfers? Read from the kernel's own program: the Mosaic MLIR it is compiled from.

    .venv/bin/python -m benchmarks.fused_overlap [--chip v5e] [--tokens 256 --heads 2 --kv-heads 2 --block 128]
                                                 [--dump DIR]

(no libtpu, no chip). ``benchmarks/overlap.py`` reads XLA's schedule, where the other impls' ``ppermute``s live;
the fused ring (``kernels/pallas_tpu_fused.py``) moves K/V itself, with remote DMA inside one Pallas kernel, so
whether a transfer flies while the hop computes is decided by the kernel's own order of operations. Lowering
``ring_attention_shard(impl="pallas_tpu_fused")`` for a TPU that is not here (an ``AbstractMesh``, as
tests/test_lowering.py) gives a ``tpu_custom_call`` per kernel whose backend config carries the serialized Mosaic
module: the program that Mosaic compiles for the chip. :func:`mosaic_kernels` decodes it (base64, MLIR bytecode,
Mosaic's ``mosaic-serde`` pass back to the current dialect) and :func:`read` walks it.

How it is read. The kernel's grid is the ring (``iteration_bounds`` = N steps, ``arbitrary``: in order), so the
function body is one ring step, and every remote copy a step starts is waited on in the same step
(``fused_ring.finish``): the order of operations in that one body is the whole story. In it, a **remote copy**
is a ``tpu.enqueue_dma`` with a ``device_id`` (``pltpu.make_async_remote_copy``'s start), its waits the
``tpu.wait_dma``s (JAX 0.10: ``tpu.wait_dma2``) with a ``device_id`` on the same buffer, named ``send`` or
``recv`` by the semaphore they wait on; the copies are grouped by the travelling HBM buffer they read (the
kernel argument their source is a view of). **Compute** is a ``tpu.matmul``. Each op has a path through the
nested regions (``scf.if``, ``scf.for``), and program order is the order of paths; the reader does not flatten
or unroll loops. Each start S of a buffer opens a window that ends at the first wait W after it, and each
matmul of the step counts as the first of these that it is for some window:

- ``under``: after S and before W: it runs while the copy flies;
- ``carried``: before S in the body of a loop that holds S but not W: it runs again in the loop's *later*
  iterations, after S and still before W (the one-pass backward sends each (batch row, kv head)'s dK/dV when
  that head is done, under the next heads' compute; the last head's send has none);
- ``before`` (it ran before the copy started) or ``after`` (after the step waited on it): not overlapped;
- ``elsewhere``: in another branch of an ``scf.if`` than S or W.

Starts and waits sit in ``scf.if``s on the step (no K/V send after the last hop); the reader reads the order of
the program text, not which steps take which branch. A start with no wait after it in the text (a copy waited
on in the next iteration of a loop, ``fused_ring.stream_tiles``' pattern for local tile copies) is not one of
the ring's: the reader reports it unwaited (``waited`` False), it does not guess.

On this checkout (:func:`check`; tests/test_fused_overlap.py): every matmul of each kernel runs under the K/V
(and key position) copies that bring the next hop, forward and backward, whole and streamed; the backward's
dK/dV copies run under the next heads' compute (one pass, ``carried``) or under pass A (two passes, ``under``,
pass B's matmuls ``before``: they make what is sent). A CONTROL, the same kernels with every remote copy waited
on right after its start (:func:`serialized`), reads as nothing under any copy.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import re
import sys
from typing import NamedTuple

COMPUTE = ("tpu.matmul",)
LOOPS = ("scf.for", "scf.while")
WAITS = ("tpu.wait_dma", "tpu.wait_dma2")
VIEWS = ("tpu.memref_slice", "tpu.memref_squeeze", "tpu.memref_reshape", "tpu.memref_bitcast")
CHIPS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "v4": "TPU v4"}
_BODY = re.compile(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22")  # in a custom call's backend_config


class Step(NamedTuple):
    """One level of an op's path: its index in its block, the (region, block) the path goes on into (None at
    the op itself), whether that op is a loop."""
    index: int
    region: tuple | None
    loop: bool


class Copy(NamedTuple):
    """The remote copies of one travelling buffer in one ring step and the step's matmuls around them (module
    docstring): ``buffer`` the kernel argument they read, as ``argN: memref<...>``; ``starts`` how many
    ``enqueue_dma``s, ``waits`` the kinds of the waits after the first (``send``, ``recv``) in program order;
    then how many matmuls run ``before`` ... ``elsewhere``; ``waited``: every start has a wait after it."""
    buffer: str
    starts: int
    waits: tuple
    before: int
    under: int
    carried: int
    after: int
    elsewhere: int
    waited: bool

    @property
    def hidden(self):
        """Some compute runs while it flies."""
        return self.waited and self.under + self.carried > 0

    @property
    def dtype(self):
        """The buffer's element type (``bf16``, ``i32``, ``f32``, ...)."""
        return re.search(r"x([a-z]+\d*), #tpu", self.buffer).group(1)


class Kernel(NamedTuple):
    """One fused-ring kernel's step: its name, ring steps (``iteration_bounds``), matmuls, and its remote copies."""
    name: str
    steps: tuple
    matmuls: int
    copies: tuple


# ---------------------------------------------------------------- the Mosaic module out of a lowering

def _mlir():
    """(ir, passmanager, make_ir_context, the Mosaic TPU dialect); a RuntimeError naming the JAX version if
    jaxlib moved the dialect's Python module (public JAX has no accessor for it)."""
    import jax
    from jax.extend.mlir import ir, passmanager
    from jax.interpreters.mlir import make_ir_context
    try:
        from jaxlib.mosaic.python import tpu
    except ImportError as err:
        raise RuntimeError(f"jax {jax.__version__}: no jaxlib.mosaic.python.tpu (the Mosaic TPU dialect); "
                           f"update benchmarks/fused_overlap.py") from err
    return ir, passmanager, make_ir_context, tpu


def mosaic_bodies(lowered_text):
    """The serialized Mosaic module (MLIR bytecode) of each ``tpu_custom_call`` in a lowered program's text
    (``jax.jit(f).trace(...).lower().as_text()``), in order."""
    return [base64.b64decode(body) for body in _BODY.findall(lowered_text)]


def _parse(body, ir, passmanager, make_ir_context, tpu):
    ctx = make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(body)
        passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    return module, ctx


def mosaic_kernels(lowered_text):
    """``{kernel name: Mosaic MLIR text}`` of every TPU kernel in a lowered program's text (``--dump``)."""
    modules = [_parse(body, *_mlir())[0] for body in mosaic_bodies(lowered_text)]
    return {str(m.body.operations[0].attributes["sym_name"]).strip('"'): str(m) for m in modules}


# ---------------------------------------------------------------- reading one kernel

def _root(value, ir):
    """The function argument a memref value is a view of (through Mosaic's slice / squeeze / reshape ops)."""
    while not isinstance(value, ir.BlockArgument):
        op = value.owner
        if op.name not in VIEWS:
            return None
        value = op.operands[0]
    return value


def _remote(op):
    """Whether a DMA op talks to another device (prints a ``device_id``)."""
    return " device_id(" in str(op)


def _arg(value, ir):
    """``argN`` of the function argument a memref value is a view of, or None."""
    root = None if value is None else _root(value, ir)
    return None if root is None else f"arg{root.arg_number}"


def _dma(op, ir):
    """``(buffer, kind, semaphores)`` of a remote DMA op: the argument its source is a view of (``argN: type``);
    ``start`` with its (send, receive) semaphores' arguments, or a wait with the one it waits on. JAX 0.12's
    ``tpu.wait_dma`` says which (``wait_target``), 0.10's ``tpu.wait_dma2`` names the semaphore itself."""
    view = op.opview
    src = _root(view.source if hasattr(view, "source") else view.src, ir)
    buffer = f"arg{src.arg_number}: {src.type}"
    if op.name == "tpu.enqueue_dma":
        return buffer, "start", (_arg(view.source_semaphore, ir), _arg(view.target_semaphore, ir))
    if hasattr(view, "semaphore"):
        return buffer, "wait", (_arg(view.semaphore, ir),)
    recv = str(op.attributes["wait_target"]).startswith("true")
    return buffer, "wait", (_arg(view.target_semaphore if recv else view.source_semaphore, ir),)


def _walk(block, prefix, found, ir):
    for i, op in enumerate(block.operations):
        op = op.operation
        loop = op.name in LOOPS
        for r, region in enumerate(op.regions):
            for b, inner in enumerate(region.blocks):
                _walk(inner, prefix + (Step(i, (r, b), loop),), found, ir)
        path = prefix + (Step(i, None, loop),)
        if op.name in COMPUTE:
            found["matmul"].append(path)
        elif (op.name == "tpu.enqueue_dma" or op.name in WAITS) and _remote(op):
            buffer, kind, sems = _dma(op, ir)
            found["dma"].setdefault(buffer, []).append((kind, path, sems))


def _kinds(events):
    """``[(kind, path)]`` with each wait named ``send`` or ``recv`` by the semaphore it waits on (a start's send
    or receive semaphore), ``wait`` if neither."""
    sends = {e[2][0] for e in events if e[0] == "start"}
    recvs = {e[2][1] for e in events if e[0] == "start"}
    name = lambda sem: "send" if sem in sends else "recv" if sem in recvs else "wait"  # noqa: E731
    return [(kind if kind == "start" else name(sems[0]), path) for kind, path, sems in events]


def order(x, y):
    """``(sign, depth)``: -1 if path x runs before y in a step's program order, 1 after, None if they sit in
    different regions of one op (an ``scf.if``'s branches); ``depth``: where the paths part (the ops above are
    common to both)."""
    for k, (a, b) in enumerate(zip(x, y)):
        if a.index != b.index:
            return (-1 if a.index < b.index else 1), k
        if a.region != b.region:
            return None, k
    return 0, min(len(x), len(y))


def _relation(m, start, wait):
    """Where matmul m runs against one copy, started at ``start`` and first waited on at ``wait`` (module
    docstring): ``under``, ``carried``, ``before``, ``after`` or ``elsewhere``."""
    (s, ks), (w, _) = order(m, start), order(m, wait)
    if s is None or w is None:
        return "elsewhere"
    if s > 0 and w < 0:
        return "under"
    if s < 0:  # before the start: again after it where a loop holds both and not the wait (its later iterations)
        parted = order(start, wait)[1]  # the loops above this depth hold the wait too
        return "carried" if any(step.loop for step in m[parted:ks]) else "before"
    return "after"


RANK = ("under", "carried", "before", "after", "elsewhere")


def _copy(buffer, events, matmuls):
    """:class:`Copy` of one buffer from its ``(kind, path)`` events: each start's window runs to the first wait
    after it; a matmul counts under the first of :data:`RANK` that it is for some window (one pass of JAX 0.10
    lowers a loop as two ``scf.for``, so a buffer's copies can start in both)."""
    starts = sorted(p for kind, p in events if kind == "start")
    waits = sorted((p, kind) for kind, p in events if kind != "start")
    windows = [(s, next((p for p, _ in waits if order(s, p)[0] == -1), None)) for s in starts]
    counts = dict.fromkeys(RANK, 0)
    waited = all(w is not None for _, w in windows)
    for m in matmuls:
        rel = {_relation(m, s, w) for s, w in windows} if waited else {"before"}
        counts[next(r for r in RANK if r in rel)] += 1
    after_first = tuple(kind for p, kind in waits if order(starts[0], p)[0] == -1)
    return Copy(buffer, len(starts), after_first, **counts, waited=waited)


def read_module(module, ir):
    """:class:`Kernel` of one parsed Mosaic module (its one ``func.func``)."""
    func = next(op.operation for op in module.body.operations if op.operation.name == "func.func")
    found = {"matmul": [], "dma": {}}
    _walk(func.regions[0].blocks[0], (), found, ir)
    bounds = func.attributes["iteration_bounds"] if "iteration_bounds" in func.attributes else None
    steps = tuple(int(x) for x in re.findall(r"-?\d+", str(bounds).split(":", 1)[-1])) if bounds else ()
    name = str(func.attributes["sym_name"]).strip('"')
    copies = tuple(_copy(buf, _kinds(ev), found["matmul"]) for buf, ev in found["dma"].items()
                   if any(e[0] == "start" for e in ev))
    return Kernel(name, steps, len(found["matmul"]), copies)


def read(lowered_text):
    """``{kernel name: Kernel}`` of every TPU kernel in a lowered program's text."""
    mlir = _mlir()
    out = {}
    for body in mosaic_bodies(lowered_text):
        module, ctx = _parse(body, *mlir)
        with ctx:
            kernel = read_module(module, mlir[0])
        out[kernel.name] = kernel
    return out


# ---------------------------------------------------------------- the fused ring, lowered

@contextlib.contextmanager
def forms(whole):
    """The fused ring's kernel forms: ``whole`` (the forward holds a kv head's K/V in VMEM, the backward runs in
    one pass) or not (K/V streamed a tile at a time, the two-pass backward): ``fused_ring_fwd.WHOLE_KV`` and
    ``fused_ring_bwd.ONE_PASS``, restored on exit. Small shapes fit either way."""
    from ringattn_fast.kernels import fused_ring_bwd, fused_ring_fwd
    saved = fused_ring_fwd.WHOLE_KV, fused_ring_bwd.ONE_PASS
    fused_ring_fwd.WHOLE_KV = fused_ring_bwd.ONE_PASS = whole
    try:
        yield
    finally:
        fused_ring_fwd.WHOLE_KV, fused_ring_bwd.ONE_PASS = saved


class _Serialized:
    """A remote copy waited on as soon as it starts (the CONTROL): its wait_send / wait_recv do nothing after."""

    def __init__(self, copy):
        self.copy = copy

    def start(self):
        self.copy.start()
        self.copy.wait_send()
        self.copy.wait_recv()

    def wait_send(self):
        self._done()

    def wait_recv(self):
        self._done()

    def _done(self):  # waited on at its start: JAX logs an error for a descriptor it thinks was never used
        if hasattr(self.copy, "_used"):
            self.copy._used = True


@contextlib.contextmanager
def serialized():
    """The CONTROL: every ``pltpu.make_async_remote_copy`` of the fused kernels waited on right after its start,
    so nothing can run while it flies (a correct ring, with no overlap), restored on exit."""
    from jax.experimental.pallas import tpu as pltpu
    make = pltpu.make_async_remote_copy
    pltpu.make_async_remote_copy = lambda *a, **kw: _Serialized(make(*a, **kw))
    try:
        yield
    finally:
        pltpu.make_async_remote_copy = make


def lowered(chip="v5e", *, n=4, tokens=256, heads=2, kv_heads=2, dim=128, block=128, causal=True):
    """The text of the fused ring's forward+backward (``value_and_grad`` of ``ring_attention_shard`` with
    ``impl="pallas_tpu_fused"`` in a ``shard_map``), lowered for ``n`` abstract chips of ``chip`` (no chip, no
    libtpu): ``tokens`` per device, bfloat16, ``block`` x ``block`` tiles. Two kv heads, so a backward step holds
    more than one (batch row, kv head) and the one-pass backward's dK/dV sends have a next head to fly under."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    from ringattn_fast import ring_attention_shard
    mesh = AbstractMesh((n,), ("sp",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=CHIPS[chip], num_cores=1, platform="tpu"))
    spec = jax.P(None, "sp")
    shard = lambda q, k, v: ring_attention_shard(q, k, v, axis_name="sp", impl="pallas_tpu_fused",  # noqa: E731
                                                 causal=causal, block_q=block, block_kv=block)
    ring = jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    loss = lambda q, k, v: ring(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    sharding = jax.NamedSharding(mesh, spec)
    q = jax.ShapeDtypeStruct((1, n * tokens, heads, dim), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((1, n * tokens, kv_heads, dim), jnp.bfloat16, sharding=sharding)
    with use_abstract_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower().as_text()


def kv_hidden(copy, kernel):
    """A K/V (or key positions) copy that brings the next hop: started before every matmul of the step, waited on
    after every one (send and receive)."""
    return (copy.waited and copy.under == kernel.matmuls > 0 and copy.before == copy.after == copy.carried == 0
            and {"send", "recv"} <= set(copy.waits))


def lowered_form(chip="v5e", *, whole=True, control=False, **kw):
    """:func:`lowered` in form ``whole`` (:func:`forms`); with ``control``, the :func:`serialized` ring."""
    with forms(whole), (serialized() if control else contextlib.nullcontext()):
        return lowered(chip, **kw)


def check(chip="v5e", *, whole=True, control=False, text=None, **kw):
    """One row per kernel of the fused ring in form ``whole`` (:func:`forms`), lowered for ``chip`` (or
    ``text``, that lowering already done); with ``control`` the :func:`serialized` ring. ``ok``: every K/V copy
    (the non-float32 buffers: K/V in bfloat16, key positions in int32) is :func:`kv_hidden` and every dK/dV copy
    (float32) has compute under it and none after its wait; for the control, no copy has any compute under it."""
    kernels = read(lowered_form(chip, whole=whole, control=control, **kw) if text is None else text)
    rows = []
    for name, k in kernels.items():
        kv = [c for c in k.copies if c.dtype != "f32"]
        dkv = [c for c in k.copies if c.dtype == "f32"]
        ok = (not any(c.hidden for c in k.copies) if control else
              bool(kv) and all(kv_hidden(c, k) for c in kv) and all(c.hidden and c.after == 0 for c in dkv))
        rows.append(dict(chip=chip, form="control" if control else "whole" if whole else "streamed", kernel=name,
                         steps=list(k.steps), matmuls=k.matmuls, ok=ok,
                         copies=[dict(buffer=c.buffer, starts=c.starts, waits=list(c.waits), before=c.before,
                                      under=c.under, carried=c.carried, after=c.after) for c in k.copies]))
    return rows


def table(rows):
    head = ["form", "kernel", "buffer", "before", "under", "carried", "after", "ok"]
    lines = [f"{head[0]:>9} {head[1]:>28} {head[2]:>40}" + "".join(f"{h:>8}" for h in head[3:])]
    for r in rows:
        for c in r["copies"]:
            buf = re.sub(r", #tpu.memory_space<\w+>", "", c["buffer"])
            cells = [c["before"], c["under"], c["carried"], c["after"], "yes" if r["ok"] else "NO"]
            lines.append(f"{r['form']:>9} {r['kernel']:>28} {buf:>40}" + "".join(f"{str(x):>8}" for x in cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--chip", default="v5e", choices=list(CHIPS))
    p.add_argument("--tokens", type=int, default=256, help="tokens per chip (default 256)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block", type=int, default=128, help="block_q = block_kv (default 128)")
    p.add_argument("--dump", help="also write each kernel's Mosaic MLIR to DIR/<form>_<kernel>.mlir")
    args = p.parse_args(argv)
    shape = dict(tokens=args.tokens, heads=args.heads, kv_heads=args.kv_heads, block=args.block)
    rows = []
    for whole, control in ((True, False), (False, False), (True, True)):
        text = lowered_form(args.chip, whole=whole, control=control, **shape)
        rows += check(args.chip, whole=whole, control=control, text=text)
        if args.dump:
            import pathlib
            out = pathlib.Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            for name, mlir in mosaic_kernels(text).items():
                (out / f"{rows[-1]['form']}_{name}.mlir").write_text(mlir)
    for r in rows:
        print(json.dumps(r), flush=True)
    print(table(rows), file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
