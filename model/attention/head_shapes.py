"""Small shape helpers shared by the attention kinds."""

from __future__ import annotations

import torch


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, C) -> (B, H, T, C/H)."""
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def chunk_positions(start: torch.Tensor, length: int) -> torch.Tensor:
    """Absolute positions of a chunk: (B,) start -> (B, T)."""
    return start[:, None] + torch.arange(length, device=start.device)
