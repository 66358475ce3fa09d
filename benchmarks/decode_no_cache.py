"""The paper's baseline: softmax with no cache, re-running the whole prefix at every step. Measured for the first
pixels only and at a few sampled later positions, then summed over all positions by linear interpolation: an
extrapolation, and labelled as one."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
import torch

from model.decode.sampling import BatchSampling, sample
from model.transformer import Transformer, with_bos

from .decode_settings import DecodeSettings
from .decode_timing import sampling_for, timed


@dataclass
class NoCacheResult:
    batch: int
    measured_pixels: int
    measured_seconds: float  # the first measured_pixels steps, really run
    sampled_steps: list[dict]  # {"position", "seconds"}: one step at a later position
    seconds: float  # whole image, extrapolated
    images_per_s: float
    tokens_per_s: float
    extrapolated: bool = True
    method: str = (
        "first pixels measured step by step; later steps timed at sampled positions; "
        "total = measured + linear interpolation of step time over the remaining positions"
    )


@torch.inference_mode()
def _no_cache_step(model: Transformer, tokens: torch.Tensor, position: int, sampling: BatchSampling) -> torch.Tensor:
    """Predict tokens[:, position] by re-running the whole prefix: what cache-less reference code does."""
    logits, _ = model(with_bos(tokens[:, : position + 1]), None)  # (B, position+1, V)
    where = torch.full((tokens.shape[0],), position, dtype=torch.long, device=tokens.device)
    return sample(logits[:, -1], sampling, where)


def measure_no_cache(model: Transformer, batch: int, settings: DecodeSettings) -> NoCacheResult:
    """Softmax without a cache: first pixels run for real, later steps sampled, total interpolated."""
    device, total = model.device, settings.image_tokens
    measured = min(settings.nocache_pixels, total)
    sampling = sampling_for(batch, device)
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)  # (B, 784)
    _no_cache_step(model, tokens, 0, sampling)  # warm-up

    def step(pos: int) -> None:
        tokens[:, pos] = _no_cache_step(model, tokens, pos, sampling)

    first = [timed(lambda p=pos: step(p), device) for pos in range(measured)]
    gen = torch.Generator().manual_seed(settings.seed)
    tokens[:, measured:] = torch.randint(0, 256, (batch, total - measured), generator=gen).to(device)
    sampled = [
        {"position": pos, "seconds": timed(lambda p=pos: _no_cache_step(model, tokens, p, sampling), device)}
        for pos in _later_positions(measured, total, settings.nocache_samples)
    ]
    rest = _interpolated_sum(first, sampled, measured, total)
    seconds = sum(first) + rest
    return NoCacheResult(batch, measured, sum(first), sampled, seconds, batch / seconds, batch * total / seconds)


def _later_positions(measured: int, total: int, count: int) -> list[int]:
    if measured >= total or count < 1:
        return []
    return sorted({int(round(p)) for p in np.linspace(measured, total - 1, count)})


def _interpolated_sum(first: list[float], sampled: list[dict], measured: int, total: int) -> float:
    """Sum of step times over positions measured..total-1, linear between known points."""
    if measured >= total:
        return 0.0
    xs = [measured - 1] + [s["position"] for s in sampled]
    ys = [statistics.median(first[-4:])] + [s["seconds"] for s in sampled]  # end of the real run, denoised
    return float(np.interp(np.arange(measured, total), xs, ys).sum())
