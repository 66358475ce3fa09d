"""`--lora-rank R`: fine-tune low-rank corrections of the attention projections with every base weight frozen
(LoRA, Hu et al. 2021; LoLCATs' second stage). A linearized model keeps its teacher's projections; what linear
attention misses is absorbed by W + (alpha / R) B A on q, k, v and the output, trained beside the feature maps
(and the hybrid's mix), which are new anyway.

Frozen weights need no gradients and no optimiser moments, so a step costs less time and memory than full
fine-tuning. The correction is a parametrization of each projection's weight: the state dict (and so a checkpoint)
holds base and adapters apart, and `merge_lora` folds them back into plain weights before the model is saved,
so the served file has no adapters and loads as any other model of its kind.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from model import Transformer

ADAPTED = ("qkv", "proj")  # the attention's fused q/k/v projection and its output projection
STILL_TRAINED = ("feature_map", "mix")  # new in a linearized model: no teacher weight to keep


class LowRankDelta(nn.Module):
    """weight (out, in) -> weight + scale * B A, with B (out, R) starting at zero: the model starts unchanged."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, in_features))
        self.b = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))  # as nn.Linear draws its own weights
        self.scale = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.b @ self.a).to(weight.dtype)


def adapted_projections(model: Transformer) -> list[nn.Linear]:
    """Each block's attention projections that LoRA corrects."""
    found = []
    for block in model.blocks:
        for name in ADAPTED:
            layer = getattr(block.attn, name, None)
            if isinstance(layer, nn.Linear):
                found.append(layer)
    return found


def add_lora(model: Transformer, rank: int, alpha: float) -> int:
    """Freeze every weight, add adapters to the attention projections and unfreeze them and the linearized
    attention's own new parts; returns the number of trainable parameters."""
    if rank < 1:
        raise ValueError(f"a LoRA rank must be at least 1, got {rank}")
    model.requires_grad_(False)
    for layer in adapted_projections(model):
        out_features, in_features = layer.weight.shape
        delta = LowRankDelta(out_features, in_features, min(rank, out_features, in_features), alpha)
        parametrize.register_parametrization(layer, "weight", delta.to(layer.weight.device))
    for name, parameter in model.named_parameters():
        if ".parametrizations.weight.0." in name or any(f".attn.{part}" in name for part in STILL_TRAINED):
            parameter.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def has_lora(model: nn.Module) -> bool:
    return any(parametrize.is_parametrized(m, "weight") for m in model.modules() if isinstance(m, nn.Linear))


def merge_lora(model: Transformer) -> None:
    """Fold every adapter into its weight (W + scale B A), leaving plain nn.Linear layers; all weights trainable
    again, as a model loaded from a file is."""
    with torch.no_grad():
        for layer in adapted_projections(model):
            if parametrize.is_parametrized(layer, "weight"):
                parametrize.remove_parametrizations(layer, "weight", leave_parametrized=True)
    model.requires_grad_(True)
