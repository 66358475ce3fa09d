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

An imported model's block options (model/architecture.py) hold as in softmax attention: rotary positions turn q
and k before the scores and phi; in grouped-query attention the ring, S and Z are per key head, read by the
key head's group of query heads, and a learned phi is per key head too; biases as the block has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from ..config import ModelConfig
from .feature_maps import (
    HedgehogFeatureMap,
    ProjectedFeatureMap,
    T2RFeatureMap,
    feature_count,
    make_feature_map,
    projected_count,
)
from .head_shapes import chunk_positions, merge_heads
from .projections import FusedProjections
from ..state import RowState


@dataclass
class HybridState(RowState):
    k: torch.Tensor  # (B, KV, W, D) in the cache dtype: the window's keys, slot = position mod W (rotary-turned)
    v: torch.Tensor  # (B, KV, W, D) in the cache dtype: its values
    s: torch.Tensor  # (B, KV, F, D) float32: sum of phi(k) v^T over the keys that left the window
    z: torch.Tensor  # (B, KV, F) float32: sum of phi(k) over them


@dataclass(frozen=True)
class Past:
    """What a chunk sees before itself: the window's keys and values in position order, and the linear sums."""

    k: torch.Tensor  # (B, KV, W, D)
    v: torch.Tensor  # (B, KV, W, D)
    positions: torch.Tensor  # (B, W); negative where nothing was written yet
    s: torch.Tensor  # (B, KV, F, D)
    z: torch.Tensor  # (B, KV, F)


