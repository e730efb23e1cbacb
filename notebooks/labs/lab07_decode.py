"""Lab 7: decode over a sequence-sharded KV cache -- attend locally, then merge with pmax and psum.

Notebook 11 (inference) is the background; ``ringattn_fast/inference.py`` is the full version (do
not call it or ``ringattn_ref.inference``: that is the answer). One new token per row attends to the
row's whole history. Rotating the cache around the ring would move ``S / N`` keys per host per token
for ``4 d S / N`` FLOPs; instead every host attends the query to its own shard of the cache and the
``N`` partial results are merged with two all-reduces whatever ``N``:

1. locally: ``o_r`` (normalised over this host's seen slots) and ``lse_r`` per head;
2. ``M = pmax(lse_r)``, the global max, so that no ``exp`` below overflows;
3. one ``psum`` of ``[exp(lse_r - M) o_r, exp(lse_r - M)]``: numerator and denominator of the merge
   over all hosts at once; ``o = numerator / denominator``.

Write ``decode_attention_shard(q, k, v, lengths, *, axis_name)``, the per-host function inside
``jax.shard_map`` (the grader wraps it: q and lengths replicated, ``P()``; the cache ``P(None,
"sp")``; it takes your output from every host). The cache is striped, as ``ringattn_fast.inference``
keeps it: slot ``i`` of host ``r`` holds position ``i * N + r``. q: [b, 1, h, d], this step's query
(the token at position ``lengths[b] - 1``); k, v: [b, c, hk, d], this host's cache shard (the new
token's K/V already written; slots at positions ``>= lengths[b]`` hold garbage: stale tokens that look
like data, or any value at all, so only ``lengths`` tells which slots are the row's); lengths: int32 [b],
the tokens each row holds. ``scale = d ** -0.5``; query head ``j`` reads kv head ``j // (h // hk)``.
Return o [b, 1, h, d] in q's dtype, the same on every host. ``lax.pmax``, ``lax.psum``,
``lax.axis_index``, ``lax.axis_size``; a host may see nothing (lse -inf): no NaN.

Grade: ``python notebooks/labs/grade.py lab07 your_file.py``. The grader exports your function,
compiles it and drives it itself: caches of 3, 5 and 8 hosts with a different history length per row
(0 included), then three decode steps (it appends each token's K/V), one with logits past float64's
``exp`` range. It checks every host's output against the float64 oracle over the row's whole history
(to 1e-10) and, from the compiled program, that the only collectives are all-reduces, at most two per
token, each of at most ``b h (d + 1)`` numbers: never the cache.
"""
import jax.numpy as jnp
from jax import lax


def decode_attention_shard(q, k, v, lengths, *, axis_name):
    """This step's attention output o [b, 1, h, d] over the whole cache, the same on every host."""
    raise NotImplementedError("lab07: write decode_attention_shard (see the docstring)")
