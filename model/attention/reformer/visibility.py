"""Which keys a Reformer query sees, and how its rounds combine: the one definition.

Each round offers a query *candidates*, always keys strictly before it:
- a hashed round: the earlier keys hashed to the query's bucket;
- the local round (window W > 0): the W keys just before the query.
A query sees its round's candidates, or itself when the round offers none (the
first key of its bucket; position 0 in the local round). The rounds combine as
one softmax over every key they show, a key counted once per round showing it:
equivalently, each round's softmax weighted by softmax_r(logsumexp_r).

The dense and bucketed paths, and a decoding step over its cache, build their
masks from these functions; the CPU decode kernel (model/kernels/softmax_decode.cpp)
applies the same rule as it scans the cached bucket ids. The causal path realises
the candidates with a causal mask and bucket codes and takes the "itself" case
from `first_in_bucket`.
A position below 0 marks padding: no key there.
"""

from __future__ import annotations

import torch


def earlier(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where a key exists (position >= 0) strictly before the query; shapes broadcast."""
    return (k_pos >= 0) & (k_pos < q_pos)


def hashed_candidates(q_bucket: torch.Tensor, k_bucket: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """A hashed round's candidates: of the earlier keys (`before`, from `earlier`), those
    in the query's bucket; shapes broadcast."""
    return (q_bucket == k_bucket) & before


def window_candidates(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, before: torch.Tensor) -> torch.Tensor:
    """The local round's candidates: of the earlier keys (`before`), the `window` just before
    the query; shapes broadcast."""
    return before & (k_pos >= q_pos - window)


def alone(candidates: torch.Tensor) -> torch.Tensor:
    """(..., L) candidates -> (..., 1) bool: the round offers none, so the query sees itself."""
    return ~candidates.any(dim=-1, keepdim=True)


def visible(candidates: torch.Tensor, itself: torch.Tensor) -> torch.Tensor:
    """The keys a query sees in one round: its candidates, or itself when there are none.

    candidates (..., L) bool; itself (..., L) bool, True at the query's own key (broadcasts)."""
    return candidates | (itself & alone(candidates))


def first_in_bucket(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """(..., T) buckets of a sequence from position 0 -> (..., T) bool: no earlier key shares
    the bucket, so the hashed round offers no candidate and the query sees itself."""
    t = buckets.shape[-1]
    pos = torch.arange(t, device=buckets.device).expand(buckets.shape)
    first = torch.full((*buckets.shape[:-1], n_buckets), t, dtype=pos.dtype, device=buckets.device)
    first = first.scatter_reduce(-1, buckets, pos, "amin")  # first position of each bucket
    return first.gather(-1, buckets) == pos


def round_results(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (..., T, L) masked with -inf; values (..., L, D) -> each round's softmax output
    (..., T, D) and logsumexp (..., T, 1)."""
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ values, lse


def mix_rounds(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, H, R, T, D), (B, H, R, T, 1) -> (B, H, T, D).

    Each round's output weighted by the softmax over rounds of its logsumexp: one
    softmax over the keys of all rounds, a key counted once per round holding it.
    """
    return (torch.softmax(lse, dim=2) * out).sum(dim=2)
