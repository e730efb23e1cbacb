"""The recall experiment: ``tasks`` (associative recall, every fact more than one shard before its
question) and ``train`` (``python -m examples.recall.train``: the ring model against a one-shard
window on the same batches). The model itself is the library's, ``ringattn_fast.model``."""
