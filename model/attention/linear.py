"""Linear attention (Katharopoulos et al. 2020), phi(x) = elu(x) + 1 or a learned map (model/attention/feature_maps.py).

out_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps),
S_i = sum_{j<=i} phi(k_j) v_j^T,  Z_i = sum_{j<=i} phi(k_j).
phi has F features per head (F = D for elu), so S is (F, D) and Z is F per head.

The state (S, Z) has a fixed size, so every token costs the same. The
parallel path is chunked: an exact masked product inside each block of
`BLOCK` tokens plus the running state between blocks, so it never holds a
(T, D, D) tensor of prefix sums.

An imported model's block options (model/architecture.py) hold as in softmax attention: rotary positions turn q
and k before phi (as LoLCATs linearizes Llama); in grouped-query attention S and Z are per key head, read by the
key head's group of query heads (the state shrinks by the group size), and a learned phi is per key head too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from ..config import ModelConfig
from .feature_maps import feature_count, make_feature_map, projected_count
from .head_shapes import merge_heads
from .projections import FusedProjections
from ..state import RowState

BLOCK = 64


@dataclass
class LinearState(RowState):
    # S and Z side by side and transposed, [S | Z]^T: one rank-1 update [v; 1] k^T and one
    # read [S | Z]^T phi(q) per step give numerator and denominator together. Transposed, the
    # read reduces along contiguous memory, so the compiled step updates and reads the state
    # in one pass of whole vectors (D wide, no odd D + 1 tail); the eager step is as fast.
    sz_t: torch.Tensor  # (B, H, D + 1, F) float32

    @property
    def s(self) -> torch.Tensor:
        return self.sz_t[..., :-1, :].transpose(-1, -2)  # (B, H, F, D): sum of phi(k) v^T

    @property
    def z(self) -> torch.Tensor:
        return self.sz_t[..., -1, :]  # (B, H, F): sum of phi(k)


def linear_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s0: torch.Tensor, z0: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact causal linear attention over a chunk, starting from (s0, z0).

    q: (B, H, T, F) and k: (B, KV, T, F) already feature-mapped; v: (B, KV, T, E); s0 (B, KV, F, E), z0 (B, KV, F).
    Each key head serves H / KV query heads (grouped-query attention; KV = H without it).
    Returns out (B, H, T, E) and the final (S, Z).
    """
    b, h, t, d = q.shape
    kv_heads = k.shape[1]
    block = min(BLOCK, t)  # a chunk shorter than a block is one block of its own length, not padded to 64
    n = -(-t // block)
    pad = n * block - t
    if pad:  # zero keys/values add nothing to the sums
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    qb = q.reshape(b, kv_heads, h // kv_heads, n, block, d)  # (B, KV, G, N, C, F): a key head's queries together
    kb, vb = (x.reshape(b, kv_heads, n, block, x.shape[-1]) for x in (k, v))  # (B, KV, N, C, F or E)
    kv = torch.einsum("bhncd,bhnce->bhnde", kb, vb)  # (B, KV, N, F, E) per-block sums
    ksum = kb.sum(dim=3)  # (B, KV, N, F)
    # Exclusive prefix over blocks: what every block sees from earlier blocks.
    s_before = s0[:, :, None] + F.pad(kv.cumsum(2), (0, 0, 0, 0, 1, 0))[:, :, :n]
    z_before = z0[:, :, None] + F.pad(ksum.cumsum(2), (0, 0, 1, 0))[:, :, :n]
    scores = (qb @ kb[:, :, None].transpose(-1, -2)).tril()  # (B, KV, G, N, C, C)
    num = scores @ vb[:, :, None] + qb @ s_before[:, :, None]
    den = scores.sum(-1) + torch.einsum("bhgncd,bhnd->bhgnc", qb, z_before) + eps
    out = (num / den[..., None]).reshape(b, h, n * block, -1)[:, :, :t]
    return out, s_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + ksum[:, :, -1]


class LinearAttention(FusedProjections, Attention):
    capabilities = Capabilities(constant_state=True, graphable=True, paddable=True, compilable=True)

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # phi(q)^T [S | Z] per query head, S += phi(k) v^T per key head, plus O(H F); reads and writes S, Z
        # whole (one per key head). A learned map adds its projection of q and k.
        h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        f = feature_count(cfg.linear_feature_map, d, cfg.linear_features)
        mapping = 0 if cfg.linear_feature_map == "elu" else 2 * (h + kv) * d * projected_count(d, cfg.linear_features)
        return TokenCost(
            flops=2 * (h + kv) * f * d + 6 * h * f + mapping, state_bytes=2 * kv * (f * d + f) * STATE_NUMBER_BYTES
        )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # The same layers, names and shapes as softmax attention's for the same block options, so that a softmax
        # model's weights load into its linear twin (a warm start copies them by name, training/warm_start.py).
        # Rotary positions turn q and k before the feature map (as LoLCATs linearizes Llama): phi then sees the
        # queries and keys softmax scored.
        self._build_projections(cfg)
        self.grouped = self.n_kv_heads != self.n_heads  # grouped-query attention: S and Z per key head
        self.eps: float = cfg.linear_eps
        # Per key head: a group's queries share its map, so phi(k) and the sums are one per key head.
        self.feature_map = make_feature_map(cfg.linear_feature_map, cfg.n_kv_heads, cfg.d_head, cfg.linear_features)
        self.features = feature_count(cfg.linear_feature_map, cfg.d_head, cfg.linear_features)  # F
        self.cpu_decode_kernel = False  # the chunk (prefill) kernel; model/kernels/loader.py turns it on

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LinearState:
        del dtype  # sums accumulate in float32 whatever the model's dtype
        return LinearState(torch.zeros(batch, self.n_kv_heads, self.d_head + 1, self.features, device=device))

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: LinearState | None
    ) -> tuple[torch.Tensor, LinearState | None]:
        q, k, v = self._project(x, start, widen=True)  # (B, H, T, D), (B, KV, T, D) twice, float32
        q, k = self.feature_map(q), self.feature_map(k)  # (B, H, T, F), (B, KV, T, F)
        if state is not None and q.shape[2] == 1:
            y = self._step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state)[:, :, None]
        elif state is not None and self._prefill_kernel_takes(q, state):
            y = torch.ops.rnnserve.linear_attention_prefill(
                q.contiguous(), k.contiguous(), v.contiguous(), state.sz_t, self.eps
            )
        else:
            s0, z0 = (state.s, state.z) if state is not None else self._zeros(k, v)
            y, s, z = linear_attention_chunked(q, k, v, s0, z0, self.eps)
            if state is not None:
                state.s.copy_(s)
                state.z.copy_(z)
        return self.proj(merge_heads(y.to(x.dtype))), state

    def _prefill_kernel_takes(self, q: torch.Tensor, state: LinearState) -> bool:
        """Whether a chunk runs through the CPU prefill kernel (model/kernels/linear_prefill.cpp): once the
        kernels are on (model/kernels/loader.py), for CPU inputs (float32: `forward` widens them) and a state whose
        rows lie contiguous. The kernel reads one state per query head, so grouped-query attention (a state per
        key head) takes the chunked torch path instead; rotary positions are applied before it, so they do not
        matter to it."""
        return self.cpu_decode_kernel and not self.grouped and q.device.type == "cpu" and state.sz_t.is_contiguous()

    def _zeros(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, kv_heads, _, f = k.shape
        return k.new_zeros(b, kv_heads, f, v.shape[-1]), k.new_zeros(b, kv_heads, f)

    def _step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LinearState) -> torch.Tensor:
        """One token per row, state updated in place. q (B, H, F) and k (B, KV, F) feature-mapped; v (B, KV, D).
        Returns (B, H, D)."""
        b, kv_heads, d = v.shape
        v1 = torch.cat([v, v.new_ones(b, kv_heads, 1)], dim=-1)  # (B, KV, D + 1): [v; 1]
        # In place, [S | Z]^T += [v; 1] k^T: no (B, KV, D, D) temporary per step. An elementwise
        # addcmul is one pass over the state, quicker on CPU than a batched rank-1 baddbmm
        # (timings in benchmarks/results/NOTES.md, "Measurements behind design choices").
        state.sz_t.addcmul_(v1[..., :, None], k[..., None, :])
        grouped = torch.unflatten(q, 1, (kv_heads, -1))  # (B, KV, G, F): a key head's query heads side by side
        out = (grouped @ state.sz_t.transpose(-1, -2)).flatten(1, 2)  # (B, H, D + 1): [phi(q)^T S, phi(q)^T Z]
        return out[..., :d] / (out[..., d:] + self.eps)
