"""A measured timeline: profile one run with ``jax.profiler`` and draw, per device, when it computed
and when it sat in a collective (notebook 13 and ``benchmarks/strategies.py`` share it).

- :func:`profile` -- run a jitted function once (after a warm-up call that compiles it) inside
  ``jax.profiler.trace(dir, create_perfetto_trace=True)`` and return a :class:`Profile`: the spans of
  the compiled program's ops per device, and its HLO text;
- :func:`profile_attention` / :func:`profile_ring` -- that, for one forward+backward of an attention
  function (of ``ringattn_fast.ring_attention``);
- :func:`spans_from_events` -- the parser: Perfetto/Chrome trace events -> :class:`Span` list;
- :func:`hlo_opcodes` / :func:`collective_ops` -- what the compiled program says: each instruction's
  opcode, and how many collectives are synchronous (``collective-permute``) or split into an
  asynchronous ``collective-permute-start`` / ``-done`` pair that compute may run between;
- :func:`overlap_fraction` -- per device, the share of collective time during which the same
  device also ran compute;
- :func:`plot_timeline` -- the Gantt-like figure.

The trace: each executed HLO op is one complete event (``ph == "X"``, ``ts``/``dur`` in us) whose
``args`` carry ``hlo_op`` (the instruction name), ``hlo_module`` and, on the CPU backend,
``device_ordinal``; on GPU/TPU the device is in the process name (``/device:GPU:3``). Control flow
(``while``, ``conditional``, ``call``) is dropped: those spans contain their bodies' ops.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter",
               "collective-broadcast")
CONTROL_FLOW = ("while", "conditional", "call")
COLORS = {"compute": "#2c66b0", "collective": "#f08c2a"}


@dataclass(frozen=True)
class Span:
    """One op executed on one device: ``kind`` is ``"compute"`` or ``"collective"``; times in us
    from the first span of the profile."""
    device: int
    kind: str
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self):
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Profile:
    """What :func:`profile` measured: the spans, the compiled program's HLO text and module name."""
    spans: list
    hlo_text: str
    module: str
    trace_path: str


def hlo_opcodes(hlo_text):
    """``{instruction name: opcode}`` from compiled HLO text (``%ppermute.41 = f32[..] collective-permute(``)."""
    return {name: op for instructions in _instructions(hlo_text).values() for name, op, _ in instructions}


def collective_ops(hlo_text):
    """Count the collectives of a compiled program: ``{opcode: count}`` for every opcode that starts
    with one of :data:`COLLECTIVES` (``collective-permute``, ``collective-permute-start``,
    ``collective-permute-done``, ``all-gather``, ...). A ``-start``/``-done`` pair is an asynchronous
    collective: the ops scheduled between them run while the data moves."""
    counts = {}
    for op in hlo_opcodes(hlo_text).values():
        if op.startswith(COLLECTIVES):
            counts[op] = counts.get(op, 0) + 1
    return counts


