"""Applications of the two libraries, run from the repository root and not installed (like ``benchmarks/``).

- ``python -m examples.demo`` (``bash scripts/demo.sh``): ``ringattn_ref``'s ring simulation on 8
  virtual hosts against plain attention; needs numpy and matplotlib only.
- ``python -m examples.recall.train``: a small model trained with ``ringattn_fast``'s ring on
  associative recall, against the same model limited to one shard (``docs/training.md``).
"""
