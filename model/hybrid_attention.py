"""Hybrid attention: exact softmax over a sliding window of the last W tokens, linear attention over everything
older, one shared normaliser (LoLCATs, Zhang et al. 2025). Pixels and characters depend most on their
neighbours, which pure linear attention blurs; the window keeps them sharp while the state stays constant.

For query i at position p_i, with s_ij = q_i . k_j / sqrt(D) and m_i the largest s_ij in the window:

    window  (p_i - W < p_j <= p_i):  a_ij = g exp(s_ij - m_i)
    older   (p_j <= p_i - W):        a_ij = (1 - g) phi(q_i) . phi(k_j)
    y_i = sum_j a_ij v_j / (sum_j a_ij + eps)

g = sigmoid(mix), one learned mix per head. The decode state is a ring buffer of the last W keys and values
(slot = position mod W) plus the linear sums S = sum phi(k) v^T and Z = sum phi(k) of the keys that left it:
constant in length. One function attends a chunk of any length from any state (a whole sequence is a chunk from
the empty state): the chunk's keys beside the ring's, masked by position, so decoding, chunked prefill and the
parallel form compute the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from .config import ModelConfig
from .feature_maps import feature_count, make_feature_map, projected_count
from .heads import chunk_positions, merge_heads, split_heads
from .state import RowState


@dataclass
class HybridState(RowState):
    k: torch.Tensor  # (B, H, W, D) float32: the window's keys, slot = position mod W
    v: torch.Tensor  # (B, H, W, D) float32: its values
    s: torch.Tensor  # (B, H, F, D) float32: sum of phi(k) v^T over the keys that left the window
    z: torch.Tensor  # (B, H, F) float32: sum of phi(k) over them


@dataclass(frozen=True)
class Past:
    """What a chunk sees before itself: the window's keys and values in position order, and the linear sums."""

    k: torch.Tensor  # (B, H, W, D)
    v: torch.Tensor  # (B, H, W, D)
    positions: torch.Tensor  # (B, W); negative where nothing was written yet
    s: torch.Tensor  # (B, H, F, D)
    z: torch.Tensor  # (B, H, F)


