"""ringattn_course — the notebook course's own helpers, kept out of the libraries.

- :mod:`ringattn_course.exercises` -- the ``check_*`` self-checks of every notebook's exercises;
- :mod:`ringattn_course.figures` -- the figures of notebooks 06-12 (the roofline, memory per device,
  tile schedules, the fused ring's double buffer, decode, training). The figures of the simulated
  ring stay in the library (:mod:`ringattn_ref.viz`, :mod:`ringattn_ref.viz_blocks`: the demo draws
  them too).
- :mod:`ringattn_course.physics` -- the cost physics of notebooks 06-13: a roofline (HBM bandwidth
  per chip of Table 2) and an alpha-beta model of messages and collectives;
- :mod:`ringattn_course.schedules` -- the compiled schedules of a real 8-chip TPU v5e program (kernels and
  transfers in schedule order, saved as JSON beside it; notebook 06);
- :mod:`ringattn_course.hlo` -- reads a compiled program: which ``collective-permute``s can overlap
  the hop, and how many bytes each collective moves;
- :mod:`ringattn_course.listing` -- ``show_source(obj, ...)``, the library's code as a highlighted
  listing (Jupyter, Colab and the site), exported here: ``from ringattn_course import show_source``.

It lives next to the notebooks (``notebooks/ringattn_course/``), so a kernel started in
``notebooks/`` imports it as is; ``pip install -e .`` (or ``pip install ".[notebooks]"``, as the
Colab copies do) installs it with the libraries (``[tool.setuptools] package-dir`` in
``pyproject.toml``).
"""

from ringattn_course.listing import Listing, show_source  # noqa: F401  (the notebooks import it from here)
