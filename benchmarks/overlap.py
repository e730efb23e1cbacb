"""Does the compiled ring hide its transfers? Read from the scheduled HLO of a compile for chips no one here has.

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m benchmarks.overlap [--targets v5e,v6e,v5p] [--impls pallas_tpu,xla]
    PYTHONPATH=.venv/cudaplugin:. .venv/bin/python -m benchmarks.overlap --targets h100,a100 [--flags documented]

(libtpu beside the venv: ``scripts/setup-libtpu``; the CUDA plugin: ``scripts/setup-cuda-plugin``). Ring
Attention's point (arXiv:2310.01889, section 3) is that each hop's K/V transfer flies while the hop computes.
Whether it does is the compiler's choice: XLA splits a ``collective-permute`` into ``-start`` / ``-done`` and
schedules work between them, or not. The compiled program's text (``compiled.as_text()``) lists every
computation's instructions *in their schedule order*, so for each ``collective-permute-start`` we look at what
runs before its ``-done``: a transfer is **hidden** when some compute is scheduled between them -- a kernel
(``custom-call`` to Mosaic's ``tpu_custom_call``, Pallas Triton's ``__gpu$xla.gpu.triton``, cuBLAS, cuDNN), a
``dot`` / ``convolution``, or a ``fusion`` / ``call`` / ``conditional`` / ``while`` whose computations run one
-- and **exposed** otherwise. A plain ``collective-permute`` (not split) is synchronous: exposed too (XLA:GPU
turns a start / done pair with nothing between into one).

Targets: 8-chip TPU slices (libtpu's compile-only topologies) and 8 GPUs on one host, H100 SXM and A100 SXM
80 GB (the CUDA plugin's compile-only ``topology="1x1x8"`` with the ``GpuTargetConfigProto`` that the plugin
itself embeds for that GPU: :func:`gpu_target_config`; compiling also needs ptxas and libdevice, a CUDA
toolkit or the ``nvidia-cuda-nvcc`` / ``nvidia-nvvm`` wheels that ``scripts/setup-cuda-plugin`` adds where
there is none). Flags: GPU rows are compiled twice, with the options a user gets (``default``) and with
:data:`GPU_FLAGS` ``"documented"``, passed to this compile only (``compile(compiler_options=...)``; the
library sets no global flag): XLA:GPU's latency-hiding scheduler, which XLA turns on by itself for Hopper
but not for Ampere, and three collectives in flight at once instead of one (the backward's K/V, dK and dV
sends). TPU rows need no flag (``default`` only).

This is the static schedule, not a measurement: a hidden transfer may still outlast its compute (a 4K-token
bfloat16 K/V shard of 8 kv heads is 16 MiB at v5e's ~45 GB/s per ICI link, 0.4 ms, against a hop of ~2 ms
forward), but an exposed one is certain to cost its full time.

:func:`transfers` parses, :func:`check` compiles one case and parses it; ``main`` compiles the table
(target x flags x impl x causal, forward+backward) plus, on the first target of each kind, a CONTROL ring
whose transfer a data dependency forces to finish before the kernel, which must come out exposed. One JSON
object per row to stdout, a table to stderr.

:func:`schedule` keeps what a reader of the schedule needs and nothing more (JSON, a few KiB): per computation
that holds a transfer, its kernels, loops, transfer starts and dones in order. ``--save-schedule PATH`` compiles
one case (the first of ``--targets``, ``--impls``, ``--causal``) and writes it; notebook 06 draws the saved ones:

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m benchmarks.overlap --targets v5e --impls pallas_tpu --causal no \\
        --save-schedule notebooks/ringattn_course/schedule_v5e_after.json --label "..."
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import mmap
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import NamedTuple

# target: (topology, chip_config_name, chips_per_host_bounds): 8 chips each
TARGETS = {"v5e": ("v5e:2x4", "default", (2, 4, 1)), "v6e": ("v6e:2x4", "default", (2, 4, 1)),
           "v5p": ("v5p:2x2x2", "megacore", (2, 2, 2))}
# target: the device_description_str of the GpuTargetConfigProto the CUDA plugin embeds (XLA's
# target_config specs h100_sxm and a100_sxm_80); 8 of them on one host
GPU_TARGETS = {"h100": "NVIDIA H100 80GB HBM3", "a100": "NVIDIA A100-SXM4-80GB"}
GPU_TOPOLOGY = "1x1x8"  # slices x hosts x GPUs per host
# XLA:GPU options for this compile only (``compile(compiler_options=...)``; as XLA_FLAGS:
# --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_parallel_collective_overlap_limit=3).
# The scheduler is on by default for Hopper in this XLA, off for Ampere; the limit (default 1 collective in
# flight) lets the backward's K/V, dK and dV sends all fly under one hop's kernel.
GPU_FLAGS = {"default": {},
             "documented": {"xla_gpu_enable_latency_hiding_scheduler": True,
                            "xla_gpu_experimental_parallel_collective_overlap_limit": 3}}
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
COMPUTE_OPS = ("dot", "convolution")
# custom-call targets that run a kernel: Mosaic TPU, Pallas Triton (XLA:GPU), Mosaic GPU, cuBLAS, cuDNN
KERNEL_CALLS = ("tpu_custom_call", "mosaic", "__gpu$xla.gpu.triton", "__cublas", "__cudnn")
CALLERS = ("fusion", "call", "conditional", "while", "async-start")
FREE = ("parameter", "get-tuple-element", "bitcast", "constant", "tuple")  # name or reshape data: no work
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
            "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


class Instr(NamedTuple):
    name: str
    op: str
    rest: str  # operands and attributes
    type: str = ""  # the result's type, e.g. ``(bf16[1,4096,8,128]{...}, ...)``

    @property
    def backward(self):
        """Whether JAX traced it for a backward pass (its ``op_name`` under ``transpose(...)``)."""
        return "transpose(" in (re.search(r'op_name="([^"]*)"', self.rest) or [None, ""])[1]


class Transfer(NamedTuple):
    """One K/V (or dK/dV) move in computation ``comp``: ``hidden`` iff compute runs between start and done;
    ``between``: the names of that compute."""
    comp: str
    start: str
    hidden: bool
    synchronous: bool
    between: tuple
    backward: bool = False


def computations(hlo):
    """``{name: [Instr]}`` in schedule order, from a compiled module's text."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            cur = comps.setdefault(header.group(1), [])
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line) if cur is not None else None
        if m:
            cur.append(Instr(m.group(1), m.group(3), m.group(4), m.group(2)))
    return comps