class HybridAttention(FusedProjections, Attention):
    capabilities = Capabilities(constant_state=True, graphable=False, paddable=True, compilable=True)
    # The ring is a cache of keys and values: it takes the model's --kv-cache-dtype (bfloat16 halves the bytes a
    # step reads from it; the sums S and Z stay float32 whatever the dtype, as they add up every key that left).
    kv_cache = True

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # The window's scores and weighted sum, the linear read and one key's move into the sums.
        h, kv, d, w = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.hybrid_window
        f = feature_count(cfg.hybrid_feature_map, d, cfg.hybrid_features)
        mapping = 0 if cfg.hybrid_feature_map == "elu" else 2 * (h + kv) * d * projected_count(d, cfg.hybrid_features)
        flops = 4 * h * min(t, w) * d + 2 * (h + kv) * f * d + mapping
        ring = 2 * kv * 2 * w * d * STATE_NUMBER_BYTES  # read, and its slot written: the cached part
        state = ring + 2 * kv * (f * d + f) * STATE_NUMBER_BYTES
        return TokenCost(flops=flops, state_bytes=state, cached_bytes=ring)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # The same layers, names and shapes as softmax attention's for the same block options, so that a softmax
        # model's weights load into its hybrid twin (a warm start copies them by name, training/warm_start.py).
        # Rotary positions turn q and k before the window's scores and the feature map (as LoLCATs does): the ring
        # keeps keys turned, as softmax's cache does.
        self._build_projections(cfg)
        self.window: int = cfg.hybrid_window
        self.eps: float = cfg.hybrid_eps
        # Per key head: a group's queries share its map, so phi(k) and the sums are one per key head.
        self.feature_map = make_feature_map(cfg.hybrid_feature_map, cfg.n_kv_heads, cfg.d_head, cfg.hybrid_features)
        self.features = feature_count(cfg.hybrid_feature_map, cfg.d_head, cfg.hybrid_features)  # F
        self.mix = nn.Parameter(torch.zeros(cfg.n_heads))  # g = sigmoid(mix): the window's share, per query head
        self._kernel_on = False  # the C++ step (model/kernels/hybrid_decode.cpp), on where its sizes are taken

    @property
    def cpu_decode_kernel(self) -> bool:
        return self._kernel_on

    @cpu_decode_kernel.setter
    def cpu_decode_kernel(self, on: bool) -> None:
        """model/kernels/loader.py turns the kernel on once it is loaded. It stays off for sizes the build does not
        take and for weights it does not read (it reads float32 mixes and maps): both fixed from here on, so asked
        here, once, rather than at every step."""
        self._kernel_on = bool(on) and self.kernel_takes()

    def kernel_takes(self) -> bool:
        """Whether the loaded kernels take this layer: its sizes (head, map, window) in this build, float32 weights."""
        projection = self.projection()
        projected = projection.weight.shape[1] if projection is not None else 0  # P
        weights = [self.mix, *self.feature_map.parameters()]
        return all(w.dtype == torch.float32 for w in weights) and bool(
            torch.ops.rnnserve.hybrid_step_takes(self.d_head, projected, self.window)
        )

    def projection(self) -> ProjectedFeatureMap | None:
        """The learned map's projection (t2r, Hedgehog), or None for elu + 1."""
        return self.feature_map if isinstance(self.feature_map, ProjectedFeatureMap) else None

    def map_kind(self) -> int:
        """The kernels' number for this layer's feature map: 0 elu + 1, 1 t2r, 2 Hedgehog."""
        if isinstance(self.feature_map, HedgehogFeatureMap):
            return 2
        return 1 if isinstance(self.feature_map, T2RFeatureMap) else 0

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> HybridState:
        """The ring in `dtype` (the cache dtype), the sums float32 as linear attention's."""
        kv, w, d, f = self.n_kv_heads, self.window, self.d_head, self.features

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        ring = (batch, kv, w, d)
        return HybridState(
            zeros(*ring, dtype=dtype), zeros(*ring, dtype=dtype), zeros(batch, kv, f, d), zeros(batch, kv, f)
        )

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: HybridState | None
    ) -> tuple[torch.Tensor, HybridState | None]:
        positions = chunk_positions(start, x.shape[1])  # (B, T)
        q, k, v = self._project(x, start, widen=True, positions=positions)  # (B, H, T, D), (B, KV, T, D) twice, float32
        if state is None:  # a whole sequence from position 0: training and scoring
            return self.proj(merge_heads(self._attend_in_blocks(q, k, v).to(x.dtype))), None
        if x.shape[1] == 1:  # decoding
            return self.proj(merge_heads(self._step(q, k, v, start, state).to(x.dtype))), state
        past = self._past(state, start)
        # The past's keys beside the chunk's, mapped once: attending and advancing the state both read them.
        keys, values = torch.cat([past.k, k], dim=2), torch.cat([past.v, v], dim=2)  # (B, KV, L, D)
        key_pos = torch.cat([past.positions, positions], dim=1)  # (B, L)
        phi_k = self.feature_map(keys)  # (B, KV, L, F)
        y = self._attend(q, keys, values, key_pos, phi_k, positions, past)
        self._advance(state, k, v, values, key_pos, phi_k, positions, past)
        return self.proj(merge_heads(y.to(x.dtype))), state

    def _attend_in_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same sums as `_attend` for a whole sequence from position 0, q (B, H, T, D) over k, v (B, KV, T, D),
        in blocks of W positions: a query's window lies in its own block and the one before, and every older key
        sits in that block or in the sums of the blocks before it, so the work grows as T W rather than T^2. A key
        head's group of query heads is worked on as (B, KV, G, ...), the keys with a group axis of 1."""
        b, h, t, d = q.shape
        kv_heads, w = k.shape[1], self.window
        n = -(-t // w)  # blocks; the last is padded with zeros that no real query reaches
        q, k, v = (F.pad(x, (0, 0, 0, n * w - t)) for x in (q, k, v))
        phi_q = self.feature_map(q).view(b, kv_heads, -1, n, w, self.features)  # (B, KV, G, N, W, F)
        phi_k = self.feature_map(k).view(b, kv_heads, 1, n, w, self.features)  # (B, KV, 1, N, W, F)
        q = q.view(b, kv_heads, -1, n, w, d)
        k, v = (x.view(b, kv_heads, 1, n, w, d) for x in (k, v))
        # The block before beside each block's own: (B, KV, 1, N, 2W, D or F)
        keys, values, phi_keys = (
            torch.cat([F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :, :n], x], dim=4) for x in (k, v, phi_k)
        )
        in_window, older = self._block_masks(n, q.device)  # (N, W, 2W) each: the block before, then its own
        scores = (q @ keys.transpose(-1, -2)) * self.d_head**-0.5  # (B, KV, G, N, W, 2W)
        scores = scores.masked_fill(~in_window, float("-inf"))
        window = torch.exp(scores - scores.amax(-1, keepdim=True))
        linear = (phi_q @ phi_keys.transpose(-1, -2)).masked_fill(~older, 0.0)  # (B, KV, G, N, W, 2W)
        # Keys two blocks back or more: their sums, blocks 0 .. c-2 for block c.
        s_old = F.pad((phi_k.transpose(-1, -2) @ v).cumsum(3), (0, 0, 0, 0, 2, 0))[:, :, :, :n]  # (B, KV, 1, N, F, D)
        z_old = F.pad(phi_k.sum(4).cumsum(3), (0, 0, 2, 0))[:, :, :, :n]  # (B, KV, 1, N, F)
        g = torch.sigmoid(self.mix.float()).view(1, kv_heads, -1, 1, 1, 1)  # (1, KV, G, 1, 1, 1)
        weights = g * window + (1 - g) * linear
        numerator = weights @ values + (1 - g) * (phi_q @ s_old)  # (B, KV, G, N, W, D)
        denominator = weights.sum(-1) + (1 - g[..., 0]) * (phi_q @ z_old[..., None])[..., 0]  # (B, KV, G, N, W)
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

    def _step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, state: HybridState
    ) -> torch.Tensor:
        """One token per row, q (B, H, 1, D), k and v (B, KV, 1, D) at positions `start` (B,) -> (B, H, 1, D).
        The key that leaves the window now sits in the new key's slot: it moves into the sums, the new key takes
        its place, and the ring then holds exactly the window, in slot order (a softmax needs no other order)."""
        if self._kernel_applies(q, state):
            return self._kernel_step(q, k, v, start, state)
        w, kv_heads = self.window, self.n_kv_heads
        slot = start.remainder(w)[:, None, None, None].expand(-1, kv_heads, 1, self.d_head)  # (B, KV, 1, D)
        leaving = (start >= w).to(q.dtype)[:, None, None, None]  # (B, 1, 1, 1): a key written W positions ago
        phi_old = self.feature_map(state.k.gather(2, slot).float()) * leaving  # (B, KV, 1, F)
        state.s.add_(phi_old.transpose(-1, -2) @ state.v.gather(2, slot).float())
        state.z.add_(phi_old[:, :, 0])
        state.k.scatter_(2, slot, k.to(state.k.dtype))  # rounded to the cache dtype, as the kernel stores it
        state.v.scatter_(2, slot, v.to(state.v.dtype))
        ring_k, ring_v = state.k.float(), state.v.float()  # (B, KV, W, D): the cache widened, as the kernel loads it
        written = torch.arange(w, device=start.device)[None, :] <= start[:, None]  # (B, W): slots reached so far
        phi_q = torch.unflatten(self.feature_map(q), 1, (kv_heads, -1))  # (B, KV, G, 1, F)
        scores = (torch.unflatten(q, 1, (kv_heads, -1)) @ ring_k[:, :, None].transpose(-1, -2)) * self.d_head**-0.5
        scores = scores.masked_fill(~written[:, None, None, None, :], float("-inf"))  # (B, KV, G, 1, W)
        window = torch.exp(scores - scores.amax(-1, keepdim=True))
        g = torch.sigmoid(self.mix.float()).view(1, kv_heads, -1, 1, 1)  # (1, KV, G, 1, 1)
        numerator = g * (window @ ring_v[:, :, None]) + (1 - g) * (phi_q @ state.s[:, :, None])  # (B, KV, G, 1, D)
        linear_sum = (phi_q @ state.z[:, :, None, :, None])[..., 0]  # (B, KV, G, 1)
        denominator = g[..., 0] * window.sum(-1) + (1 - g[..., 0]) * linear_sum
        return (numerator / (denominator[..., None] + self.eps)).flatten(1, 2)

    def _kernel_applies(self, q: torch.Tensor, state: HybridState) -> bool:
        # The kernel reads float32 CPU queries (`_project` widens them) and a contiguous state, which a state's row
        # operations could change; anything else takes the eager step rather than the kernel's refusal.
        return (
            self._kernel_on
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and all(t.is_contiguous() for t in (state.k, state.v, state.s, state.z))
        )

    def _kernel_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, state: HybridState
    ) -> torch.Tensor:
        """`_step` as one C++ call (model/kernels/hybrid_decode.cpp): the same sums, the state moved on in place."""
        projection = self.projection()
        weight = projection.weight.detach() if projection is not None else None  # (KV, P, D)
        bias = projection.bias.detach() if projection is not None else None  # (KV, P)
        out: torch.Tensor = torch.ops.rnnserve.hybrid_decode_attention(
            q,
            k,
            v,
            start,
            state.k,
            state.v,
            state.s,
            state.z,
            self.mix.detach(),
            weight,
            bias,
            self.map_kind(),
            self.eps,
        )
        return out

    def _past(self, state: HybridState, start: torch.Tensor) -> Past:
        """The ring's keys and values ordered by position (start - W .. start - 1) and the sums, as copies."""
        positions = start[:, None] - self.window + torch.arange(self.window, device=start.device)  # (B, W)
        slots = positions.remainder(self.window)[:, None, :, None].expand(-1, self.n_kv_heads, -1, self.d_head)
        keys, values = (
            state.k.gather(2, slots).float(),
            state.v.gather(2, slots).float(),
        )  # widened from the cache dtype
        return Past(keys, values, positions, state.s.clone(), state.z.clone())

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_positions: torch.Tensor,
        phi_k: torch.Tensor,
        positions: torch.Tensor,
        past: Past,
    ) -> torch.Tensor:
        """Queries (B, H, T, D) at `positions` (B, T) over the past's keys and the chunk's own, (B, KV, L, D)
        -> (B, H, T, D). Each key head serves its group of H / KV query heads: they are worked on as (B, KV, G, ...)."""
        kv_heads = keys.shape[1]
        key_pos = key_positions[:, None, None, None, :]  # (B, 1, 1, 1, L)
        query_pos = positions[:, None, None, :, None]  # (B, 1, 1, T, 1)
        written = key_pos >= 0
        in_window = written & (key_pos <= query_pos) & (key_pos > query_pos - self.window)
        older = written & (key_pos <= query_pos - self.window)
        phi_q = torch.unflatten(self.feature_map(q), 1, (kv_heads, -1))  # (B, KV, G, T, F)
        q = torch.unflatten(q, 1, (kv_heads, -1))  # (B, KV, G, T, D)
        keys, values, phi_k = keys[:, :, None], values[:, :, None], phi_k[:, :, None]  # (B, KV, 1, L, D or F)
        scores = (q @ keys.transpose(-1, -2)) * self.d_head**-0.5  # (B, KV, G, T, L)
        scores = scores.masked_fill(~in_window, float("-inf"))
        window = torch.exp(scores - scores.amax(-1, keepdim=True))  # each query's own key is in its window
        linear = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~older, 0.0)  # (B, KV, G, T, L)
        g = torch.sigmoid(self.mix.float()).view(1, kv_heads, -1, 1, 1)  # (1, KV, G, 1, 1)
        weights = g * window + (1 - g) * linear
        numerator = weights @ values + (1 - g) * (phi_q @ past.s[:, :, None])  # (B, KV, G, T, D)
        denominator = weights.sum(-1) + (1 - g[..., 0]) * (phi_q @ past.z[:, :, None, :, None])[..., 0]  # (B, KV, G, T)
        return (numerator / (denominator[..., None] + self.eps)).flatten(1, 2)

    def _advance(
        self,
        state: HybridState,
        k: torch.Tensor,
        v: torch.Tensor,
        values: torch.Tensor,
        key_pos: torch.Tensor,
        phi_k: torch.Tensor,
        positions: torch.Tensor,
        past: Past,
    ) -> None:
        """The keys that leave the window by the chunk's end go into the sums; the last W keys into the ring."""
        leaving = (key_pos >= 0) & (key_pos <= positions[:, -1:] - self.window)  # (B, L)
        phi_k = phi_k * leaving[:, None, :, None]  # (B, KV, L, F)
        state.s.copy_(past.s + phi_k.transpose(-1, -2) @ values)
        state.z.copy_(past.z + phi_k.sum(2))
        last = min(k.shape[2], self.window)
        slots = positions[:, -last:].remainder(self.window)[:, None, :, None]
        slots = slots.expand(-1, self.n_kv_heads, -1, self.d_head)
        state.k.scatter_(2, slots, k[:, :, -last:].to(state.k.dtype))
        state.v.scatter_(2, slots, v[:, :, -last:].to(state.v.dtype))
