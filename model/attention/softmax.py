"""Softmax attention with a preallocated KV cache written by position."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from ..config import ModelConfig
from .head_shapes import chunk_positions, merge_heads
from .projections import FusedProjections
from ..state import RowState


@dataclass
class KVCache(RowState):
    k: torch.Tensor  # (B, H, max_len, D)
    v: torch.Tensor  # (B, H, max_len, D)

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        # Only positions already written hold information: grows with length.
        _, h, _, d = self.k.shape
        per_position = 2 * h * d * self.k.element_size()
        return int(lengths.sum()) * per_position

    def snapshot_row(self, row: int, length: int) -> list[torch.Tensor]:
        # Positions past `length` are masked out of every later step: only the written prefix is kept.
        return [self.k[row, :, :length].clone(), self.v[row, :, :length].clone()]  # (KV, length, D) each

    # Position p's key and value depend only on the tokens up to p: a longer snapshot's first rows are a shorter one.
    snapshots_truncate = True

    def restore_row(self, row: int, saved: list[torch.Tensor], length: int) -> None:
        self.k[row, :, :length] = saved[0][:, :length]
        self.v[row, :, :length] = saved[1][:, :length]


class SoftmaxAttention(FusedProjections, Attention):
    # The cache grows by position, so steps read a prefix of changing length: no CUDA graph (torch.compile
    # traces the length symbolically); padding rows restarting at position 0 only overwrite their own first slot.
    capabilities = Capabilities(constant_state=False, graphable=False, paddable=True, compilable=True)
    kv_cache = True
    # One query per row on the CPU through model/kernels/softmax_decode.cpp (model/kernels/loader.py turns it on).
    cpu_decode_kernel = False

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # Scores and weighted sum over t keys; reads K, V of t positions, writes one position's.
        d, kv = cfg.d_model, cfg.n_kv_heads * cfg.d_head
        return TokenCost(flops=4 * t * d, state_bytes=(2 * t * kv + 2 * kv) * STATE_NUMBER_BYTES)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._build_projections(cfg)
        self.max_len = cfg.max_len
        self.window = cfg.sliding_window  # 0: every earlier position
        self.grouped = self.n_kv_heads != self.n_heads  # grouped-query attention: a key head per query group

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (batch, self.n_kv_heads, self.max_len, self.d_head)  # only the key and value heads are kept
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: KVCache | None
    ) -> tuple[torch.Tensor, KVCache | None]:
        q, k, v = self._project(x, start)  # (B, H, T, D), (B, KV, T, D) twice
        if state is None:
            y = self._attend_chunk(q, k, v)
        else:
            y = self._attend_cached(q, k, v, start, state)
        return self.proj(merge_heads(y)), state

    def _attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A whole sequence from position 0, no cache (training, scoring)."""
        if not self.window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        positions = torch.arange(q.shape[2], device=q.device)
        visible = self._visible(positions, positions[:, None])  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=self.grouped)

    def _visible(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """Which key positions each query position sees: the earlier ones, within the window if there is one."""
        visible = keys <= queries
        return visible & (keys > queries - self.window) if self.window else visible

    def _attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, state: KVCache
    ) -> torch.Tensor:
        b, _, t, _ = q.shape
        pos = chunk_positions(start, t)  # (B, T)
        rows = torch.arange(b, device=q.device)[:, None]
        # Advanced indices on dims 0 and 2 put (B, T) first: (B, T, KV, D).
        state.k[rows, :, pos] = k.transpose(1, 2).to(state.k.dtype)
        state.v[rows, :, pos] = v.transpose(1, 2).to(state.v.dtype)
        if t == 1 and self._kernel_applies(q, state):
            # A bfloat16 model's queries widened, the result rounded back: attend_one_query's float32 sums too.
            query = q.float()  # (B, H, 1, D), q itself when float32
            attended: torch.Tensor = torch.ops.rnnserve.softmax_decode_attention(query, state.k, state.v, pos[:, 0])
            return attended.to(q.dtype)
        used = int(pos.max()) + 1  # attend only to the written prefix
        # For torch.compile, which cannot see the value: at least one key, and narrow (not a slice)
        # gives exactly `used` of them.
        torch._check(used > 0)  # type: ignore[no-untyped-call]  # torch leaves _check unannotated
        keys, values = state.k.narrow(2, 0, used), state.v.narrow(2, 0, used)
        mask = self._visible(torch.arange(used, device=q.device), pos[:, :, None])  # (B, T, L)
        if t == 1 and q.device.type == "cpu":
            return attend_one_query(q, keys.to(q.dtype), values.to(q.dtype), mask[:, None])
        return F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], enable_gqa=self.grouped
        )

    def _kernel_applies(self, q: torch.Tensor, state: KVCache) -> bool:
        # The kernel widens a bfloat16 cache to float32 as it reads; its q (a bfloat16 one widened) and sums are
        # float32. It reads the whole prefix, each query head its group's key head: grouped-query attention's
        # written-out form (attend_one_query) compiles to products of every query head with every cached key,
        # (B, KV, G, L, D) buffers allocated afresh each step.
        return (
            self.cpu_decode_kernel
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16)
            and state.k.dtype in (torch.float32, torch.bfloat16)
            and q.stride(-1) == 1
            and not self.window
        )


def attend_one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """A decode step's attention, written out: q (B, H, 1, D) over keys, values (B, KV, L, D) where visible
    (B, 1, 1, L); each key head serves H / KV query heads. The same as scaled_dot_product_attention, but compiled
    on a CPU inductor turns these three steps into loops over the prefix that beat the fused kernel at reading
    the cache (benchmarks/results/NOTES.md)."""
    kv, d = keys.shape[1], q.shape[-1]
    if kv == q.shape[1]:
        # In float32 whatever the model's dtype, as the fused kernel accumulates (a no-op for float32 models).
        scores = (q.float() @ keys.float().transpose(-1, -2)) * d**-0.5  # (B, H, 1, L)
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # at least one key is visible
        return (weights @ values.float()).to(q.dtype)  # (B, H, 1, D)
    # Grouped: (B, KV, G, D), a key head's query heads side by side, as views. Products and sums written out
    # (not batched matrix products, which inductor cannot lower over a prefix of unknown length in bfloat16).
    grouped = torch.unflatten(q[:, :, 0], 1, (kv, -1)).float()
    scores = (grouped[:, :, :, None] * keys.float()[:, :, None]).sum(-1) * d**-0.5  # (B, KV, G, L)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = (weights[..., None] * values.float()[:, :, None]).sum(-2)  # (B, KV, G, D)
    return out.to(q.dtype).flatten(1, 2)[:, :, None]  # (B, H, 1, D)
