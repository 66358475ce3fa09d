"""The projections softmax, linear, hybrid and Linformer attention share: one fused layer from the model width to
the queries, keys and values (fewer key and value heads in grouped-query attention), the output layer, and the
optional rotary positions that turn queries and keys.

A mixin, not a submodule of its own: the layers stay attributes of the attention module, so their parameters keep
the names saved weights and the Hugging Face importer use (`attn.qkv.weight`, `attn.proj.weight`)."""

from __future__ import annotations

import torch
from torch import nn

from ..block_parts import Rotary
from ..config import ModelConfig
from .head_shapes import chunk_positions, split_heads


class FusedProjections:
    """Mixed into an `Attention` (an nn.Module) before it: `class SoftmaxAttention(FusedProjections, Attention)`."""

    n_heads: int
    n_kv_heads: int
    d_head: int
    qkv: nn.Linear
    proj: nn.Linear
    rotary: Rotary | None

    def _build_projections(self, cfg: ModelConfig) -> None:
        """Head counts and the layers, in this order (the order their parameters are drawn from the seed)."""
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        # Queries, then keys and values of n_kv_heads heads each (fewer than n_heads in grouped-query attention).
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attn_out_bias)
        self.rotary = Rotary(cfg) if cfg.pos_encoding == "rotary" else None

    def _project(
        self, x: torch.Tensor, start: torch.Tensor, *, widen: bool = False, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) from `start` (B,) -> q (B, H, T, D), k and v (B, KV, T, D); float32 if `widen` (before the
        rotary turn, so it is computed in float32 too); q and k turned by rotary positions, if any. `positions`
        (B, T): the chunk's positions, when the caller has them already."""
        q, k, v = self.qkv(x).split([self.n_heads * self.d_head, *[self.n_kv_heads * self.d_head] * 2], dim=-1)
        q, k, v = (
            split_heads(t, heads) for t, heads in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads))
        )
        if widen:
            q, k, v = q.float(), k.float(), v.float()
        if self.rotary is not None:
            positions = chunk_positions(start, x.shape[1]) if positions is None else positions  # (B, T)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        return q, k, v
