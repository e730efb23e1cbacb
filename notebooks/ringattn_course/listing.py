"""Source listings in the notebooks: ``show_source(obj, ...)`` shows the code of the library itself.

Where a notebook's lesson is the code (``ring.ring_forward``, a kernel), the cell ends in
``show_source(ring.ring_forward)`` rather than ``print(inspect.getsource(ring.ring_forward))``: the
result is a :class:`Listing`, which Jupyter, Colab and the site (myst-nb) render as a highlighted
Python block (its ``text/markdown`` output is a ```` ```python ```` fence), and a plain-text
console shows (``repr``) or ``print`` writes as the bare source. Several objects give one listing,
in the order given, separated by a blank line.
"""
from __future__ import annotations

import inspect
import textwrap


class Listing:
    """The source code of one or more objects, shown as highlighted Python.

    ``source`` is the text, dedented (a method's listing starts at column 0). The rich output is
    ``text/markdown`` (one fenced block); ``text/plain`` and ``str()`` are the source itself.
    """

    def __init__(self, source: str):
        self.source = source

    def _repr_markdown_(self) -> str:
        fence = "````" if "```" in self.source else "```"  # a docstring may contain a fence
        return f"{fence}python\n{self.source}\n{fence}\n"

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return self.source

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's text/plain, without quotes
        printer.text(self.source)


def show_source(*objs) -> Listing:
    """The source of each of ``objs`` (functions, classes, methods, modules), as one :class:`Listing`.

    ``show_source(ring.Message, ring.send_to_next)`` as a cell's last line shows both definitions,
    highlighted. The code is found by ``inspect.getsource`` (``OSError`` where it finds none).
    """
    if not objs:
        raise TypeError("show_source() needs at least one object")
    return Listing("\n\n".join(textwrap.dedent(inspect.getsource(obj)).rstrip() for obj in objs))
