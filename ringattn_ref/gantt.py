"""When does each host compute and send? A timing model of the ring from its :class:`RingTrace`.

The trace records *what* each host does at each step (``flops``, ``bytes_sent``); this module adds
*when*, for a host that computes ``F`` FLOP/s and sends ``B`` bytes/s to its right neighbour (§3 of
arXiv:2310.01889). Compute of step ``s`` takes ``flops[i, s] / F``, the send posted at the top of
step ``s`` takes ``bytes_sent[i, s] / B``, and a host starts step ``s + 1`` only when

- its compute of step ``s`` is done,
- the block from its left neighbour has arrived (that send ended), and
- its own send has left (its held buffer becomes the next receive buffer: double buffering).

A send of step ``s`` cannot start before the receiver has started step ``s`` (its receive buffer is
free only then). With equal work everywhere, a step lasts ``max(compute, transfer)``: the ring
runs at the compute's pace when ``c >= F/B`` and at the links' pace otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import positive


@dataclass(frozen=True)
class RingTimeline:
    """Seconds at which each host computes and sends at each step; arrays ``[n_hosts, n_steps]``.

    compute_start / compute_end: the hop's compute (``compute_end == compute_start`` for a skipped
    hop); send_start / send_end: the K/V send posted at that step (zero length when nothing is sent).
    """
    compute_start: np.ndarray
    compute_end: np.ndarray
    send_start: np.ndarray
    send_end: np.ndarray

    @property
    def total_s(self):
        """Wall time of the forward ring: the last compute to finish."""
        return float(self.compute_end[:, -1].max())

    def busy_fraction(self):
        """Per host, the fraction of the total time spent computing, ``[n_hosts]``."""
        return (self.compute_end - self.compute_start).sum(axis=1) / self.total_s


def ring_timeline(trace, flops_per_s, bandwidth_bytes_per_s):
    """The :class:`RingTimeline` of ``trace`` on hosts of ``flops_per_s`` and ``bandwidth_bytes_per_s``.

    trace: a :class:`ringattn_ref.ring.RingTrace` (``ring_attention(..., return_trace=True)``).
    """
    f = positive("flops_per_s", flops_per_s)
    b = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    t_compute = np.asarray(trace.flops, dtype=float) / f  # (hosts, steps)
    t_send = np.asarray(trace.bytes_sent, dtype=float) / b  # (hosts, steps), 0 at the last step
    n, n_steps = t_compute.shape
    starts, sends = np.zeros((n, n_steps)), np.zeros((n, n_steps))
    for step in range(n_steps):
        if step > 0:
            ready = np.maximum(starts[:, step - 1] + t_compute[:, step - 1], sends[:, step - 1] + t_send[:, step - 1])
            arrived = np.roll(sends[:, step - 1] + t_send[:, step - 1], 1)  # host i receives from i - 1
            starts[:, step] = np.maximum(ready, arrived)
        sends[:, step] = np.maximum(starts[:, step], np.roll(starts[:, step], -1))  # receiver i + 1 ready
    return RingTimeline(starts, starts + t_compute, sends, sends + t_send)
