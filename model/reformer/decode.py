"""Reformer decoding: the cache and the cached attention of chunks and single tokens.

The cache keeps, per row, head and round, the positions of each bucket in a
preallocated list, so one decoding step gathers only the members of the
query's bucket: O(bucket occupancy), plus the W tokens before it when the
local round is on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..state import RowState
from .dense import lsh_attend
from .visibility import mix_rounds, round_results, visible_itself_last


@dataclass
class LSHCache(RowState):
    k: torch.Tensor  # (B, H, L, D) normalised keys
    v: torch.Tensor  # (B, H, L, D)
    buckets: torch.Tensor  # (B, H, R, L) bucket of each position, per round
    members: torch.Tensor  # (B, H, R, n_buckets, L) positions in each bucket, in order
    counts: torch.Tensor  # (B, H, R, n_buckets) int64, occupancy of each bucket

    # Its bucket lists are laid out per bucket over the whole context, not by position: a prefix is not a slice of
    # them, so a prefix cache leaves this kind out rather than copy max_len-sized rows.
    snapshots_exact = False

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        _, h, _, d = self.k.shape
        rounds = self.buckets.shape[2]
        per_position = 2 * h * d * self.k.element_size()
        per_position += h * rounds * (self.buckets.element_size() + self.members.element_size())
        counts = self.counts[: lengths.numel()]  # the given rows' bucket occupancy
        return int(lengths.sum()) * per_position + counts.numel() * counts.element_size()


def new_cache(
    batch: int,
    heads: int,
    rounds: int,
    n_buckets: int,
    max_len: int,
    d_head: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LSHCache:
    idx = torch.int16 if max_len <= torch.iinfo(torch.int16).max else torch.int32
    return LSHCache(
        k=torch.zeros(batch, heads, max_len, d_head, device=device, dtype=dtype),
        v=torch.zeros(batch, heads, max_len, d_head, device=device, dtype=dtype),
        buckets=torch.zeros(batch, heads, rounds, max_len, device=device, dtype=idx),
        members=torch.zeros(batch, heads, rounds, n_buckets, max_len, device=device, dtype=idx),
        counts=torch.zeros(batch, heads, rounds, n_buckets, device=device, dtype=torch.long),
    )


def write(state: LSHCache, k, v, buckets, pos) -> None:
    """Store a chunk's keys, values and bucket memberships: k, v (B, H, T, D), buckets (B, H, R, T), pos (B, T)."""
    b, h, r, t = buckets.shape
    n_buckets, max_len = state.counts.shape[-1], state.k.shape[2]
    rows = torch.arange(b, device=k.device)[:, None]
    state.k[rows, :, pos] = k.transpose(1, 2).to(state.k.dtype)
    state.v[rows, :, pos] = v.transpose(1, 2).to(state.v.dtype)
    state.buckets[rows, :, :, pos] = buckets.permute(0, 3, 1, 2).to(state.buckets.dtype)
    onehot = F.one_hot(buckets, n_buckets)  # (B, H, R, T, n)
    # Slot of each token in its bucket list: occupancy before it.
    rank = (onehot.cumsum(dim=3) - onehot).gather(-1, buckets[..., None])[..., 0]
    slot = state.counts.gather(-1, buckets) + rank  # (B, H, R, T)
    flat = state.members.view(b, h, r, -1)
    flat.scatter_(-1, buckets * max_len + slot, pos[:, None, None, :].expand_as(slot).to(flat.dtype))
    state.counts.add_(onehot.sum(dim=3))


def attend_chunk(q, k, v, buckets, pos, state: LSHCache, window: int) -> torch.Tensor:
    """A chunk of T tokens per row after what the cache holds: the dense form over the cache."""
    write(state, k, v, buckets, pos)
    used = int(pos.max()) + 1
    key_pos = torch.arange(used, device=q.device).expand(q.shape[0], used)
    keys, values = state.k[:, :, :used].to(q.dtype), state.v[:, :, :used].to(q.dtype)
    return lsh_attend(q, keys, values, buckets, state.buckets[..., :used].long(), pos, key_pos, window)


