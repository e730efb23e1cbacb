"""What every benchmark script does with its rows: JSON lines as they come, then a configuration
line, a markdown table and an optional figure (``train.py``, ``decode.py``, ``strategies.py``), and
the pieces those tables share (length labels, ratio cells, the help format of the command line)."""
import argparse
import json
import sys


def open_rows(path):
    """Where the JSON lines go: ``path`` (opened for writing) or stdout."""
    return open(path, "w") if path else sys.stdout


def emit(row, out):
    """One measurement as a JSON line, flushed so a long run shows progress."""
    print(json.dumps(row), file=out, flush=True)


def finish(rows, out, args, table, plot, config):
    """Close ``out`` (unless stdout), print :func:`config_line` ``(config)`` and ``table(rows)`` to
    stderr, save ``plot(rows, args.plot)``."""
    if args.out:
        out.close()
    print(f"{config_line(config)}\n\n{table(rows)}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)


def doc_lengths(spec, seq, weights):
    """Packed documents' lengths: ``spec`` (``--doc-lengths``, a comma list) or ``weights`` scaled to ``seq``
    (the last document takes the rest); a SystemExit unless they are positive and sum to ``seq``."""
    if spec:
        lengths = [int(x) for x in spec.split(",")]
    else:
        lengths = [w * seq // sum(weights) for w in weights[:-1]]
        lengths.append(seq - sum(lengths))
    if sum(lengths) != seq or min(lengths) < 1:
        raise SystemExit(f"--doc-lengths must be positive and sum to --seq {seq}; got {lengths}")
    return lengths


def config_line(config):
    """``config: devices=8; batch=1; ...; jax=0.12.0; backend=cpu``: what a table measured, so that a
    table pasted elsewhere still says it (the JAX version and backend are added here)."""
    import jax
    items = dict(config, jax=jax.__version__, backend=jax.default_backend())
    return "config: " + "; ".join(f"{key}={value}" for key, value in items.items())


def length_label(n):
    """A token count as a label: ``"8K"`` when it is a whole number of 1024s, else the integer
    (``"256"``, ``"1536"``): never a rounded ``"0K"``."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def lengths_label(lengths):
    """Comma list of :func:`length_label` (the lengths of a run, for its configuration line)."""
    return ",".join(length_label(n) for n in lengths)


def ratio(x, base):
    """A table cell ``x / base`` (``"1.84x"``), measured in the same run; ``"n/a"`` without a base."""
    return f"{x / base:.2f}x" if base else "n/a"


def log2_length_axis(ax, lengths, label="sequence length"):
    """A log2 x axis ticked at exactly the measured lengths, labelled by :func:`length_label`."""
    lengths = sorted(set(lengths))
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [length_label(n) for n in lengths])
    ax.set_xticks([], minor=True)
    ax.set_xlabel(label)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` of the benchmarks: the epilog as written (mode lists), and each option's default
    appended to its help unless the default is None / False or the help already names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if action.option_strings and not shown and "%(default)" not in text and "default" not in text:
            text = f"{text} (default %(default)s)".strip()
        return text


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (benchmarks run headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
