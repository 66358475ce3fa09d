"""Intra-op CPU threads in threads other than the main one.

torch.set_num_threads sets OpenMP's thread count for the calling thread only.
A thread started later keeps OpenMP's default (every core) until its first
torch call that reads the count, and a matrix product does not read it: an
engine or compile thread would run its first products, and inductor's loops,
on every core while the process was told one. Each such thread calls
`adopt_process_threads` first.
"""

from __future__ import annotations

import torch


def adopt_process_threads(count: int | None = None) -> int:
    """Give the calling thread `count` intra-op threads, by default the process's count; returns it."""
    threads = count or torch.get_num_threads()  # the process's count, as torch.set_num_threads last set it
    torch.set_num_threads(threads)
    return threads
