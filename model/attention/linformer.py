"""Linformer made causal, as an RNN.

Published Linformer projects keys and values along the whole sequence with
E, F (k x n), which mixes future positions. The causal form keeps, per head,
  K~_i = sum_{j<=i} E[:, j] k_j^T   and   V~_i = sum_{j<=i} F[:, j] v_j^T   (k x D)
and computes out_i = softmax(q_i K~_i^T / sqrt(D)) V~_i over the k projected
slots. The state is O(k D) per head whatever the length.

The parallel path is chunked like linear attention's: inside a block of
`BLOCK` positions, q_i K~_i^T is exact as a masked (C, C) product times E
plus q_i against the running K~ from earlier blocks, and attn_i V~_i likewise
with F. It costs O(T C (D + k) + T k D), never the O(T^2 k) of one masked
(T, T) product, and never holds a (T, k, D) tensor of prefix sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from ..config import ModelConfig
from .head_shapes import chunk_positions, merge_heads
from .projections import FusedProjections
from ..state import RowState

BLOCK = 64


@dataclass
class LinformerState(RowState):
    keys_projected: torch.Tensor  # (B, H, k, D) float32: K~, keys summed into the k slots by E
    # V~ stored transposed, (B, H, D, k): a step's read attn V~ then sums along contiguous memory,
    # as its read of K~ (q K~^T) does, and both updates are elementwise (timings: benchmarks/results/NOTES.md).
    values_projected_t: torch.Tensor  # (B, H, D, k) float32: V~^T, values summed into the k slots by F

    @property
    def values_projected(self) -> torch.Tensor:
        return self.values_projected_t.transpose(-1, -2)  # (B, H, k, D): V~


def _exclusive_block_prefix(per_block: torch.Tensor, initial: torch.Tensor | None) -> torch.Tensor:
    """(B, H, N, k, D) sums of each block -> what each block sees from earlier ones (and the state)."""
    before = F.pad(per_block.cumsum(2), (0, 0, 0, 0, 1, 0))[:, :, :-1]  # (B, H, N, k, D)
    return before if initial is None else before + initial[:, :, None]


def _blocks(x: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """(B, H, T, X) -> (B, H, N, C, X), zero-padded at the end: zero keys, values
    and projection columns add nothing to the sums."""
    x = F.pad(x, (0, 0, 0, n * size - x.shape[2]))
    return x.reshape(*x.shape[:2], n, size, x.shape[-1])


def linformer_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor,
    f: torch.Tensor,
    keys0: torch.Tensor | None,
    values0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact causal Linformer over a chunk, starting from (K~, V~) = (keys0, values0) or zeros if None.

    q, k, v: (B, H, T, D); e, f: (B or 1, H or 1, T, k) projection columns at the chunk's positions;
    keys0, values0: (B, H, k, D) or None. Returns out (B, H, T, D) and the final K~, V~ (B, H, k, D).
    """
    b, h, t, d = q.shape
    size = min(BLOCK, t)
    n = -(-t // size)
    qb, kb, vb, eb, fb = (_blocks(x, n, size) for x in (q, k, v, e, f))  # (B, H, N, C, D or k)
    keys_per_block = eb.transpose(-1, -2) @ kb  # (B, H, N, k, D)
    values_per_block = fb.transpose(-1, -2) @ vb  # (B, H, N, k, D)
    keys_before = _exclusive_block_prefix(keys_per_block, keys0)
    values_before = _exclusive_block_prefix(values_per_block, values0)
    qk = (qb @ kb.transpose(-1, -2)).tril()  # (B, H, N, C, C): q_i . k_j, j <= i inside the block
    scores = qk @ eb + qb @ keys_before.transpose(-1, -2)  # (B, H, N, C, k): q_i K~_i^T
    attn = torch.softmax(scores / math.sqrt(d), dim=-1)  # (B, H, N, C, k)
    weights = (attn @ fb.transpose(-1, -2)).tril()  # (B, H, N, C, C): attn_i . F[:, j], j <= i
    out = weights @ vb + attn @ values_before  # (B, H, N, C, D): attn_i V~_i
    out = out.reshape(b, h, n * size, d)[:, :, :t]
    return out, keys_before[:, :, -1] + keys_per_block[:, :, -1], values_before[:, :, -1] + values_per_block[:, :, -1]


class LinformerAttention(FusedProjections, Attention):
    capabilities = Capabilities(constant_state=True, graphable=True, paddable=True, compilable=True)

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # Scores against and sums into K~, V~ (k x D per head), which are read and written whole.
        h, k, d = cfg.n_heads, cfg.linformer_k, cfg.d_head
        return TokenCost(flops=8 * h * k * d, state_bytes=2 * 2 * h * k * d * STATE_NUMBER_BYTES)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # The config leaves Linformer the plain block (model/attention/kinds.py declares no block option it
        # implements): as many key as query heads, biases, no rotary positions.
        self._build_projections(cfg)
        self.slots = cfg.linformer_k  # k: the length keys and values are projected to
        # "none": one E and F per head; "headwise": shared by heads; "kv": E = F.
        n_proj = cfg.n_heads if cfg.linformer_sharing == "none" else 1
        std = 1.0 / math.sqrt(cfg.max_len)  # keeps sum_j E[:, j] k_j of order one
        self.e = nn.Parameter(torch.randn(n_proj, cfg.linformer_k, cfg.max_len) * std)
        self.f = None if cfg.linformer_sharing == "kv" else nn.Parameter(torch.randn_like(self.e) * std)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LinformerState:
        del dtype  # sums accumulate in float32
        shape = (batch, self.n_heads, self.slots, self.proj.in_features // self.n_heads)
        return LinformerState(
            torch.zeros(shape, device=device), torch.zeros(shape, device=device).transpose(-1, -2).contiguous()
        )

    def _columns(self, proj: torch.Tensor, start: torch.Tensor, t: int, state: LinformerState | None) -> torch.Tensor:
        """Columns of E or F (H or 1, k, max_len) at the chunk's positions -> (B or 1, H or 1, T, k)."""
        if state is None:  # a whole sequence from position 0: one slice serves every row
            return proj[None, :, :, :t].transpose(-1, -2).float()
        return proj[:, :, chunk_positions(start, t)].permute(2, 0, 3, 1).float()

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: LinformerState | None
    ) -> tuple[torch.Tensor, LinformerState | None]:
        q, k, v = self._project(x, start, widen=True)  # (B, H, T, D) each, float32
        t = q.shape[2]
        e = self._columns(self.e, start, t, state)
        f = e if self.f is None else self._columns(self.f, start, t, state)
        if state is None:
            y, _, _ = linformer_chunked(q, k, v, e, f, None, None)
        elif t == 1:
            y = self._step(q, k, v, e, f, state)
        else:
            y, keys, values = linformer_chunked(q, k, v, e, f, state.keys_projected, state.values_projected)
            state.keys_projected.copy_(keys)
            state.values_projected.copy_(values)
        return self.proj(merge_heads(y.to(x.dtype))), state

    def _step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, f: torch.Tensor, state: LinformerState
    ) -> torch.Tensor:
        """One token per row, state updated in place first (a query sees itself).

        q, k, v: (B, H, 1, D); e, f: (B, H or 1, 1, k). Returns (B, H, 1, D)."""
        if torch.compiler.is_compiling():
            return self._fused_step(q, k, v, e, f, state)
        state.keys_projected.addcmul_(e.transpose(-1, -2), k)  # (B, H, k, D) += E[:, i] k_i^T
        state.values_projected_t.addcmul_(v.transpose(-1, -2), f)  # (B, H, D, k) += v_i F[:, i]^T
        scores = q @ state.keys_projected.transpose(-1, -2)  # (B, H, 1, k)
        attn = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
        return attn @ state.values_projected  # (B, H, 1, D)

    @staticmethod
    def _fused_step(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, f: torch.Tensor, state: LinformerState
    ) -> torch.Tensor:
        """The same step written for inductor: reads go to the state before its update, and the
        update's share is added apart (q . (K~ + E k^T) = q . K~ + E (q . k)), so one loop over
        each state tensor both reads it and updates it in place."""
        keys, values_t = state.keys_projected, state.values_projected_t  # (B, H, k, D), (B, H, D, k)
        scores = q @ keys.transpose(-1, -2) + e * (q * k).sum(-1, keepdim=True)  # (B, H, 1, k)
        attn = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, 1, k)
        out = attn @ values_t.transpose(-1, -2) + (attn * f).sum(-1, keepdim=True) * v  # (B, H, 1, D)
        keys.addcmul_(e.transpose(-1, -2), k)  # (B, H, k, D) += E[:, i] k_i^T
        values_t.addcmul_(v.transpose(-1, -2), f)  # (B, H, D, k) += v_i F[:, i]^T
        return out
