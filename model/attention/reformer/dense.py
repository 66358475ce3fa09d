"""Dense LSH attention over explicit keys: the reference form of the semantics.

Serves chunks that attend to a cache (any start per row) and, for several
hashed rounds with uneven buckets, whole sequences. It costs O(T L) memory for
the mask, so the other paths avoid it where they can.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .visibility import earlier, hashed_candidates, visible, window_candidates


def lsh_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_buckets: torch.Tensor,
    k_buckets: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """Dense LSH attention, the local round included when window > 0.

    q (B, H, T, D); keys, values (B, H, L, D); q_buckets (B, H, R, T);
    k_buckets (B, H, R, L); q_pos (B, T); k_pos (B, L) absolute positions -> (B, H, T, D).

    Mixing the rounds' softmaxes with weights softmax_r(logsumexp_r) equals one
    softmax over all keys in which key j counts once per round that holds it:
    scores + log(count_j). So the rounds become one additive mask (log 0 = -inf
    hides a key) and one fused scaled_dot_product_attention call, instead of a
    (B, H, R, T, L) float tensor of scores per round.
    """
    count = key_counts(q_buckets, k_buckets, q_pos, k_pos, window)  # (B, H, T, L) uint8
    bias = torch.zeros(count.shape, dtype=q.dtype, device=q.device).masked_fill_(count == 0, float("-inf"))
    most = q_buckets.shape[2] + (1 if window else 0)  # a key can be in every round
    for c in range(2, most + 1):  # log(count) without a log pass over the whole mask
        bias.masked_fill_(count == c, math.log(c))
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=bias)


def key_counts(
    q_buckets: torch.Tensor, k_buckets: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int
) -> torch.Tensor:
    """How many rounds show key j to query i: (B, H, T, L) uint8."""
    b, h, rounds, t = q_buckets.shape
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]  # (B, 1, T, 1), (B, 1, 1, L)
    before, itself = earlier(qp, kp), kp == qp  # (B, 1, T, L), same for every head
    count = torch.zeros(b, h, t, k_pos.shape[1], dtype=torch.uint8, device=q_buckets.device)
    for r in range(rounds):
        count += visible(hashed_candidates(q_buckets[:, :, r, :, None], k_buckets[:, :, r, None, :], before), itself)
    if window:
        count += visible(window_candidates(qp, kp, window, before), itself)
    return count
