"""Linformer made causal, as an RNN.

Published Linformer projects keys and values along the whole sequence with
E, F (k x n), which mixes future positions. The causal form keeps, per head,
  K~_i = sum_{j<=i} E[:, j] k_j^T   and   V~_i = sum_{j<=i} F[:, j] v_j^T   (k x D)
and computes out_i = softmax(q_i K~_i^T / sqrt(D)) V~_i. The state is
O(k D) per head whatever the length.

The parallel path never builds K~_i for every i: q_i K~_i^T equals
sum_{j<=i} (q_i . k_j) E[:, j], a masked (T, T) product times E, and
attn_i V~_i equals sum_{j<=i} (attn_i . F[:, j]) v_j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .attention import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from .config import ModelConfig
from .heads import causal_mask, chunk_positions, merge_heads, split_heads
from .state import RowState


@dataclass
class LinformerState(RowState):
    k_proj: torch.Tensor  # (B, H, k, D) float32: K~
    v_proj: torch.Tensor  # (B, H, k, D) float32: V~


class LinformerAttention(Attention):
    capabilities = Capabilities(constant_state=True, graphable=True, paddable=True)

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # Scores against and sums into K~, V~ (k x D per head), which are read and written whole.
        h, k, d = cfg.n_heads, cfg.linformer_k, cfg.d_head
        return TokenCost(flops=8 * h * k * d, state_bytes=2 * 2 * h * k * d * STATE_NUMBER_BYTES)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.k = cfg.linformer_k
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # "none": one E and F per head; "headwise": shared by heads; "kv": E = F.
        n_proj = cfg.n_heads if cfg.linformer_sharing == "none" else 1
        std = 1.0 / math.sqrt(cfg.max_len)  # keeps sum_j E[:, j] k_j of order one
        self.e = nn.Parameter(torch.randn(n_proj, cfg.linformer_k, cfg.max_len) * std)
        self.f = None if cfg.linformer_sharing == "kv" else nn.Parameter(torch.randn_like(self.e) * std)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LinformerState:
        del dtype  # sums accumulate in float32
        shape = (batch, self.n_heads, self.k, self.proj.in_features // self.n_heads)
        return LinformerState(torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def _columns(self, proj: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Columns of E or F at positions (B, T) -> (B, H or 1, T, k)."""
        return proj[:, :, pos].permute(2, 0, 3, 1).float()

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: LinformerState | None):
        q, k, v = (split_heads(t, self.n_heads).float() for t in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, D)
        t, d = q.shape[2], q.shape[3]
        pos = chunk_positions(start, t)
        e = self._columns(self.e, pos)
        f = e if self.f is None else self._columns(self.f, pos)
        mask = causal_mask(t, x.device)
        qk = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, T, T)
        scores = qk @ e  # (B, H, T, k): q_i . K~_i restricted to this chunk
        if state is not None:
            scores = scores + q @ state.k_proj.transpose(-1, -2)
        attn = torch.softmax(scores / math.sqrt(d), dim=-1)  # (B, H, T, k)
        weights = (attn @ f.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, T, T)
        y = weights @ v
        if state is not None:
            y = y + attn @ state.v_proj
            state.k_proj.add_(e.transpose(-1, -2) @ k)
            state.v_proj.add_(f.transpose(-1, -2) @ v)
        return self.proj(merge_heads(y.to(x.dtype))), state