def _instructions(hlo_text):
    """``(name, opcode, operand names)`` per instruction, grouped by computation: ``{computation: [...]}``."""
    computations = {}
    current = computations.setdefault("", [])  # instructions before any header (a snippet)
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(1), [])
            continue
        found = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][a-z\-]*)\((.*)$", line)
        if found:
            operands = re.findall(r"%([\w.\-]+)", found.group(3).split("), ")[0])
            current.append((found.group(1), found.group(2), operands))
    return computations


def collective_users(hlo_text, opcode="collective-permute"):
    """``{instruction: sorted opcodes of its users}`` for every ``opcode`` instruction of a compiled
    program. Inside the ring's while body a ``collective-permute`` used only by the ROOT ``tuple``
    feeds nothing but the next iteration: no op of the current hop waits for the block in flight,
    so an asynchronous start/done pair may straddle the whole hop."""
    users = {}
    for instructions in _instructions(hlo_text).values():
        sent = {name for name, op, _ in instructions if op == opcode}
        for name in sent:
            users[name] = sorted(op for _, op, operands in instructions if name in operands)
    return users


def _kind(name, opcodes):
    op = opcodes.get(name) or re.sub(r"\.\d+$", "", name)  # fall back on the name: "all-gather.3"
    if op.startswith(CONTROL_FLOW):
        return None
    if op.startswith(COLLECTIVES) or name.startswith(("ppermute", "all_gather", "all_to_all", "psum")):
        return "collective"
    return "compute"


def _device_of(event, process_names):
    args = event.get("args", {})
    if "device_ordinal" in args:
        return int(args["device_ordinal"])
    found = re.search(r"/device:\w+:(\d+)", process_names.get(event.get("pid"), ""))
    return int(found.group(1)) if found else None


def spans_from_events(events, *, module=None, opcodes=None):
    """Per-device op spans from trace events (the ``traceEvents`` list of a Perfetto JSON trace).

    module: keep only ops of this HLO module (default: all); opcodes: ``hlo_opcodes(...)`` of the
    compiled program, to classify ops by opcode (default: by name). Control-flow ops are dropped.
    Returns :class:`Span` s sorted by (device, start), times relative to the earliest kept span.
    """
    opcodes = opcodes or {}
    process_names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    kept = []
    for event in events:
        args = event.get("args", {})
        if event.get("ph") != "X" or "hlo_op" not in args:
            continue
        if module is not None and args.get("hlo_module") != module:
            continue
        device, kind = _device_of(event, process_names), _kind(args["hlo_op"], opcodes)
        if device is None or kind is None:
            continue
        kept.append((device, kind, args["hlo_op"], float(event["ts"]), float(event["dur"])))
    t0 = min((k[3] for k in kept), default=0.0)
    return sorted((Span(d, kind, name, ts - t0, dur) for d, kind, name, ts, dur in kept),
                  key=lambda s: (s.device, s.start_us))


def read_trace(path):
    """The ``traceEvents`` of a (gzipped) Chrome/Perfetto JSON trace file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile(fn, *args, log_dir=None):
    """Compile ``jax.jit(fn)``, run it once to warm up, then once under ``jax.profiler.trace``.

    Returns a :class:`Profile` of that second run. log_dir: where the trace goes (default: a fresh
    temporary directory); the file is ``log_dir/plugins/profile/<run>/perfetto_trace.json.gz``.
    Profile in a process of its own (a notebook's kernel, ``benchmarks/timeline.py``): on JAX 0.12's
    CPU backend, a multi-device program with an all-reduce run *after* ``jax.profiler.trace`` in the
    same process was seen to stall in its rendezvous and abort (``tests/test_timeline.py``).
    """
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    hlo_text = compiled.as_text()
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text).group(1)
    jax.block_until_ready(compiled(*args))  # warm-up: allocations, thread pools
    log_dir = log_dir or tempfile.mkdtemp(prefix="ringattn_profile_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(compiled(*args))
    path = max(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
               key=os.path.getmtime)
    spans = spans_from_events(read_trace(path), module=module, opcodes=hlo_opcodes(hlo_text))
    return Profile(spans, hlo_text, module, path)


def profile_attention(attention_fn, *, seq=1024, heads=4, kv_heads=2, dim=32, causal=True, mesh=None,
                      log_dir=None, seed=0, **kwargs):
    """Profile one forward+backward (``jax.grad``) of ``attention_fn(q, k, v, mesh=, causal=, **kwargs)``
    (``ringattn_fast.ring_attention``, ``allgather_attention``, ``ulysses_attention``) over ``mesh``
    (default: ``ringattn_fast.make_mesh()`` of all devices) on float32 inputs
    q [1, seq, heads, dim], k, v [1, seq, kv_heads, dim]. Returns a :class:`Profile`."""
    import jax
    import jax.numpy as jnp

    import ringattn_fast

    mesh = mesh or ringattn_fast.make_mesh()
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, seq, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, seq, kv_heads, dim)), jnp.float32) for _ in range(2))

    def loss(q, k, v):
        return attention_fn(q, k, v, mesh=mesh, causal=causal, **kwargs).sum()

    return profile(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, log_dir=log_dir)


def profile_ring(*, layout="contiguous", **kwargs):
    """:func:`profile_attention` of ``ringattn_fast.ring_attention`` (keywords as there, and ``layout``)."""
    import ringattn_fast

    return profile_attention(ringattn_fast.ring_attention, layout=layout, **kwargs)


def _busy(spans):
    """Merge spans into disjoint ``[start, end)`` intervals."""
    merged = []
    for s in sorted(spans, key=lambda s: s.start_us):
        if merged and s.start_us <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s.end_us)
        else:
            merged.append([s.start_us, s.end_us])
    return merged


def overlap_fraction(spans):
    """``{device: share of its collective time during which it also ran a compute op}`` (0 when the
    collectives block the device, 1 when every transfer hides behind compute)."""
    result = {}
    for device in sorted({s.device for s in spans}):
        compute = _busy([s for s in spans if s.device == device and s.kind == "compute"])
        comm = _busy([s for s in spans if s.device == device and s.kind == "collective"])
        total = sum(e - b for b, e in comm)
        both = sum(max(0.0, min(e, ce) - max(b, cb)) for b, e in comm for cb, ce in compute)
        result[device] = both / total if total else 0.0
    return result


def busy_time(spans, kind):
    """``{device: total us}`` of ``kind`` (``"compute"`` / ``"collective"``), overlaps merged."""
    return {device: sum(e - b for b, e in _busy([s for s in spans if s.device == device and s.kind == kind]))
            for device in sorted({s.device for s in spans})}


def plot_timeline(spans, *, title=None, ax=None):
    """Per device (one row each), compute spans and collective spans over time (ms): a Gantt chart.

    Compute is drawn in the lower half of a row and collectives in the upper half, so that overlap
    (both at once) shows as stacked bars. Returns the matplotlib ``Figure``.
    """
    from ringattn_ref.viz import pyplot

    plt = pyplot()
    devices = sorted({s.device for s in spans})
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(devices) + 1.2))
    else:
        fig = ax.figure
    for row, device in enumerate(devices):
        for kind, y in (("compute", row - 0.4), ("collective", row)):
            bars = [(s.start_us / 1e3, s.dur_us / 1e3) for s in spans if s.device == device and s.kind == kind]
            ax.broken_barh(bars, (y, 0.38), facecolors=COLORS[kind], label=kind if row == 0 else None)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "measured timeline: compute and collectives per device")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
