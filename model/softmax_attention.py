"""Softmax attention with a preallocated KV cache written by position."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .heads import chunk_positions, merge_heads, split_heads
from .state import RowState


@dataclass
class KVCache(RowState):
    k: torch.Tensor  # (B, H, max_len, D)
    v: torch.Tensor  # (B, H, max_len, D)

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        # Only positions already written hold information: grows with length.
        _, h, _, d = self.k.shape
        per_position = 2 * h * d * self.k.element_size()
        return int(lengths.sum()) * per_position


class SoftmaxAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.max_len = cfg.max_len
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (batch, self.n_heads, self.max_len, self.proj.in_features // self.n_heads)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: KVCache | None):
        q, k, v = (split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, D)
        if state is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self._attend_cached(q, k, v, start, state)
        return self.proj(merge_heads(y)), state

    def _attend_cached(self, q, k, v, start, state: KVCache) -> torch.Tensor:
        b, _, t, _ = q.shape
        pos = chunk_positions(start, t)  # (B, T)
        rows = torch.arange(b, device=q.device)[:, None]
        # Advanced indices on dims 0 and 2 put (B, T) first: (B, T, H, D).
        state.k[rows, :, pos] = k.transpose(1, 2).to(state.k.dtype)
        state.v[rows, :, pos] = v.transpose(1, 2).to(state.v.dtype)
        used = int(pos.max()) + 1  # attend only to the written prefix
        # For torch.compile, which cannot see the value: at least one key, and narrow (not a slice)
        # gives exactly `used` of them.
        torch._check(used > 0)
        keys, values = state.k.narrow(2, 0, used), state.v.narrow(2, 0, used)
        mask = torch.arange(used, device=q.device) <= pos[:, :, None]  # (B, T, L)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None])
