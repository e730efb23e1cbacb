"""Benchmark: a measured timeline of one forward+backward, from the helper notebook 13 uses.

    python -m benchmarks.timeline                                   # the ring, 8 devices, S=1024
    python -m benchmarks.timeline --strategy allgather --seq 4096 --plot t.png --out t.json

Profiles the jitted forward+backward with ``jax.profiler`` (``ringattn_course.timeline``: Perfetto
trace -> per-device compute / collective spans), prints per device the compute time, the time in
collectives and the share of collective time that also computed, and what the compiled program
says about overlap: its collectives (a ``-start``/``-done`` pair is asynchronous) and, for the ring,
whether every ``collective-permute`` only feeds the next hop. JSON on stdout (or ``--out``).
"""
from __future__ import annotations

import argparse
import json
import sys

STRATEGIES = ("ring", "allgather", "ulysses")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ring", choices=STRATEGIES)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--causal", default="true", choices=["true", "false"])
    p.add_argument("--trace-dir", help="keep the Perfetto trace here (default: a temporary directory)")
    p.add_argument("--out", help="write the JSON summary here instead of stdout")
    p.add_argument("--plot", help="save the timeline figure to this image file")
    return p.parse_args(argv)


def summary(prof):
    """The numbers of one :class:`ringattn_course.timeline.Profile`, as a JSON-able dict."""
    from ringattn_course import timeline

    compute, comm = timeline.busy_time(prof.spans, "compute"), timeline.busy_time(prof.spans, "collective")
    overlap = timeline.overlap_fraction(prof.spans)
    users = timeline.collective_users(prof.hlo_text)
    return dict(
        collectives=timeline.collective_ops(prof.hlo_text),
        permutes_feed_only_next_hop=bool(users) and all(u == ["tuple"] for u in users.values()),
        wall_us=max((s.end_us for s in prof.spans), default=0.0),
        per_device=[dict(device=d, compute_us=round(compute[d], 1), collective_us=round(comm[d], 1),
                         overlap=round(overlap[d], 3)) for d in sorted(compute)],
        trace=prof.trace_path)


def main(argv=None):
    args = parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)

    import ringattn_fast as rf
    from ringattn_course import timeline

    fn = {"ring": rf.ring_attention, "allgather": rf.allgather_attention, "ulysses": rf.ulysses_attention}
    prof = timeline.profile_attention(fn[args.strategy], seq=args.seq, heads=args.heads,
                                      kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
                                      dim=args.dim, causal=args.causal == "true",
                                      mesh=rf.make_mesh(args.devices), log_dir=args.trace_dir)
    result = dict(strategy=args.strategy, devices=args.devices, seq=args.seq, heads=args.heads,
                  backend=jax.default_backend(), **summary(prof))
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    for row in result["per_device"]:
        print(f"device {row['device']}: compute {row['compute_us'] / 1e3:7.2f} ms, collectives "
              f"{row['collective_us'] / 1e3:7.2f} ms, overlap {row['overlap']:.0%}", file=sys.stderr)
    if args.plot:
        fig = timeline.plot_timeline(prof.spans, title=f"{args.strategy} fwd+bwd, {args.devices} devices, "
                                     f"S={args.seq} ({result['backend']})")
        fig.savefig(args.plot, dpi=120)
    return result


if __name__ == "__main__":
    main()
