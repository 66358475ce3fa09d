"""Angular LSH: a random rotation per round, bucket = argmax([xR; -xR]).

Hashing always runs in float32 with float32 rotations, whatever the model's
dtype: a bfloat16 model then puts every key in the same bucket as the float32
model (rotations rounded to 8 bits would move keys near a bucket border).
"""

from __future__ import annotations

import torch


def draw_rotations(rounds: int, d_head: int, n_buckets: int) -> torch.Tensor:
    """(R, D, n_buckets / 2) float32 Gaussian rotations, one per hashing round."""
    return torch.randn(rounds, d_head, n_buckets // 2, dtype=torch.float32)


def unit_keys(q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """q / max(|q|, eps), as F.normalize, but in q's dtype: under autocast F.normalize
    returns float32, and every later op on the keys would run in float32 too."""
    return q / vector_norm(q).clamp_min(eps)


def vector_norm(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., 1) norms in x's dtype (accumulated in float32 for 16-bit x)."""
    norms: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return norms


def hash_keys(keys: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """keys (B, H, T, D), rotations (R, D, n/2) -> buckets (B, H, R, T) int64, in float32."""
    if torch.is_autocast_enabled(keys.device.type):  # autocast would round both to bfloat16
        with torch.autocast(keys.device.type, enabled=False):
            return hash_keys(keys, rotations)
    projected = torch.einsum("bhtd,rdn->bhrtn", keys.float(), rotations.float())
    return torch.cat([projected, -projected], dim=-1).argmax(dim=-1)
