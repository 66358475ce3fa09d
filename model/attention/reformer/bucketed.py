"""LSH attention over a whole sequence from position 0, computed inside buckets.

Sort positions by (bucket, position), pad every bucket to the largest one (M),
attend within each bucket: O(n_buckets M^2) instead of O(T^2), and exact, not
the paper's chunk approximation. Pays off only when buckets are even
(`is_even`); the local round runs in blocks of W: O(T W).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from .visibility import earlier, mix_rounds, round_results, visible, window_candidates


def bucket_sizes(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """(B, H, R, T) -> (B, H, R, n_buckets) occupancy of every bucket."""
    sizes = buckets.new_zeros(*buckets.shape[:-1], n_buckets)
    return sizes.scatter_add_(-1, buckets, torch.ones_like(buckets))


def is_even(sizes: torch.Tensor, length: int) -> bool:
    """Whether padding every bucket to the largest costs less than the dense (T, T) form."""
    n_buckets, largest = sizes.shape[-1], int(sizes.max())
    return 4 * n_buckets * largest * largest <= length * length


def attend_bucketed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, n_buckets: int, window: int = 0
) -> torch.Tensor:
    """q, k, v (B, H, T, D); buckets (B, H, R, T) -> (B, H, T, D), rounds and local round mixed."""
    sizes = bucket_sizes(buckets, n_buckets)
    out, lse = bucket_rounds(q, k, v, buckets, sizes, int(sizes.max()))
    if window:
        local_out, local_lse = local_round(q, k, v, window)
        out, lse = torch.cat([out, local_out], dim=2), torch.cat([lse, local_lse], dim=2)
    return mix_rounds(out, lse)


def local_round(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, itself: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local round over a whole sequence from position 0, in blocks of `window`:
    each block's queries see their own block and the one before, masked to the
    `window` positions before each query. O(T W) instead of O(T^2).

    q, k, v (B, H, T, D) -> out (B, H, 1, T, D), lse (B, H, 1, T, 1), in q's dtype.
    itself (B, H, T) bool, optional: queries whose own key counts once more, as
    another round showing it (the causal path merges the hashed round's "itself").
    """
    b, h, t, d = q.shape
    n = -(-t // window)  # blocks
    pad = n * window - t
    # One block of zeros in front, so block 0 has a "previous" block (no keys: positions < 0).
    qb = F.pad(q / math.sqrt(d), (0, 0, 0, pad)).view(b, h, n, window, d)
    kb, vb = (F.pad(x.to(q.dtype), (0, 0, window, pad)).view(b, h, n + 1, window, d) for x in (k, v))
    keys = torch.cat([kb[:, :, :-1], kb[:, :, 1:]], dim=3)  # (B, H, n, 2W, D)
    values = torch.cat([vb[:, :, :-1], vb[:, :, 1:]], dim=3)
    q_pos = torch.arange(n * window, device=q.device).view(n, window, 1)
    k_pos = (torch.arange(n, device=q.device) * window).view(n, 1, 1) + torch.arange(-window, window, device=q.device)
    candidates = window_candidates(q_pos, k_pos, window, earlier(q_pos, k_pos))
    count = visible(candidates, k_pos == q_pos).to(q.dtype)  # (n, W, 2W)
    own_bias = None
    if itself is not None:  # count of each query's own key: the local round's (at position 0) plus `itself`
        own = count.diagonal(offset=window, dim1=-2, dim2=-1) + F.pad(itself, (0, pad)).view(b, h, n, window)
        own_bias = own.log()  # (B, H, n, W)
    # torch leaves autograd.Function.apply unannotated
    out, lse = _SoftmaxAttention.apply(qb, keys, values, count.log(), own_bias)  # type: ignore[no-untyped-call]
    # (B, H, n, W, D), (B, H, n, W, 1)
    return out.view(b, h, 1, n * window, d)[:, :, :, :t], lse.view(b, h, 1, n * window, 1)[:, :, :, :t]


class _SoftmaxAttention(torch.autograd.Function):
    """softmax(q keys^T + bias) values and its logsumexp, all in q's dtype, with the
    backward written out: fewer passes over the scores than autograd makes.

    q (..., W, D); keys, values (..., S, D); bias (..., W, S) broadcast; own_bias
    (..., W) or None replaces the bias of each query's own key, column S - W + w.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor,
        own_bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):  # the backward runs without autocast too
            scores = torch.matmul(q, keys.transpose(-1, -2))
            own = scores.diagonal(offset=keys.shape[-2] - q.shape[-2], dim1=-2, dim2=-1)  # a view
            own_scores = None if own_bias is None else own + own_bias
            scores.add_(bias)
            if own_scores is not None:
                own.copy_(own_scores)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            weights = scores.sub_(lse).exp_()
            out = torch.matmul(weights, values)
        ctx.save_for_backward(q, keys, values, weights, out)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        # ctx: Any, as torch declares no saved_tensors on FunctionCtx
        q, keys, values, weights, out = ctx.saved_tensors
        grad_out = grad_out.to(out.dtype)
        grad_values = torch.matmul(weights.transpose(-1, -2), grad_out)
        # d score = weights * (grad_out . value - grad_out . out + grad_lse): softmax and logsumexp together.
        grad_scores = torch.matmul(grad_out, values.transpose(-1, -2))
        grad_scores -= ((grad_out * out).sum(dim=-1, keepdim=True) - grad_lse).to(grad_scores.dtype)
        grad_scores *= weights
        return torch.matmul(grad_scores, keys), torch.matmul(grad_scores.transpose(-1, -2), q), grad_values, None, None


def bucket_rounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, sizes: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hashed rounds, sorted and padded to buckets of m: (B, H, R, T, D), (B, H, R, T, 1)."""
    b, h, r, t = buckets.shape
    d, n_buckets = q.shape[-1], sizes.shape[-1]
    order = (buckets * t + torch.arange(t, device=q.device)).argsort(dim=-1)  # (B, H, R, T) positions by bucket
    sorted_buckets = buckets.gather(-1, order)
    offsets = sizes.cumsum(dim=-1) - sizes  # first sorted index of each bucket
    slot = torch.arange(t, device=q.device) - offsets.gather(-1, sorted_buckets)
    padded_index = sorted_buckets * m + slot  # (B, H, R, T) slot of each sorted position
    slot_pos = order.new_full((b, h, r, n_buckets * m), -1).scatter(3, padded_index, order)
    slot_pos = slot_pos.view(b, h, r, n_buckets, m)  # position in each slot, -1 for padding

    def to_buckets(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B, H, R, n, M, D), zero padding
        xs = x[:, :, None].expand(b, h, r, t, d).gather(3, order[..., None].expand(b, h, r, t, d))
        return (
            x.new_zeros(b, h, r, n_buckets * m, d)
            .scatter(3, padded_index[..., None].expand(b, h, r, t, d), xs)
            .view(b, h, r, n_buckets, m, d)
        )

    # Every slot of a padded bucket shares the bucket: the candidates are the earlier slots.
    candidates = earlier(slot_pos[..., :, None], slot_pos[..., None, :])  # (B, H, R, n, M, M)
    allowed = visible(candidates, torch.eye(m, dtype=torch.bool, device=q.device))
    qp, kp, vp = to_buckets(q), to_buckets(k), to_buckets(v)
    scores = (qp @ kp.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    out, lse = round_results(scores, vp)  # (B, H, R, n, M, D), (B, H, R, n, M, 1)
    return _unsort(torch.cat([out, lse], dim=-1).view(b, h, r, n_buckets * m, d + 1), order, padded_index)


def _unsort(padded: torch.Tensor, order: torch.Tensor, padded_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, R, n M, D + 1) bucket slots back to positions: (B, H, R, T, D), (B, H, R, T, 1)."""
    e = padded.shape[-1]
    gathered = padded.gather(3, padded_index[..., None].expand(*order.shape, e))  # sorted order
    unsorted = torch.empty_like(gathered).scatter(3, order[..., None].expand(*order.shape, e), gathered)
    return unsorted[..., :-1], unsorted[..., -1:]