def _called(instr):
    names = []
    for group in _CALLED.findall(instr.rest):
        names += [n.strip().lstrip("%") for n in group.strip("{}").split(",") if n.strip()]
    return names


def _computes(comps):
    """``{computation: bool}``: whether it runs compute (a kernel, a matmul), directly or through its callees."""
    memo = {}

    def runs(name, seen=()):
        if name not in memo:
            memo[name] = False if name in seen else any(_is_compute(i, lambda c: runs(c, seen + (name,)))
                                                        for i in comps.get(name, ()))
        return memo[name]
    return {name: runs(name) for name in comps}, runs


def _is_compute(instr, runs):
    if instr.op in COMPUTE_OPS:
        return True
    if instr.op == "custom-call":
        target = (re.search(r'custom_call_target="([^"]*)"', instr.rest) or [None, ""])[1].lower()
        return any(k in target for k in KERNEL_CALLS)
    return instr.op in CALLERS and any(runs(c) for c in _called(instr))


def transfers(hlo):
    """Every collective-permute of a compiled module: a list of :class:`Transfer`."""
    comps = computations(hlo)
    _, runs = _computes(comps)
    out = []
    for comp, instrs in comps.items():
        for k, ins in enumerate(instrs):
            if ins.op == "collective-permute":
                out.append(Transfer(comp, ins.name, False, True, (), ins.backward))
            elif ins.op == "collective-permute-start":
                done = next((j for j in range(k + 1, len(instrs)) if instrs[j].op == "collective-permute-done"
                             and re.search(rf"%{re.escape(ins.name)}\b", instrs[j].rest)), len(instrs))
                between = tuple(i.name for i in instrs[k + 1:done] if _is_compute(i, runs))
                out.append(Transfer(comp, ins.name, bool(between), False, between, ins.backward))
    return out


def summary(hlo):
    """``{"transfers", "hidden", "synchronous", "exposed": [computation/start names]}`` of a compiled module, and
    ``fwd`` / ``bwd``: ``[transfers, hidden]`` of the forward's and of the backward's (``Instr.backward``)."""
    ts = transfers(hlo)
    split = {d: [sum(t.backward == b for t in ts), sum(t.hidden and t.backward == b for t in ts)]
             for d, b in (("fwd", False), ("bwd", True))}
    return dict(transfers=len(ts), hidden=sum(t.hidden for t in ts), synchronous=sum(t.synchronous for t in ts),
                exposed=[f"{t.comp}/{t.start}" for t in ts if not t.hidden]) | split


