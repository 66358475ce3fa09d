"""One hashed round over a whole sequence as a single causal attention call.

Training runs here: one round, and buckets far too uneven for `bucketed` (most
MNIST background pixels share a bucket). How `visibility`'s rule maps onto
`scaled_dot_product_attention(is_causal=True)`, whose fused kernel skips the
upper triangle and needs no (T, T) mask:

- earlier keys: keys move one slot right (slot j + 1 holds key j), so the causal
  mask shows query i exactly the keys before it. Slot 0 holds a *sink* key.
- same bucket: queries and keys gain the L bits of their bucket as +-1 features,
  the query's times c_i, and a level feature (-L c_i against 1). A key's dot
  product gains 0 in the query's bucket and at most -2 c_i in any other, which
  outweighs the spread of the query's scores by MARGIN: another bucket's key
  weighs less than e^-MARGIN of the best visible key. c_i is a power of two, so
  the codes cancel exactly, in bfloat16 too.
- everything else, through the sink: the local round and, for a query first in
  its bucket (`first_in_bucket`), the hashed round's "itself", as one rest round.
  The sink's score is the rest round's logsumexp and its value a unit column,
  so the call returns the hashed keys' share of the rounds' softmax plus the
  sink's weight p, and hashed share + p * rest output is `mix_rounds` of all.

The head size grows from D to D + L + 2, rounded up to 8 (what that costs:
benchmarks/results/NOTES.md, "Training step").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .bucketed import local_round
from .hashing import vector_norm
from .visibility import first_in_bucket

MARGIN = 32.0  # e^-32 ~ 1e-14: another bucket's key weighs nothing at float32 precision


def attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, n_buckets: int, window: int = 0
) -> torch.Tensor:
    """q, k, v (B, H, T, D) from position 0; buckets (B, H, 1, T), one round -> (B, H, T, D)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    rest_out, rest_lse = _rest_round(q, k, v, buckets[:, :, 0], n_buckets, window)
    qx, kx, vx = _coded_inputs(q, k, v, buckets[:, :, 0], n_buckets, rest_lse / scale, scale)
    out = F.scaled_dot_product_attention(qx, kx, vx, is_causal=True, scale=scale)  # (B, H, T, width)
    return torch.addcmul(out[..., :d], out[..., d : d + 1], rest_out)  # hashed share + sink weight * rest output


def _rest_round(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, n_buckets: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounds the sink carries: the local round, merged with the query itself where its
    bucket holds nothing earlier. out (B, H, T, D), logsumexp (B, H, T, 1), -inf if empty."""
    alone = first_in_bucket(buckets, n_buckets)  # (B, H, T)
    if window:
        out, lse = local_round(q, k, v, window, itself=alone)  # (B, H, 1, T, D), (B, H, 1, T, 1)
        return out[:, :, 0], lse[:, :, 0]
    itself = (q * k).sum(dim=-1, keepdim=True) / math.sqrt(q.shape[-1])  # score of the query's own key
    return v * alone[..., None], itself.masked_fill(~alone[..., None], float("-inf"))


def _coded_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    buckets: torch.Tensor,
    n_buckets: int,
    sink_score: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, T, D), buckets (B, H, T), sink score (B, H, T, 1) before `scale` ->
    qx, kx, vx (B, H, T, width) for one causal call, in q's dtype."""
    b, h, t, d = q.shape
    dtype = q.dtype
    bits = bucket_bits(buckets, n_buckets, dtype)  # (B, H, T, L)
    n_bits = bits.shape[-1]
    pad = -(n_bits + 2 + d) % 8  # a width the fused kernel handles well
    c = _code_scale(q, k, scale).to(dtype)  # (B, H, T, 1)
    sink_score = torch.maximum(sink_score, -2 * c)  # an empty rest round weighs like another bucket's key
    zeros, ones = q.new_zeros(b, h, t, 1), q.new_ones(b, h, t, 1)
    qx = torch.cat([bits * c, -n_bits * c, sink_score.to(dtype), q] + [zeros] * pad, dim=-1)  # bits, level, sink, q
    kx = torch.cat([bits, ones, zeros, k.to(dtype)] + [zeros] * pad, dim=-1)
    vx = torch.cat([v.to(dtype), zeros] + [zeros] * (n_bits + 1 + pad), dim=-1)  # as wide as keys: one head size
    sink_key = F.one_hot(torch.tensor(n_bits + 1, device=q.device), kx.shape[-1]).to(dtype)
    sink_value = F.one_hot(torch.tensor(d, device=q.device), vx.shape[-1]).to(dtype)
    kx = torch.cat([sink_key.expand(b, h, 1, -1), kx[:, :, :-1]], dim=2)  # key j in slot j + 1, the sink in slot 0
    vx = torch.cat([sink_value.expand(b, h, 1, -1), vx[:, :, :-1]], dim=2)
    return qx, kx, vx


def bucket_bits(buckets: torch.Tensor, n_buckets: int, dtype: torch.dtype) -> torch.Tensor:
    """(...,) bucket ids -> (..., L) their L = ceil(log2 n_buckets) bits as -1 / +1."""
    shifts = torch.arange(max(1, (n_buckets - 1).bit_length()), device=buckets.device)
    return (((buckets[..., None] >> shifts) & 1) * 2 - 1).to(dtype)


@torch.no_grad()
def _code_scale(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, T, 1) power of two c_i with scale * 2 c_i >= 2 scale |q_i| max_j |k_j| + MARGIN: the bucket
    gap exceeds the spread of query i's scores (scale q_i . k_j) by MARGIN."""
    bound = vector_norm(q).float() * vector_norm(k).amax(dim=-2, keepdim=True).float()  # (B, H, T, 1)
    return torch.exp2(torch.ceil(torch.log2(bound + MARGIN / (2 * scale))))