def decode_step(q, k, v, buckets, pos, state: LSHCache, window: int) -> torch.Tensor:
    """One token per row: q, k, v (B, H, 1, D), buckets (B, H, R, 1), pos (B,) -> (B, H, 1, D)."""
    out, lse = _hashed_step(q, k, v, buckets[..., 0], pos, state)
    if window:
        local_out, local_lse = _local_step(q, k, v, pos, state, window)
        out, lse = torch.cat([out, local_out], dim=2), torch.cat([lse, local_lse], dim=2)
    write(state, k, v, buckets, pos[:, None])
    return mix_rounds(out, lse)


def _hashed_step(q, k, v, q_buckets, pos, state: LSHCache):
    """The hashed rounds for one token per row, from its bucket's member list: (B, H, R, 1, D), (B, H, R, 1, 1)."""
    b, h, r = q_buckets.shape
    n_buckets, length = state.counts.shape[-1], state.k.shape[2]
    count = state.counts.gather(-1, q_buckets[..., None])[..., 0]  # (B, H, R)
    width = max(int(count.max()), 1)
    # Flat row index of each (b, h, r, bucket) list, then its first `width` members.
    lists = torch.arange(b * h * r, device=q.device).view(b, h, r) * n_buckets + q_buckets
    members = state.members.view(-1, length).index_select(0, lists.view(-1))[:, :width].long().view(b, h, r, width)
    keys, values = _gather(state, members)  # (B, H, R, W, D)
    # A bucket's list holds its earlier keys, in order: the round's candidates are its first `count` entries.
    candidates = torch.arange(width, device=q.device) < count[..., None]  # (B, H, R, W)
    return _attend_with_itself(q[:, :, None], keys, values, k[:, :, None], v[:, :, None], candidates)


def _local_step(q, k, v, pos, state: LSHCache, window: int):
    """The local round for one token per row: the W cached positions before it. (B, H, 1, 1, D), (B, H, 1, 1, 1)."""
    before = pos[:, None] - window + torch.arange(window, device=q.device)  # (B, W), < 0 before the sequence
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    index = before.clamp(min=0)
    keys = state.k[rows, :, index].transpose(1, 2)[:, :, None]  # (B, H, 1, W, D)
    values = state.v[rows, :, index].transpose(1, 2)[:, :, None]
    candidates = (before >= 0)[:, None, None]  # (B, 1, 1, W): the window's positions that exist
    return _attend_with_itself(q[:, :, None], keys, values, k[:, :, None], v[:, :, None], candidates)


def _gather(state: LSHCache, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, H, R, W) -> cached keys and values there, (B, H, R, W, D) each."""
    b, h, r, width = positions.shape
    length, d = state.k.shape[2:]
    rows = torch.arange(b * h, device=positions.device).view(b, h, 1, 1) * length
    flat = (positions + rows).view(-1)  # flat key index: (b, h) row times length plus position
    keys, values = (x.view(-1, d).index_select(0, flat).view(b, h, r, width, d) for x in (state.k, state.v))
    return keys, values


def _attend_with_itself(q, keys, values, k, v, candidates):
    """One token's rounds over listed keys plus itself as a last column, seen only when
    the round offers no candidate. q, k, v (B, H, 1, 1, D); keys, values (B, H, R, W, D);
    candidates broadcastable to (B, H, R, W) -> out (B, H, R, 1, D), lse (B, H, R, 1, 1)."""
    b, h, r, _, d = keys.shape
    keys = torch.cat([keys.to(q.dtype), k.expand(b, h, r, 1, d)], dim=3)
    values = torch.cat([values.to(q.dtype), v.expand(b, h, r, 1, d)], dim=3)
    allowed = visible_itself_last(candidates)  # (..., W + 1)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d)  # (B, H, R, 1, W + 1)
    return round_results(scores.masked_fill(~allowed[..., None, :], float("-inf")), values)