def _entry(hlo):
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo, re.M)
    return m.group(1) if m else None


def _sent(instr):
    """What a collective-permute(-start) sends: ``("bf16[1,4096,8,128]", bytes)`` (its operand, the first array
    of a start's result tuple)."""
    m = _ARRAY.search(instr.type)
    if not m:
        return instr.type, 0
    dims = [int(x) for x in m.group(2).split(",") if x]
    return f"{m.group(1)}[{m.group(2)}]", ITEMSIZE.get(m.group(1), 0) * math.prod(dims)


def schedule(hlo):
    """The compiled schedule of every computation of ``hlo`` that holds a transfer, small enough for JSON.

    ``{"summary": summary(hlo), "computations": [{"name", "role", "events"}]}``; ``role`` is ``"forward loop
    body"`` / ``"backward loop body"`` (the body of a ``while`` JAX traced for that pass), ``"entry"`` (the
    program: the loops' calls and the steps peeled off them) or ``"computation"``; ``events`` in schedule
    order, each a dict with ``kind``:

    - ``"kernel"``: a Mosaic kernel (``name``: the kernel's, e.g. ``ring_hop_bwd_fused_tpu``);
    - ``"loop"``: a ``while`` that runs compute (``name``; ``body``: its body computation; ``backward``);
    - ``"compute"``: other compute that hides a transfer (a ``dot``, a fusion that calls a kernel; ``name``,
      ``op``);
    - ``"other"``: ``ops`` consecutive instructions that do work but no compute (elementwise fusions, copies,
      the accumulators' adds; ``parameter``, ``get-tuple-element``, ``bitcast``, ``constant``, ``tuple``
      are not counted);
    - ``"start"``: a transfer leaves (``id``: the start's name; ``sends``: its array, e.g.
      ``"bf16[1,4096,8,128]"``; ``bytes``; ``backward``; ``hidden``: :func:`transfers`' reading;
      ``synchronous`` for a plain ``collective-permute``, whose ``"done"`` follows at once);
    - ``"done"``: it has arrived (``id``: its start's name).
    """
    comps = computations(hlo)
    _, runs = _computes(comps)
    hidden = {(t.comp, t.start): t.hidden for t in transfers(hlo)}
    bodies = {}
    for instrs in comps.values():
        for ins in instrs:
            if ins.op == "while":
                m = re.search(r"body=%?([\w.\-]+)", ins.rest)
                if m:
                    bodies[m.group(1)] = "backward loop body" if ins.backward else "forward loop body"
    entry = _entry(hlo)
    out = []
    for comp, instrs in comps.items():
        if not any(k for k in hidden if k[0] == comp):
            continue
        events, starts = [], {}

        def other():
            if events and events[-1]["kind"] == "other":
                events[-1]["ops"] += 1
            else:
                events.append(dict(kind="other", ops=1))
        for ins in instrs:
            if ins.op in ("collective-permute", "collective-permute-start"):
                sends, nbytes = _sent(ins)
                events.append(dict(kind="start", id=ins.name, sends=sends, bytes=nbytes, backward=ins.backward,
                                   hidden=hidden[(comp, ins.name)]))
                if ins.op == "collective-permute":
                    events[-1]["synchronous"] = True
                    events.append(dict(kind="done", id=ins.name))
            elif ins.op == "collective-permute-done":
                m = re.match(r"\s*%?([\w.\-]+)", ins.rest)
                events.append(dict(kind="done", id=m.group(1) if m else ins.name))
            elif ins.op == "custom-call" and _is_compute(ins, runs):
                events.append(dict(kind="kernel", name=re.sub(r"\.\d+$", "", ins.name)))
            elif ins.op == "while" and _is_compute(ins, runs):
                body = re.search(r"body=%?([\w.\-]+)", ins.rest)
                events.append(dict(kind="loop", name=ins.name, body=body.group(1) if body else "",
                                   backward=ins.backward))
            elif _is_compute(ins, runs):
                events.append(dict(kind="compute", name=ins.name, op=ins.op))
            elif ins.op not in FREE:
                other()
        role = bodies.get(comp, "entry" if comp == entry else "computation")
        out.append(dict(name=comp, role=role, events=events))
    order = ("forward loop body", "backward loop body", "entry", "computation")
    out.sort(key=lambda c: order.index(c["role"]))
    return dict(summary=summary(hlo), computations=out)


