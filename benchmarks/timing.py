"""How every benchmark measures time: a progress bar on stderr and median wall times of jobs timed
round-robin (``train.py``, ``decode.py``, ``strategies.py``, ``bench_gpu.py``; the one copy)."""
import statistics
import sys
import time


class Progress:
    """A plain-text progress bar on stderr: ``[#####.....] 5/10 ours causal fwd+bwd``."""

    def __init__(self, total, width=30):
        self.total, self.done, self.width, self.start = total, 0, width, time.perf_counter()

    def step(self, label):
        self.done += 1
        filled = self.width * self.done // self.total
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.0f}s  {label:<40}")
        sys.stderr.write("\n" if self.done == self.total else "")
        sys.stderr.flush()


def time_interleaved(jobs, repeats, warmup=0):
    """Median seconds of each job over ``repeats`` rounds, timed round-robin: on a shared machine a
    load spike then hits every implementation alike instead of biasing whichever ran during it.

    ``jobs``: zero-argument callables returning what to wait for (``functools.partial(compiled,
    *inputs)``, or a closure that also carries state, such as a decode step's cache); each timed
    call ends in ``jax.block_until_ready``. ``warmup``: untimed rounds first (compilation, caches).
    """
    import jax
    for _ in range(warmup):
        for job in jobs:
            jax.block_until_ready(job())
    times = [[] for _ in jobs]
    for _ in range(repeats):
        for t, job in zip(times, jobs):
            start = time.perf_counter()
            jax.block_until_ready(job())
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]
