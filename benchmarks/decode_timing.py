"""Wall-clock timing of a benchmark's region (synchronised on CUDA), and the sampling its generations draw with."""

from __future__ import annotations

import time

import torch

from model.decode.sampling import BatchSampling, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def sampling_for(batch: int, device: torch.device) -> BatchSampling:
    return BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)], device)