class HybridAttention(Attention):
    capabilities = Capabilities(constant_state=True, graphable=False, paddable=True, compilable=False)

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # The window's scores and weighted sum, the linear read and one key's move into the sums.
        h, d, w = cfg.n_heads, cfg.d_head, cfg.hybrid_window
        f = feature_count(cfg.hybrid_feature_map, d, cfg.hybrid_features)
        mapping = 0 if cfg.hybrid_feature_map == "elu" else 4 * h * d * projected_count(d, cfg.hybrid_features)
        flops = 4 * h * min(t, w) * d + 4 * h * f * d + mapping
        state = 2 * h * (2 * w * d + f * d + f) * STATE_NUMBER_BYTES
        return TokenCost(flops=flops, state_bytes=state)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.d_head, self.window = cfg.n_heads, cfg.d_head, cfg.hybrid_window
        self.eps = cfg.hybrid_eps
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.feature_map = make_feature_map(cfg.hybrid_feature_map, cfg.n_heads, cfg.d_head, cfg.hybrid_features)
        self.features = feature_count(cfg.hybrid_feature_map, cfg.d_head, cfg.hybrid_features)  # F
        self.mix = nn.Parameter(torch.zeros(cfg.n_heads))  # g = sigmoid(mix): the window's share, per head

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> HybridState:
        del dtype  # float32 whatever the model's dtype, as linear attention's sums
        h, w, d, f = self.n_heads, self.window, self.d_head, self.features
        zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return HybridState(zeros(batch, h, w, d), zeros(batch, h, w, d), zeros(batch, h, f, d), zeros(batch, h, f))

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: HybridState | None):
        q, k, v = (split_heads(t, self.n_heads).float() for t in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, D)
        if state is None:  # a whole sequence from position 0: training and scoring
            return self.proj(merge_heads(self._attend_in_blocks(q, k, v).to(x.dtype))), None
        positions = chunk_positions(start, x.shape[1])  # (B, T)
        past = self._past(state, start, q)
        # The past's keys beside the chunk's, mapped once: attending and advancing the state both read them.
        keys, values = torch.cat([past.k, k], dim=2), torch.cat([past.v, v], dim=2)  # (B, H, L, D)
        key_pos = torch.cat([past.positions, positions], dim=1)  # (B, L)
        phi_k = self.feature_map(keys)  # (B, H, L, F)
        y = self._attend(q, keys, values, key_pos, phi_k, positions, past)
        if state is not None:
            self._advance(state, k, v, values, key_pos, phi_k, positions, past)
        return self.proj(merge_heads(y.to(x.dtype))), state

    def _attend_in_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same sums as `_attend` for a whole sequence (B, H, T, D) from position 0, in blocks of W positions:
        a query's window lies in its own block and the one before, and every older key sits in that block or in
        the sums of the blocks before it, so the work grows as T W rather than T^2."""
        b, h, t, d = q.shape
        w = self.window
        n = -(-t // w)  # blocks; the last is padded with zeros that no real query reaches
        q, k, v = (F.pad(x, (0, 0, 0, n * w - t)) for x in (q, k, v))
        phi_q = self.feature_map(q).view(b, h, n, w, -1)  # (B, H, N, W, F)
        phi_k = self.feature_map(k).view(b, h, n, w, -1)
        q, k, v = (x.view(b, h, n, w, d) for x in (q, k, v))
        keys, values, phi_keys = (torch.cat([F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :n], x], dim=3) for x in (k, v, phi_k))
        in_window, older = self._block_masks(n, q.device)  # (N, W, 2W) each: the block before, then its own
        scores = (q @ keys.transpose(-1, -2)) * self.d_head**-0.5  # (B, H, N, W, 2W)
        scores = scores.masked_fill(~in_window, float("-inf"))
        window = torch.exp(scores - scores.amax(-1, keepdim=True))
        linear = (phi_q @ phi_keys.transpose(-1, -2)).masked_fill(~older, 0.0)  # (B, H, N, W, 2W)
        # Keys two blocks back or more: their sums, blocks 0 .. c-2 for block c.
        s_old = F.pad((phi_k.transpose(-1, -2) @ v).cumsum(2), (0, 0, 0, 0, 2, 0))[:, :, :n]  # (B, H, N, F, D)
        z_old = F.pad(phi_k.sum(3).cumsum(2), (0, 0, 2, 0))[:, :, :n]  # (B, H, N, F)
        g = torch.sigmoid(self.mix.float())[None, :, None, None, None]  # (1, H, 1, 1, 1)
        weights = g * window + (1 - g) * linear
        numerator = weights @ values + (1 - g) * (phi_q @ s_old)  # (B, H, N, W, D)
        denominator = weights.sum(-1) + (1 - g[..., 0]) * (phi_q @ z_old[..., None])[..., 0]  # (B, H, N, W)
        y = numerator / (denominator[..., None] + self.eps)
        return y.reshape(b, h, n * w, d)[:, :, :t]

    def _block_masks(self, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For query i of a block and key j of [block before, own block] (j = W + i is the query itself): whether
        j is in i's window, and whether it is older than the window. Block 0 has no block before it."""
        w = self.window
        i = torch.arange(w, device=device)[:, None]
        j = torch.arange(2 * w, device=device)[None, :]
        exists = (torch.arange(blocks, device=device) > 0)[:, None, None] | (j >= w)  # (N, 1 or W, 2W)
        return exists & (j > i) & (j <= i + w), exists & (j <= i)

    def _past(self, state: HybridState, start: torch.Tensor, q: torch.Tensor) -> Past:
        """The ring's keys and values ordered by position (start - W .. start - 1) and the sums, as copies."""
        positions = start[:, None] - self.window + torch.arange(self.window, device=start.device)  # (B, W)
        slots = positions.remainder(self.window)[:, None, :, None].expand(-1, self.n_heads, -1, self.d_head)
        return Past(state.k.gather(2, slots), state.v.gather(2, slots), positions, state.s.clone(), state.z.clone())

    def _attend(self, q, keys, values, key_positions, phi_k, positions: torch.Tensor, past: Past) -> torch.Tensor:
        """Queries (B, H, T, D) at `positions` (B, T) over the past's keys and the chunk's own -> (B, H, T, D)."""
        key_pos = key_positions[:, None, None, :]  # (B, 1, 1, L)
        query_pos = positions[:, None, :, None]  # (B, 1, T, 1)
        written = key_pos >= 0
        in_window = written & (key_pos <= query_pos) & (key_pos > query_pos - self.window)
        older = written & (key_pos <= query_pos - self.window)
        scores = (q @ keys.transpose(-1, -2)) * self.d_head**-0.5  # (B, H, T, L)
        scores = scores.masked_fill(~in_window, float("-inf"))
        window = torch.exp(scores - scores.amax(-1, keepdim=True))  # each query's own key is in its window
        phi_q = self.feature_map(q)  # (B, H, T, F)
        linear = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~older, 0.0)  # (B, H, T, L)
        g = torch.sigmoid(self.mix.float())[None, :, None, None]  # (1, H, 1, 1)
        weights = g * window + (1 - g) * linear
        numerator = weights @ values + (1 - g) * (phi_q @ past.s)  # (B, H, T, D)
        denominator = weights.sum(-1) + (1 - g[..., 0]) * (phi_q @ past.z[..., None])[..., 0]  # (B, H, T)
        return numerator / (denominator[..., None] + self.eps)

    def _advance(self, state: HybridState, k, v, values, key_pos, phi_k, positions: torch.Tensor, past: Past) -> None:
        """The keys that leave the window by the chunk's end go into the sums; the last W keys into the ring."""
        leaving = (key_pos >= 0) & (key_pos <= positions[:, -1:] - self.window)  # (B, L)
        phi_k = phi_k * leaving[:, None, :, None]  # (B, H, L, F)
        state.s.copy_(past.s + phi_k.transpose(-1, -2) @ values)
        state.z.copy_(past.z + phi_k.sum(2))
        last = min(k.shape[2], self.window)
        slots = positions[:, -last:].remainder(self.window)[:, None, :, None].expand(-1, self.n_heads, -1, self.d_head)
        state.k.scatter_(2, slots, k[:, :, -last:])
        state.v.scatter_(2, slots, v[:, :, -last:])