def read(program):
    """:func:`summary` of a compiled program's schedule, and its ``temp_mib`` (``memory_analysis()``)."""
    return summary(program.as_text()) | dict(temp_mib=round(program.memory_analysis().temp_size_in_bytes / 2 ** 20, 1))


def platform(target):
    """``"tpu"`` or ``"gpu"``: which compiler a target's rows go through; ValueError for an unknown target."""
    if target in TARGETS:
        return "tpu"
    if target in GPU_TARGETS:
        return "gpu"
    raise ValueError(f"target must be one of {', '.join([*TARGETS, *GPU_TARGETS])}; got {target!r}")


def cuda_plugin_library():
    """The CUDA PJRT plugin's shared library (``jax_plugins/xla_cuda13`` or ``xla_cuda12``), or None where no
    plugin is importable."""
    for name in CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        if spec is not None and spec.origin:
            lib = pathlib.Path(spec.origin).parent / "xla_cuda_plugin.so"
            if lib.exists():
                return lib
    return None


def gpu_target_config(target, library=None):
    """The text ``GpuTargetConfigProto`` of ``target`` (:data:`GPU_TARGETS`) that the CUDA plugin embeds: XLA
    builds its GPU specs (``xla/backends/gpu/target_config/specs/*.txtpb``) into the plugin as NUL-terminated
    text, and this takes the one whose ``device_description_str`` names the GPU -- the fields this very
    plugin parses, at its version, with nothing copied into this repository."""
    library = library or cuda_plugin_library()
    if library is None:
        raise RuntimeError("no CUDA plugin is importable: run scripts/setup-cuda-plugin and put its folder "
                           "on PYTHONPATH")
    key = f'device_description_str: "{GPU_TARGETS[target]}"\n'.encode()
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(key)
        if at < 0:
            raise RuntimeError(f"{library} embeds no target config for {GPU_TARGETS[target]!r}")
        text = data[data.rfind(b"\0", 0, at) + 1:data.find(b"\0", at)].decode()
    if "gpu_device_info" not in text:
        raise RuntimeError(f"{library}: the text around {GPU_TARGETS[target]!r} is no GpuTargetConfigProto")
    return text


def devices_for(target):
    """Compile-only devices of ``target``: an 8-chip TPU slice (libtpu) or 8 GPUs on one host (CUDA plugin)."""
    from jax.experimental import topologies
    if platform(target) == "gpu":
        config = gpu_target_config(target)
        try:
            return topologies.get_topology_desc(platform="cuda", topology=GPU_TOPOLOGY, target_config=config).devices
        except NotImplementedError as e:  # the plugin did not register: it wanted a CUDA runtime
            raise RuntimeError("the CUDA plugin gave no compile-only topology: run with JAX_PLATFORMS=cpu (with "
                               "'cuda' among the platforms it checks for a CUDA runtime and cuDNN first)") from e
    topology, config, bounds = TARGETS[target]
    return topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=bounds, num_slices=1,
                                        chip_config_name=config).devices


def mesh_for(target):
    import jax
    import numpy as np
    return jax.sharding.Mesh(np.array(devices_for(target)), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))


def compiled(fn, mesh, *, tokens, heads=8, kv_heads=8, dim=128, backward=True, options=None):
    """``fn(q, k, v)`` (forward; with ``backward`` its ``jax.vjp`` too) compiled for ``mesh``: global
    ``[1, N * tokens, heads, dim]`` bfloat16 sharded over ``sp``; ``options``: XLA options for this compile
    only (``{"xla_gpu_...": value}``)."""
    import jax
    import jax.numpy as jnp
    seq = tokens * mesh.devices.size
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((1, seq, kv_heads, dim), jnp.bfloat16, sharding=sharding)

    def f(q, k, v, do):
        if not backward:
            return fn(q, k, v)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o,) + vjp(do)
    return jax.jit(f).trace(q, k, k, q).lower().compile(compiler_options=options or None)


def ring_fn(mesh, **kw):
    import ringattn_fast as rf
    return lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, **kw)


