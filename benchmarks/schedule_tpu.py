"""The static schedule of each TPU kernel, from a deviceless compile: no chip, libtpu installed.

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m benchmarks.schedule_tpu --seq 8192 [--causal] [--heads 32/8]
    ... -m benchmarks.schedule_tpu --set EXP2=True --set FULL_TILE_WHERE=True   # a form of kernels/pallas_tpu.py

(libtpu beside the venv: ``scripts/setup-libtpu``). It compiles the forward+backward of the default call
(``ring_attention`` on a 1-chip mesh, bfloat16, batch 1) and of splash attention (blocks 1024, its fused
backward, its own layout with q pre-scaled) for a chip that is not here
(``jax.experimental.topologies``), with libtpu asked to write each kernel's final VLIW bundles
(``--xla_jf_dump_to``, ``--xla_jf_dump_llo_text``: undocumented flags of the compiler; a libtpu without
them gives no rows). For every Pallas kernel it reads the bundles and splits them at branches. A TPU core
issues one bundle a cycle, in the compiler's order. A stretch between branches that holds matmuls is a
tile's compute: a ``pl.when`` branch of the kernel (a full tile, a partial one, a sub-tile).

One JSON object per kernel to stdout: ``bundles`` (the whole kernel), ``tiles`` (each such stretch,
largest first: ``bundles``, ``vmatmul``, ``per_vmatmul`` (bundles per matmul push, comparable across tile
sizes and kernels doing the same matmuls), ``ops`` (count per op name's first part: ``vld``, ``vst``,
``vmul``, ``vexp2``, ``vpop``...)). A table to stderr.

These are counts, not times. The chip stalls on top of them (matmul results, DMA, the transpose unit),
and work moved from one unit to another need not show: the fused backward's dS K cast before its
transpose (``pallas_tpu.DQ_FORM = "cast"``) has 286 fewer bundles a tile and measured 0.4-1.0 % slower
on a v5e (docs/benchmarks.md). What they do show exactly is what a change of a kernel's source does
to the instructions of its tile (which ops, how many) before any chip time is spent on it.
"""
from __future__ import annotations

import argparse
import ast
import collections
import glob
import importlib
import json
import os
import re
import shutil
import sys
import tempfile

BRANCH = "sbr.rel"
KERNEL = re.compile(r"^\d+-((?:ring|splash)_[a-z0-9_]+)\.\d+-\d+-final_bundles\.txt$")
TOPOLOGIES = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.schedule_tpu", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens (default 8192)")
    p.add_argument("--heads", default="8", help="H or H/Hkv (default 8)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--chip", default="v5e", choices=sorted(TOPOLOGIES))
    p.add_argument("--kinds", default="ours,splash", help="comma list of ours, splash")
    p.add_argument("--set", action="append", default=[], metavar="[MODULE.]NAME=VALUE",
                   help="a module constant of ringattn_fast.kernels (default module pallas_tpu) set while "
                        "ours is compiled, a Python literal (repeatable)")
    args = p.parse_args(argv)
    h, _, hk = args.heads.partition("/")
    args.heads, args.kv_heads = int(h), int(hk or h)
    if args.seq < 1 or args.heads % args.kv_heads:
        p.error(f"--seq must be >= 1 and --heads H/Hkv with Hkv dividing H; got {args.seq}, {args.heads}/{args.kv_heads}")
    args.kinds = args.kinds.split(",")
    if not set(args.kinds) <= {"ours", "splash"}:
        p.error(f"--kinds: a comma list of ours, splash; got {','.join(args.kinds)}")
    args.patches = [_patch(p, s) for s in args.set]
    return args


def _patch(parser, text):
    """(module, name, value) of ``[MODULE.]NAME=VALUE``."""
    target, _, value = text.partition("=")
    module, _, name = target.rpartition(".")
    try:
        return f"ringattn_fast.kernels.{module or 'pallas_tpu'}", name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parser.error(f"--set: NAME=VALUE with VALUE a Python literal; got {text!r}")


def stretches(lines):
    """The bundle lines split at branches: lists of consecutive bundles, each ending before a branch bundle."""
    out, cur = [], []
    for line in lines:
        cur.append(line)
        if BRANCH in line:
            out.append(cur)
            cur = []
    return out + [cur]


