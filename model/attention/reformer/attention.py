"""Reformer LSH attention with shared QK, cached per bucket.

Keys are the normalised queries. Each of R hashing rounds draws a random
rotation and hashes x to argmax([xR; -xR]). A query at position i attends to
earlier positions j < i in its own bucket, and to itself only when its
bucket holds nothing earlier. The rounds are combined with weights
softmax_r(logsumexp of round r's scores), as in the paper; unlike the paper
we do not discount keys that two rounds both find (see README).

Optionally (`reformer_local_window` W > 0) one more round attends to the W
positions just before the query, like reformer-pytorch's local hash and the
local layers that Hugging Face's Reformer interleaves with LSH layers. Why:
with shared QK a byte hashes with earlier copies of itself, rarely with its
neighbours, and a character model stuck there learns no more than a bigram.

The rule is written once, in `reformer.visibility`; this module picks the path
that computes it: for a whole sequence, `bucketed` when buckets are even,
`causal` for one round, `dense` otherwise; after a cache, `decode`, whose
single-token step masks a cache written by position and compiles like softmax's. Inference
hashes with the rotations stored in the weights, kept in float32 whatever the
model's dtype; training may draw fresh ones every step (`fresh_rotations`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

import torch
from torch import nn

from ..base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from ...config import ModelConfig
from ..head_shapes import chunk_positions, merge_heads, split_heads
from . import bucketed, decode
from .causal import attend_causal
from .decode import LSHCache, bucket_id_dtype
from .dense import lsh_attend
from .hashing import draw_rotations, hash_keys, unit_keys

__all__ = ["LSHCache", "ReformerAttention"]


class ReformerAttention(Attention):
    # The cache grows by position and steps read a prefix of changing length, as softmax's: no CUDA graph, but
    # torch.compile traces the length symbolically. Not declared paddable (yet): padding rows from position 0
    # would only overwrite their own first slot, but that is not tested.
    capabilities = Capabilities(constant_state=False, graphable=False, paddable=False, compilable=True)
    projections = 3  # shared QK
    # One query per row on the CPU through model/kernels/softmax_decode.cpp (model/kernels/loader.py turns it on).
    cpu_decode_kernel = False

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # Through the CPU kernel: the query's bucket in each round (expected occupancy) and its local window, keys
        # and values read; the bucket ids of every position scanned. (Without the kernel a step scores the whole
        # prefix and masks it: softmax's cost.)
        seen, d = cfg.reformer_rounds * t / cfg.reformer_buckets + min(cfg.reformer_local_window, t), cfg.d_model
        ids = cfg.n_heads * cfg.reformer_rounds * bucket_id_dtype(cfg.reformer_buckets).itemsize  # per position
        return TokenCost(flops=4 * seen * d, state_bytes=(2 * seen * d + 2 * d) * STATE_NUMBER_BYTES + (t + 1) * ids)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.max_len = cfg.max_len
        self.n_buckets = cfg.reformer_buckets
        self.window = cfg.reformer_local_window
        self.fresh_rotations = bool(cfg.extra.get("reformer_fresh_rotations", True))
        self.qk = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # Stored with the weights so a loaded model always hashes the same way.
        self.register_buffer("rotations", draw_rotations(cfg.reformer_rounds, cfg.d_head, cfg.reformer_buckets))

    rotations: torch.Tensor  # (rounds, d_head, buckets // 2), a buffer

    @property
    def rounds(self) -> int:
        return self.rotations.shape[0]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """Module moves and casts (`.to(bfloat16)`, `.half()`) move the rotations but keep them
        float32, so a 16-bit model hashes exactly like the float32 one."""
        rotations = self.rotations
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply unannotated
        self.rotations = rotations.to(device=self.rotations.device, dtype=torch.float32)
        return self

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LSHCache:
        d_head = self.proj.in_features // self.n_heads
        return decode.new_cache(batch, self.n_heads, self.rounds, self.n_buckets, self.max_len, d_head, device, dtype)

    def hash(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> buckets (B, H, R, T) int64."""
        rot = self.rotations
        if self.training and self.fresh_rotations:
            rot = torch.randn_like(rot)
        return hash_keys(keys, rot)

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: LSHCache | None
    ) -> tuple[torch.Tensor, LSHCache | None]:
        q = split_heads(self.qk(x), self.n_heads)  # (B, H, T, D)
        v = split_heads(self.v(x), self.n_heads)
        k = unit_keys(q)
        buckets = self.hash(k)
        t = q.shape[2]
        pos = chunk_positions(start, t)  # (B, T)
        if state is None:
            y = self._attend_sequence(q, k, v, buckets)
        else:
            chunk = decode.CachedChunk(q, k, v, buckets, pos, state, self.window)
            y = decode.decode_step(chunk, self.cpu_decode_kernel) if t == 1 else decode.attend_chunk(chunk)
        return self.proj(merge_heads(y.to(q.dtype))), state

    def _attend_sequence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor
    ) -> torch.Tensor:
        """A whole sequence from position 0: the cheapest exact path."""
        sizes = bucketed.bucket_sizes(buckets, self.n_buckets)
        if bucketed.is_even(sizes, q.shape[2]):
            return bucketed.attend_bucketed(q, k, v, buckets, self.n_buckets, self.window)
        if self.rounds == 1:
            return attend_causal(q, k, v, buckets, self.n_buckets, self.window)
        pos = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)
        return lsh_attend(q, k, v, buckets, buckets, pos, pos, self.window)