def control_fn(mesh, impl="pallas_tpu"):
    """A ring whose transfers cannot hide: each step sends the previous hop's *output* as the next K and V
    and the hop reads what it received, so send, kernel, send, kernel form one chain with nothing to overlap
    (``ring_attention``'s own Pallas hop kernel of ``impl``, ``N - 1`` steps, unrolled)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from ringattn_fast.dispatch import kernels_for
    from ringattn_fast.schedule import HopConfig, KVShard, QShard, send_to_next
    kernels = kernels_for(impl)
    device = mesh.devices.flat[0]

    def shard(q, k, v):
        n, (b, s) = lax.axis_size("sp"), q.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        qs, x = QShard(q, pos), k
        blocks = kernels.default_blocks(q.shape, k.shape, q.dtype, device)  # the tiles that fit this chip
        cfg = HopConfig(causal=False, scale=q.shape[-1] ** -0.5,
                        **({} if blocks is None else dict(block_q=blocks[0], block_kv=blocks[1])))
        for _ in range(n - 1):
            x = send_to_next(x, "sp")  # received, then used: exposed
            o_hop, _ = kernels.hop_fwd(qs, KVShard(x, x, pos), cfg)
            x = o_hop.astype(k.dtype)  # the next send waits for this kernel
        return x
    return jax.shard_map(shard, mesh=mesh, in_specs=jax.P(None, "sp"), out_specs=jax.P(None, "sp"),
                         check_vma=False)


KERNEL_IMPL = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def impls_for(target, impls):
    """The impls of ``impls`` that compile for ``target``: ``pallas_tpu*`` on TPU, ``pallas_gpu`` on GPU, the rest
    on both."""
    other = {"tpu": "pallas_gpu", "gpu": "pallas_tpu"}[platform(target)]
    return [i for i in impls if not i.startswith(other)]


def flags_for(target, flags):
    """The flag sets of ``flags`` (names in :data:`GPU_FLAGS`) a target is compiled with: all on GPU; on TPU
    ``default`` only (no flag is documented for it)."""
    return list(flags) if platform(target) == "gpu" else ["default"]


def cases(targets, impls, causal=(False, True), flags=("default",)):
    """(target, impl, causal, backward, flags) of the table, then the control on the first target of each
    platform, with each of its flag sets."""
    for target in targets:
        for fl in flags_for(target, flags):
            for impl in impls_for(target, impls):
                for c in causal:
                    yield target, impl, c, True, fl
    for kind in ("tpu", "gpu"):
        first = next((t for t in targets if platform(t) == kind), None)
        if first is not None:
            for fl in flags_for(first, flags):
                yield first, "control", False, False, fl


def _program(target, impl, causal, backward, *, tokens, layout, flags="default"):
    kind = platform(target)
    mesh = mesh_for(target)
    fn = (control_fn(mesh, KERNEL_IMPL[kind]) if impl == "control" else
          ring_fn(mesh, impl=impl, causal=causal, layout=layout))
    return compiled(fn, mesh, tokens=tokens, backward=backward, options=GPU_FLAGS[flags] if kind == "gpu" else None)


def check(target, impl, causal, backward, *, tokens=4096, layout="contiguous", flags="default", program=None):
    """One row: compile (unless ``program`` is given: that case's compiled program), parse, ``ok`` (every
    transfer hidden; the control: some exposed, none hidden). ``flags``: a name of :data:`GPU_FLAGS` (GPU
    targets; TPU rows take ``default``)."""
    if flags not in GPU_FLAGS:
        raise ValueError(f"flags must be one of {', '.join(GPU_FLAGS)}; got {flags!r}")
    t0 = time.perf_counter()
    program = program or _program(target, impl, causal, backward, tokens=tokens, layout=layout, flags=flags)
    row = dict(target=target, flags=flags, impl=impl, causal=causal, direction="fwd+bwd" if backward else "fwd",
               compile_s=round(time.perf_counter() - t0, 1)) | read(program)
    all_hidden = row["transfers"] > 0 and row["hidden"] == row["transfers"]
    row["ok"] = (row["transfers"] > 0 and row["hidden"] == 0) if impl == "control" else all_hidden
    return row


def _source():
    """The ``ringattn_fast`` compiled: the last commit that changed its folder (``git log``), ``-dirty`` if its files
    differ from it; ``"unknown"`` outside a git checkout."""
    import os

    import ringattn_fast
    here = os.path.dirname(ringattn_fast.__file__)
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True,  # noqa: E731
                                        cwd=here).stdout.strip()
        dirty = "-dirty" if git("status", "--porcelain", "--", ".") else ""
        return git("log", "-1", "--format=%h", "--", ".") + dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compiled_schedule(target="v5e", impl="pallas_tpu", causal=False, *, tokens=4096, layout="contiguous", label=""):
    """Compile ``ring_attention`` forward + backward for ``target`` and return its :func:`schedule`, with the case
    (``target``, ``impl``, ``causal``, ``tokens`` per chip, ``heads``, ``kv_heads``, ``dim``, bfloat16:
    :func:`compiled`'s defaults), ``label``, the ``source`` (:func:`_source`: which ``ringattn_fast`` was
    compiled) and the JAX version."""
    import jax
    program = _program(target, impl, causal, True, tokens=tokens, layout=layout)
    case = dict(target=target, impl=impl, causal=causal, layout=layout, tokens=tokens, heads=8, kv_heads=8, dim=128,
                dtype="bfloat16", chips=8, label=label, source=_source(), jax=jax.__version__)
    return case | schedule(program.as_text())


def save_schedule(path, *args, **kwargs):
    """Write :func:`compiled_schedule` ``(*args, **kwargs)`` to ``path`` (:func:`schedule_json`); return it."""
    out = compiled_schedule(*args, **kwargs)
    with open(path, "w") as f:
        f.write(schedule_json(out))
    return out


def schedule_json(sched):
    """``sched`` (:func:`schedule`'s, with or without the case) as JSON text, one event a line (readable diffs)."""
    one = lambda x: json.dumps(x, separators=(", ", ": "))  # noqa: E731
    head = [f" {one(k)}: {one(v)}" for k, v in sched.items() if k != "computations"]
    comps = [" {" + ", ".join(f"{one(k)}: {one(v)}" for k, v in c.items() if k != "events") + ', "events": [\n'
             + ",\n".join(f"   {one(e)}" for e in c["events"]) + "]}" for c in sched["computations"]]
    return "{\n" + ",\n".join(head + [' "computations": [\n' + ",\n".join(comps) + "]"]) + "\n}\n"


def table(rows):
    head = ["target", "flags", "impl", "causal", "pass", "transfers", "hidden", "fwd", "bwd", "compile s", "temp MiB"]
    lines = ["".join(f"{h:>11}" for h in head)]
    for r in rows:
        cells = [r["target"], r.get("flags", "default"), r["impl"], r["causal"], "yes" if r["ok"] else "NO",
                 r["transfers"], r["hidden"], "%d/%d" % tuple(r["fwd"][::-1]), "%d/%d" % tuple(r["bwd"][::-1]),
                 r["compile_s"], r["temp_mib"]]
        lines.append("".join(f"{str(c):>11}" for c in cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="v5e,v6e,v5p",
                   help=f"comma list of {','.join([*TARGETS, *GPU_TARGETS])} (GPU: the CUDA plugin on PYTHONPATH)")
    p.add_argument("--impls", default="pallas_tpu,pallas_gpu,xla",
                   help="comma list; each target compiles those of its platform (pallas_tpu on TPU, pallas_gpu on GPU)")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--flags", default=",".join(GPU_FLAGS),
                   help=f"comma list of {','.join(GPU_FLAGS)}: GPU rows' XLA options (TPU rows: default)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per chip (default 4096)")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--show-exposed", action="store_true")
    p.add_argument("--save-schedule", metavar="PATH", help="compile the first target/impl/causal case only and write "
                   "its schedule (JSON) to PATH")
    p.add_argument("--label", default="", help="with --save-schedule: a label stored in the file")
    args = p.parse_args(argv)
    targets, flags = args.targets.split(","), args.flags.split(",")
    for t in targets:
        try:
            platform(t)
        except ValueError as e:
            p.error(f"--targets: {e}")
    if not set(flags) <= set(GPU_FLAGS):
        p.error(f"--flags: each of {', '.join(GPU_FLAGS)}; got {args.flags!r}")
    if any(platform(t) == "gpu" for t in targets):
        # the CUDA plugin registers its compile-only topologies without a GPU only where JAX is not asked to
        # start a CUDA backend (it would look for the CUDA runtime and cuDNN first, and fail)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.save_schedule:
        saved = save_schedule(args.save_schedule, args.targets.split(",")[0], args.impls.split(",")[0], causal[0],
                              tokens=args.tokens, layout=args.layout, label=args.label)
        print(json.dumps(dict(saved["summary"], path=args.save_schedule, source=saved["source"])))
        return 0
    rows, t0 = [], time.perf_counter()
    for target, impl, c, bwd, fl in cases(targets, args.impls.split(","), causal, flags):
        row = check(target, impl, c, bwd, tokens=args.tokens, layout=args.layout, flags=fl)
        if not args.show_exposed:
            row["exposed"] = len(row["exposed"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows), file=sys.stderr)
    print(f"{len(rows)} compiles, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
