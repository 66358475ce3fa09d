"""Explicit map from attention kind name to its module class."""

from __future__ import annotations

from torch import nn

from .linear_attention import LinearAttention
from .linformer_attention import LinformerAttention
from .reformer_attention import ReformerAttention
from .softmax_attention import SoftmaxAttention


def attention_registry() -> dict[str, type[nn.Module]]:
    return {
        "softmax": SoftmaxAttention,
        "linear": LinearAttention,
        "linformer": LinformerAttention,
        "reformer": ReformerAttention,
    }