def summary(lines):
    """``bundles`` and the tile stretches (those with matmuls) of one kernel's final bundle lines."""
    tiles = []
    for part in stretches(lines):
        ops = collections.Counter(m.split(".")[0] for line in part for m in re.findall(r"= ([a-z][a-z0-9_.]*)", line))
        if ops["vmatmul"]:
            tiles.append(dict(bundles=len(part), vmatmul=ops["vmatmul"], per_vmatmul=round(len(part) / ops["vmatmul"], 3),
                              ops=dict(sorted(ops.items()))))
    return dict(bundles=len(lines), tiles=sorted(tiles, key=lambda t: -t["bundles"]))


def read_dump(folder):
    """{kernel name: summary} of every Pallas kernel's final bundles in a libtpu dump folder."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*final_bundles.txt"))):
        m = KERNEL.match(os.path.basename(path))
        if m:
            with open(path) as f:
                out[m.group(1)] = summary([line for line in f if re.match(r"\s*(0x[0-9a-f]+|0)\s", line)])
    return out


def functions(args, mesh):
    """{kind: attention(q, k, v)} on [1, s, h, d] arrays, for the mesh of one compile-only chip."""
    import ringattn_fast as rf
    out = {}
    if "ours" in args.kinds:
        out["ours"] = lambda q, k, v: rf.ring_attention(q, k, v, mesh=mesh, causal=args.causal)
    if "splash" in args.kinds:
        from .bench_tpu import splash_kernel
        kernel = splash_kernel(args.seq, args.heads, causal=args.causal)
        t = lambda x: x.swapaxes(1, 2)  # noqa: E731  (splash's [h, s, d] per batch row; prepared outside a timed call)
        out["splash"] = lambda q, k, v: t(kernel(t(q * args.dim ** -0.5), t(k), t(v)))
    return out


def compile_vjp(attn, mesh, args):
    import jax
    import jax.numpy as jnp
    sharding = jax.sharding.NamedSharding(mesh, jax.P())
    q = jax.ShapeDtypeStruct((1, args.seq, args.heads, args.dim), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, args.seq, args.kv_heads, args.dim), jnp.bfloat16, sharding=sharding)

    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o,) + vjp(do)
    jax.jit(f).trace(q, kv, kv, q).lower().compile()


def main(argv=None):
    """One compile per kind into one dump folder (removed at the end); 2 where libtpu is not importable or
    ``--set`` names nothing, 3 where libtpu writes no kernel's bundles."""
    args = parse_args(argv)
    try:
        importlib.import_module("libtpu")
    except ImportError:
        print("schedule_tpu: libtpu is not importable: put it on PYTHONPATH (scripts/setup-libtpu)", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="schedule_tpu_")  # libtpu reads its flags when JAX first starts the TPU client
    flags = f"--xla_jf_dump_to={root}/dump --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final_bundles"
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(x for x in (os.environ.get("LIBTPU_INIT_ARGS"), flags) if x)
    saved = []
    try:
        import jax
        import numpy as np
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(TOPOLOGIES[args.chip], "tpu", chips_per_host_bounds=(1, 1, 1),
                                               num_slices=1, chip_config_name="default").devices
        mesh = jax.sharding.Mesh(np.array(devices[:1]), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
        for module, name, value in args.patches:
            mod = importlib.import_module(module)
            if not hasattr(mod, name):
                print(f"schedule_tpu: --set: {module} has no {name}", file=sys.stderr)
                return 2
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        return report(args, mesh, f"{root}/dump")
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        shutil.rmtree(root, ignore_errors=True)


def report(args, mesh, dump):
    """Compile each kind and print its kernels' rows (the dump folder gathers them all: each kind's are the
    new ones); 3 where a compile left no kernel's bundles."""
    seen = set()
    for kind, attn in functions(args, mesh).items():
        compile_vjp(attn, mesh, args)
        new = {k: row for k, row in read_dump(dump).items() if k not in seen}
        if not new:
            print("schedule_tpu: libtpu wrote no kernel bundles (its dump flags are undocumented: this libtpu may "
                  "not take them)", file=sys.stderr)
            return 3
        for kernel, row in new.items():
            seen.add(kernel)
            row = dict(kind=kind, kernel=kernel, chip=args.chip, seq=args.seq, heads=f"{args.heads}/{args.kv_heads}",
                       dim=args.dim, causal=args.causal, set=args.set if kind == "ours" else [], **row)
            print(json.dumps(row), flush=True)
            tile = row["tiles"][0] if row["tiles"] else {}
            print(f"{kind:7s} {kernel:32s} bundles {row['bundles']:6d}  largest tile {tile.get('bundles', 0):6d} bundles "
                  f"{tile.get('vmatmul', 0):5d} vmatmul {tile.get('per_vmatmul', 0):6.3f} a vmatmul", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
