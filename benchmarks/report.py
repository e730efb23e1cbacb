"""What every benchmark script does with its rows: JSON lines as they come, then a markdown table and
an optional figure (``bench.py``, ``decode.py``, ``strategies.py``)."""
import json
import sys


def open_rows(path):
    """Where the JSON lines go: ``path`` (opened for writing) or stdout."""
    return open(path, "w") if path else sys.stdout


def emit(row, out):
    """One measurement as a JSON line, flushed so a long run shows progress."""
    print(json.dumps(row), file=out, flush=True)


def finish(rows, out, args, table, plot):
    """Close ``out`` (unless stdout), print ``table(rows)`` to stderr, save ``plot(rows, args.plot)``."""
    if args.out:
        out.close()
    print(table(rows), file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (benchmarks run headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
