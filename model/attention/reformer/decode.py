"""Reformer decoding: the cache and the cached attention of chunks and single tokens.

The cache keeps, per row and head, every position's key and value and its
bucket in each round, preallocated to max_len and written by position, as
softmax's KV cache. A step attends to the written prefix through a mask
(the query's bucket mates and its local window, counted once per round that
shows them): fixed shapes but for the prefix's length, no lists whose sizes
would be read back to the host, so torch.compile traces the step whole
(model/decode/compiled/decoder.py), and rows step together however their buckets fill.
On the CPU the step's attention is one C++ call (model/kernels/softmax_decode.cpp,
turned on by model/kernels/loader.py) that scans the bucket ids and reads only the
keys and values shown: about 1/n_buckets of the prefix per round, plus the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...state import RowState
from .dense import key_counts, lsh_attend


@dataclass
class LSHCache(RowState):
    k: torch.Tensor  # (B, H, L, D) normalised keys
    v: torch.Tensor  # (B, H, L, D)
    buckets: torch.Tensor  # (B, H, R, L) bucket of each position, per round

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        # Only positions already written hold information: grows with length.
        _, h, _, d = self.k.shape
        rounds = self.buckets.shape[2]
        per_position = 2 * h * d * self.k.element_size() + h * rounds * self.buckets.element_size()
        return int(lengths.sum()) * per_position

    def snapshot_row(self, row: int, length: int) -> list[torch.Tensor]:
        # Positions past `length` are masked out of every later step: only the written prefix is kept.
        return [
            self.k[row, :, :length].clone(),
            self.v[row, :, :length].clone(),
            self.buckets[row, ..., :length].clone(),
        ]

    # Position p's key, value and buckets depend only on the tokens up to p (causal attention): a longer
    # snapshot's first positions are a shorter one.
    snapshots_truncate = True

    def restore_row(self, row: int, saved: list[torch.Tensor], length: int) -> None:
        self.k[row, :, :length] = saved[0][:, :length]
        self.v[row, :, :length] = saved[1][:, :length]
        self.buckets[row, ..., :length] = saved[2][..., :length]


def bucket_id_dtype(n_buckets: int) -> torch.dtype:
    """The narrowest integer type that holds a bucket id."""
    return torch.uint8 if n_buckets <= torch.iinfo(torch.uint8).max + 1 else torch.int16


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
    return LSHCache(
        k=torch.zeros(batch, heads, max_len, d_head, device=device, dtype=dtype),
        v=torch.zeros(batch, heads, max_len, d_head, device=device, dtype=dtype),
        buckets=torch.zeros(batch, heads, rounds, max_len, device=device, dtype=bucket_id_dtype(n_buckets)),
    )


@dataclass(frozen=True)
class CachedChunk:
    """What attending over the cache takes: a chunk of T tokens per row (one for a decode step) right after what
    the cache holds, which it is written into and then read from."""

    q: torch.Tensor  # (B, H, T, D)
    k: torch.Tensor  # (B, H, T, D) normalised keys
    v: torch.Tensor  # (B, H, T, D)
    buckets: torch.Tensor  # (B, H, R, T) each key's bucket, per round
    pos: torch.Tensor  # (B, T) the tokens' positions
    cache: LSHCache
    window: int  # the local window every query sees besides its bucket mates


def write(chunk: CachedChunk) -> None:
    """Store a chunk's keys, values and buckets in its cache by position."""
    cache, pos = chunk.cache, chunk.pos
    rows = torch.arange(chunk.k.shape[0], device=chunk.k.device)[:, None]
    # Advanced indices on dims 0 and 2 (3 for buckets) put (B, T) first.
    cache.k[rows, :, pos] = chunk.k.transpose(1, 2).to(cache.k.dtype)
    cache.v[rows, :, pos] = chunk.v.transpose(1, 2).to(cache.v.dtype)
    cache.buckets[rows, :, :, pos] = chunk.buckets.permute(0, 3, 1, 2).to(cache.buckets.dtype)


def attend_chunk(chunk: CachedChunk) -> torch.Tensor:
    """The chunk's attention, the dense form over the cache -> (B, H, T, D)."""
    write(chunk)
    q, cache = chunk.q, chunk.cache
    used = int(chunk.pos.max()) + 1
    key_pos = torch.arange(used, device=q.device).expand(q.shape[0], used)
    keys, values = cache.k[:, :, :used].to(q.dtype), cache.v[:, :, :used].to(q.dtype)
    return lsh_attend(
        q, keys, values, chunk.buckets, cache.buckets[..., :used].long(), chunk.pos, key_pos, chunk.window
    )


def decode_step(step: CachedChunk, kernel: bool = False) -> torch.Tensor:
    """One token per row (T = 1) -> (B, H, 1, D).

    The written prefix is masked by how many rounds show each key (as `lsh_attend`), and the rounds mix
    as one softmax over it, with log(count) added to the scores. kernel: through the CPU kernel where it
    applies, which reads only the keys shown."""
    write(step)
    q, cache, pos = step.q, step.cache, step.pos[:, 0]  # pos (B,)
    if kernel and _kernel_applies(q, cache):
        attended: torch.Tensor = torch.ops.rnnserve.reformer_decode_attention(
            q, cache.k, cache.v, cache.buckets, step.buckets[..., 0], pos, step.window
        )
        return attended.to(q.dtype)
    used = int(pos.max()) + 1  # attend only to the written prefix
    # For torch.compile, which cannot see the value: at least one key, and narrow (not a slice) gives exactly
    # `used` of them.
    torch._check(used > 0)  # type: ignore[no-untyped-call]  # torch leaves _check unannotated
    keys, values = cache.k.narrow(2, 0, used), cache.v.narrow(2, 0, used)  # (B, H, L, D)
    key_pos = torch.arange(used, device=q.device).expand(q.shape[0], used)  # (B, L)
    count = key_counts(step.buckets, cache.buckets.narrow(3, 0, used), step.pos, key_pos, step.window)  # (B, H, 1, L)
    return attend_counted(q, keys, values, count)


def _kernel_applies(q: torch.Tensor, state: LSHCache) -> bool:
    # The kernel widens a bfloat16 cache to float32 as it reads; q and its sums are float32; bucket ids are bytes.
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and state.k.dtype in (torch.float32, torch.bfloat16)
        and state.buckets.dtype == torch.uint8
        and q.stride(-1) == 1
    )


def attend_counted(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """One query per row and head over keys shown `count` times: q (B, H, 1, D); keys, values (B, H, L, D);
    count (B, H, 1, L), at least one key shown -> (B, H, 1, D). Written out rather than one fused call: compiled
    on a CPU, inductor turns the steps into loops over the prefix with the mask folded in."""
    d = q.shape[-1]
    # In float32 whatever the model's dtype; log(0) = -inf hides the keys no round shows.
    scores = (q.float() @ keys.float().transpose(-1, -2)) * d**-0.5 + count.float().log()  # (B, H, 1, L)
    return (torch.softmax(scores, dim=-1) @ values.float()).to(q.dtype)
