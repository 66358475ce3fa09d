"""The parts of a block besides attention, one class per option value (model/architecture.py declares them):
the norms, the feed-forwards and rotary positions. The model picks each from a table by its config."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, no bias and no mean (Llama). Computed in float32 and cast back before the weight, as
    Hugging Face's LlamaRMSNorm does, so that a 16-bit model rounds where the reference rounds."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., C)
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.LayerNorm | RMSNorm:
    if cfg.norm == "rms":
        return RMSNorm(cfg.d_model, cfg.ln_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)


class GeluFeedForward(nn.Module):
    """down(gelu(up x)) (GPT-2, rnnserve's own models)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ff_bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ff_bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.drop(self.down(F.gelu(self.up(x), approximate=self.approximate)))
        return y

    def last_layer(self) -> nn.Linear:
        return self.down


class SwiGLUFeedForward(nn.Module):
    """down(silu(gate x) * up x) (Llama, Qwen2, Mistral)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ff_bias)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ff_bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ff_bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))
        return y

    def last_layer(self) -> nn.Linear:
        return self.down


FEED_FORWARDS: dict[str, type[GeluFeedForward] | type[SwiGLUFeedForward]] = {
    "gelu": GeluFeedForward,
    "swiglu": SwiGLUFeedForward,
}


def build_feed_forward(cfg: ModelConfig) -> GeluFeedForward | SwiGLUFeedForward:
    return FEED_FORWARDS[cfg.feed_forward](cfg)


def rotary_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """(D/2,) float32 angular frequencies of rotary positions, stretched as `rope_scaling` asks (Llama 3's
    scheme: long wavelengths slowed by the factor, short ones kept, the band between blended)."""
    d = cfg.d_head
    freq: torch.Tensor = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    factor: float = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return freq / factor
    if cfg.rope_scaling != "llama3":
        return freq
    original: int = cfg.rope_original_max_len
    low: float = cfg.rope_low_freq_factor
    high: float = cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / freq
    scaled = torch.where(wavelength > original / low, freq / factor, freq)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)


class Rotary(nn.Module):
    """Rotary positions: each pair (x_i, x_{i + D/2}) of a query or key turned by position x frequency i (the
    half-split pairing of Hugging Face's Llama). The frequencies stay float32 whatever the model's dtype."""

    frequencies: torch.Tensor  # (D/2,)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("frequencies", rotary_frequencies(cfg), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """Moves and casts keep the frequencies float32, as the reference computes its angles."""
        frequencies = self.frequencies
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply unannotated
        self.frequencies = frequencies.to(device=self.frequencies.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) at positions (B, T) -> x turned, same shape and dtype."""
        angles = positions[:, None, :, None].float() * self.frequencies  # (B, 1, T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (B, 1, T, D)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin
