"""The float32 half of ``benchmarks.bench_gpu``: the Triton kernel on the GPU against the XLA path.

Two checks, both forward and backward, both in float32 with no TF32 anywhere (``jax.default_matmul_precision
("highest")``; the kernel's own float32 matmuls never use TF32), each a JSON-able dict:

- ``hop``: one hop (``kernels.pallas_gpu.hop_fwd`` / ``hop_bwd``) against ``kernels.xla`` on the same
  inputs, causal and not, the kernel's default tiles for this GPU (``pallas_gpu.default_blocks``);
- ``ring``: ``ring_attention(impl="pallas_gpu")`` against ``ring_attention(impl="xla")`` over all local
  devices (one GPU: a ring of one, still the whole ``custom_vjp`` path), causal + segment ids + GQA.

Errors are max |ours - xla| over o, dq, dk, dv; a check passes when each is at most ``F32_TOL *
max(1, max |xla|)``: the two sum over keys in different orders, and at 2K-4K keys float32 rounding
differences of ~1e-6 relative accumulate (measured in the interpreter: <= 3e-6).
"""
from __future__ import annotations

F32_TOL = 1e-4
NAMES = ("o", "dq", "dk", "dv")


def _errors(ours, ref):
    import jax.numpy as jnp
    err = {n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for n, a, b in zip(NAMES, ours, ref)}
    top = {n: float(jnp.max(jnp.abs(b))) for n, b in zip(NAMES, ref)}
    return err, top, all(err[n] <= F32_TOL * max(1.0, top[n]) for n in NAMES)


def hop_check(*, seq, heads, dim, causal, seed=0, blocks=None):
    """One hop, float32: the Triton kernel vs the XLA hop (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from ringattn_fast.kernels import pallas_gpu, xla
    from ringattn_fast.mesh import current_device
    from ringattn_fast.schedule import HopConfig, KVShard, QShard

    shape = (1, seq, heads, dim)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.key(seed), 4))
    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    blocks = blocks or pallas_gpu.default_blocks(shape, shape, jnp.float32, current_device()) or (None, None)

    def run(module, cfg):
        def f(q, k, v, do):
            qs, kv = QShard(q, pos), KVShard(k, v, pos)
            o, lse = module.hop_fwd(qs, kv, cfg)
            delta = jnp.einsum("bshd,bshd->bhs", do, o.astype(jnp.float32))  # FA-2 D = rowsum(dO * O)
            return (o,) + tuple(module.hop_bwd(qs, kv, cfg, do=do, lse=lse, delta=delta)[:3])
        return jax.jit(f)

    opts = dict(scale=dim ** -0.5, causal=causal)
    with jax.default_matmul_precision("highest"):
        xla_tiles = HopConfig(**opts, block_q=min(seq, 1024), block_kv=min(seq, 1024))
        ref = jax.block_until_ready(run(xla, xla_tiles)(q, k, v, do))
        ours = jax.block_until_ready(run(pallas_gpu, HopConfig(**opts, block_q=blocks[0], block_kv=blocks[1]))(q, k, v, do))
    err, top, ok = _errors(ours, ref)
    return dict(check="float32 hop", seq=seq, heads=heads, dim=dim, causal=causal, blocks=list(blocks), err=err,
                ref_max=top, ok=ok, tol=F32_TOL)


def ring_check(*, n_devices, seq, heads, kv_heads, dim, seed=1):
    """The ring over ``n_devices`` local devices, float32, causal + segment ids + GQA: impl="pallas_gpu"
    (default tiles, picked for the device by the front door) vs impl="xla"."""
    import jax
    import jax.numpy as jnp

    from ringattn_fast import make_mesh, ring_attention

    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(key, (1, seq, heads, dim), jnp.float32) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, seq, kv_heads, dim), jnp.float32) for key in keys[2:])
    seg = (jnp.arange(seq, dtype=jnp.int32)[None] >= seq // 3).astype(jnp.int32)  # two documents
    mesh = make_mesh(n_devices)

    def run(impl):
        def f(q, k, v):
            o, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg,
                                                            impl=impl), q, k, v)
            return (o,) + vjp(do)
        return jax.jit(f)

    with jax.default_matmul_precision("highest"):
        ref = jax.block_until_ready(run("xla")(q, k, v))
        ours = jax.block_until_ready(run("pallas_gpu")(q, k, v))
    err, top, ok = _errors(ours, ref)
    return dict(check="float32 ring", devices=n_devices, seq=seq, heads=heads, kv_heads=kv_heads, dim=dim,
                causal=True, segments=True, err=err, ref_max=top, ok=ok, tol=F32_TOL)


def run_checks(*, dry_run, dim):
    """Both checks at the GPU's sizes (dry run: tiny, interpreted on CPU); returns their dicts. A check
    that raises is reported as failed, with its error, and the other still runs."""
    import jax

    seq, heads = (64, 2) if dry_run else (4096, 8)
    d = 32 if dry_run else dim
    n = min(2, len(jax.devices())) if dry_run else len(jax.devices())
    jobs = [("float32 hop", lambda c=c: hop_check(seq=seq, heads=heads, dim=d, causal=c)) for c in (False, True)]
    jobs.append(("float32 ring", lambda: ring_check(n_devices=n, seq=seq * n if dry_run else seq, heads=heads,
                                                    kv_heads=heads // 2, dim=d)))
    out = []
    for name, job in jobs:
        try:
            out.append(job())
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a failed check, not a crash
            out.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"))
    return out


def format_check(row):
    """One stderr line per check."""
    if "err" not in row:
        return f"{row['check']:<13} FAILED: {row['error']}"
    errs = " ".join(f"{n} {row['err'][n]:.1e}" for n in NAMES)
    what = (f"seq {row['seq']} h {row['heads']} d {row['dim']} causal {row['causal']} blocks {row['blocks']}"
            if row["check"] == "float32 hop" else
            f"{row['devices']} device(s) seq {row['seq']} h {row['heads']}/{row['kv_heads']} d {row['dim']} "
            "causal+segments")
    return f"{row['check']:<13} {what}: {errs} (tol {row['tol']:g} x max(1, |xla|)) {'ok' if row['ok'] else 'FAILED'}"
