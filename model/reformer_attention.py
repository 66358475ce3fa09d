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

The parallel path here computes these semantics exactly with a (T, L) mask;
it is the reference the decoder must match. Decoding keeps, per row, head
and round, the positions of each bucket in a preallocated list, so one step
gathers only the members of the query's bucket: O(bucket occupancy).
Inference hashes with the rotations stored in the weights; training may
draw fresh ones every step (`fresh_rotations`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import STATE_NUMBER_BYTES, Attention, Capabilities, TokenCost
from .config import ModelConfig
from .heads import chunk_positions, merge_heads, split_heads
from .state import RowState


@dataclass
class LSHCache(RowState):
    k: torch.Tensor  # (B, H, L, D) normalised keys
    v: torch.Tensor  # (B, H, L, D)
    buckets: torch.Tensor  # (B, H, R, L) bucket of each position, per round
    members: torch.Tensor  # (B, H, R, n_buckets, L) positions in each bucket, in order
    counts: torch.Tensor  # (B, H, R, n_buckets) int64, occupancy of each bucket

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        _, h, _, d = self.k.shape
        rounds = self.buckets.shape[2]
        per_position = 2 * h * d * self.k.element_size()
        per_position += h * rounds * (self.buckets.element_size() + self.members.element_size())
        counts = self.counts[: lengths.numel()]  # the given rows' bucket occupancy
        return int(lengths.sum()) * per_position + counts.numel() * counts.element_size()


def _index_dtype(max_len: int) -> torch.dtype:
    return torch.int16 if max_len <= torch.iinfo(torch.int16).max else torch.int32


class ReformerAttention(Attention):
    # Bucket lists change length every step (no graph), and padding rows would keep appending to them.
    capabilities = Capabilities(constant_state=False, graphable=False, paddable=False)
    projections = 3  # shared QK

    @classmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        # The query's bucket in each round (expected occupancy) and its local window, keys and values read.
        seen, d = cfg.reformer_rounds * t / cfg.reformer_buckets + min(cfg.reformer_local_window, t), cfg.d_model
        return TokenCost(flops=4 * seen * d, state_bytes=(2 * seen * d + 2 * d) * STATE_NUMBER_BYTES)

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
        self.register_buffer("rotations", torch.randn(cfg.reformer_rounds, cfg.d_head, cfg.reformer_buckets // 2))

    @property
    def rounds(self) -> int:
        return self.rotations.shape[0]

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LSHCache:
        h, r, d, n = self.n_heads, self.rounds, self.proj.in_features // self.n_heads, self.max_len
        idx = _index_dtype(n)
        return LSHCache(
            k=torch.zeros(batch, h, n, d, device=device, dtype=dtype),
            v=torch.zeros(batch, h, n, d, device=device, dtype=dtype),
            buckets=torch.zeros(batch, h, r, n, device=device, dtype=idx),
            members=torch.zeros(batch, h, r, self.n_buckets, n, device=device, dtype=idx),
            counts=torch.zeros(batch, h, r, self.n_buckets, device=device, dtype=torch.long),
        )

    def hash(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> buckets (B, H, R, T) int64."""
        rot = self.rotations
        if self.training and self.fresh_rotations:
            rot = torch.randn_like(rot)
        projected = torch.einsum("bhtd,rdn->bhrtn", keys.float(), rot.float())
        return torch.cat([projected, -projected], dim=-1).argmax(dim=-1)

    def forward(self, x: torch.Tensor, start: torch.Tensor, state: LSHCache | None):
        q = split_heads(self.qk(x), self.n_heads)  # (B, H, T, D)
        v = split_heads(self.v(x), self.n_heads)
        k = F.normalize(q, dim=-1)
        buckets = self.hash(k)
        t = q.shape[2]
        pos = chunk_positions(start, t)  # (B, T)
        if state is None:
            y = _lsh_attend_bucketed(q, k, v, buckets, self.n_buckets, self.window)
        elif t == 1:
            y = self._decode_step(q, k, v, buckets, pos[:, 0], state)
        else:
            y = self._attend_cached(q, k, v, buckets, pos, state)
        return self.proj(merge_heads(y.to(x.dtype))), state

    def _write(self, k, v, buckets, pos, state: LSHCache) -> None:
        """Store a chunk's keys, values and bucket memberships in the cache."""
        b, h, r, t = buckets.shape
        rows = torch.arange(b, device=k.device)[:, None]
        state.k[rows, :, pos] = k.transpose(1, 2).to(state.k.dtype)
        state.v[rows, :, pos] = v.transpose(1, 2).to(state.v.dtype)
        state.buckets[rows, :, :, pos] = buckets.permute(0, 3, 1, 2).to(state.buckets.dtype)
        onehot = F.one_hot(buckets, self.n_buckets)  # (B, H, R, T, n)
        # Slot of each token in its bucket list: occupancy before it.
        rank = (onehot.cumsum(dim=3) - onehot).gather(-1, buckets[..., None])[..., 0]
        slot = state.counts.gather(-1, buckets) + rank  # (B, H, R, T)
        flat = state.members.view(b, h, r, -1)
        flat.scatter_(-1, buckets * self.max_len + slot, pos[:, None, None, :].expand_as(slot).to(flat.dtype))
        state.counts.add_(onehot.sum(dim=3))

    def _attend_cached(self, q, k, v, buckets, pos, state: LSHCache) -> torch.Tensor:
        self._write(k, v, buckets, pos, state)
        used = int(pos.max()) + 1
        key_pos = torch.arange(used, device=q.device).expand(q.shape[0], used)
        keys, values = state.k[:, :, :used].to(q.dtype), state.v[:, :, :used].to(q.dtype)
        return _lsh_attend(q, keys, values, buckets, state.buckets[..., :used].long(), pos, key_pos, self.window)

    def _decode_step(self, q, k, v, buckets, pos, state: LSHCache) -> torch.Tensor:
        """One token per row, touching only its bucket's members."""
        b, h, r, _ = buckets.shape
        n, length, d = self.n_buckets, state.k.shape[2], q.shape[-1]
        qb = buckets[..., 0]  # (B, H, R)
        count = state.counts.gather(-1, qb[..., None])[..., 0]  # (B, H, R)
        width = max(int(count.max()), 1)
        # Flat row index of each (b, h, r, bucket) list, then its first `width` members.
        lists = torch.arange(b * h * r, device=q.device).view(b, h, r) * n + qb
        members = state.members.view(-1, length).index_select(0, lists.view(-1))[:, :width].long()
        # Flat key index of each member: (b, h) row times length plus position.
        rows = torch.arange(b * h, device=q.device).view(b, h, 1, 1) * length
        flat = (members.view(b, h, r, width) + rows).view(-1)
        keys = state.k.view(-1, d).index_select(0, flat).view(b, h, r, width, d).to(q.dtype)
        values = state.v.view(-1, d).index_select(0, flat).view(b, h, r, width, d).to(q.dtype)
        # Append the token itself as a last column, used only when its bucket is empty.
        keys = torch.cat([keys, k[:, :, None].expand(b, h, r, 1, d)], dim=3)
        values = torch.cat([values, v[:, :, None].expand(b, h, r, 1, d)], dim=3)
        valid = torch.arange(width, device=q.device) < count[..., None]
        valid = torch.cat([valid, (count == 0)[..., None]], dim=-1)  # (B, H, R, W+1)
        scores = (q[:, :, None] @ keys.transpose(-1, -2)) / math.sqrt(d)  # (B, H, R, 1, W+1)
        scores = scores.masked_fill(~valid[..., None, :], float("-inf"))
        out, lse = _round_results(scores, values)  # (B, H, R, 1, D), (B, H, R, 1, 1)
        if self.window:
            local_out, local_lse = self._local_step(q, k, v, pos, state)
            out, lse = torch.cat([out, local_out], dim=2), torch.cat([lse, local_lse], dim=2)
        self._write(k, v, buckets, pos[:, None], state)
        return _mix_rounds(out, lse)  # (B, H, 1, D)

    def _local_step(self, q, k, v, pos, state: LSHCache):
        """The local round for one token per row: the W cached positions before it."""
        b, h, _, d = q.shape
        before = pos[:, None] - self.window + torch.arange(self.window, device=q.device)  # (B, W)
        rows = torch.arange(b, device=q.device)[:, None]
        index = before.clamp(min=0)
        keys = state.k[rows, :, index].transpose(1, 2).to(q.dtype)  # (B, H, W, D)
        values = state.v[rows, :, index].transpose(1, 2).to(q.dtype)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)  # itself last
        valid = torch.cat([before >= 0, (pos == 0)[:, None]], dim=1)  # (B, W+1): itself only at 0
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d)  # (B, H, 1, W+1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        return _round_results(scores[:, :, None], values[:, :, None])  # (B, H, 1, 1, D), (B, H, 1, 1, 1)


def _round_results(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, H, R, T, L) masked with -inf; values (B, H, R or 1, L, D) ->
    each round's softmax output (B, H, R, T, D) and logsumexp (B, H, R, T, 1)."""
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ values, lse


def _mix_rounds(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, H, R, T, D), (B, H, R, T, 1) -> (B, H, T, D).

    Each round's output is weighted by the softmax over rounds of its
    logsumexp: one softmax over the union of the rounds' keys when no key
    appears in two rounds.
    """
    return (torch.softmax(lse, dim=2) * out).sum(dim=2)


def _lsh_attend(q, keys, values, q_buckets, k_buckets, q_pos, k_pos, window: int = 0) -> torch.Tensor:
    """Dense LSH attention over explicit keys, the local round included when window > 0.

    q (B, H, T, D); keys, values (B, H, L, D); q_buckets (B, H, R, T);
    k_buckets (B, H, R, L); q_pos (B, T); k_pos (B, L) absolute positions -> (B, H, T, D).

    Mixing the rounds' softmaxes with weights softmax_r(logsumexp_r) equals one
    softmax over all keys in which key j counts once per round that holds it:
    scores + log(count_j). So the rounds become one additive mask (log 0 = -inf
    hides a key) and one fused scaled_dot_product_attention call, instead of a
    (B, H, R, T, L) float tensor of scores per round.
    """
    count = _key_counts(q_buckets, k_buckets, q_pos, k_pos, window)  # (B, H, T, L) uint8
    bias = torch.zeros(count.shape, dtype=q.dtype, device=q.device).masked_fill_(count == 0, float("-inf"))
    most = q_buckets.shape[2] + (1 if window else 0)  # a key can be in every round
    for c in range(2, most + 1):  # log(count) without a log pass over the whole mask
        bias.masked_fill_(count == c, math.log(c))
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=bias)


def _key_counts(q_buckets, k_buckets, q_pos, k_pos, window: int) -> torch.Tensor:
    """How many rounds hold key j for query i: (B, H, T, L) uint8. Each round holds the
    earlier keys of the query's bucket (the local round: of its window), or else itself."""
    b, h, rounds, t = q_buckets.shape
    earlier = k_pos[:, None, :] < q_pos[:, :, None]  # (B, T, L)
    itself = k_pos[:, None, :] == q_pos[:, :, None]
    count = torch.zeros(b, h, t, k_pos.shape[1], dtype=torch.uint8, device=q_buckets.device)
    for r in range(rounds):
        allowed = (q_buckets[:, :, r, :, None] == k_buckets[:, :, r, None, :]) & earlier[:, None]
        allowed |= itself[:, None] & ~allowed.any(dim=-1, keepdim=True)
        count += allowed
    if window:
        local = earlier & (k_pos[:, None, :] >= q_pos[:, :, None] - window)
        local |= itself & ~local.any(dim=-1, keepdim=True)
        count += local[:, None]
    return count


def _local_round(q, k, v, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The local round over a whole sequence from position 0, in blocks of `window`:
    each block's queries see their own block and the one before, masked to the
    `window` positions before each query. O(T W) instead of O(T^2).

    q, k, v (B, H, T, D) -> out (B, H, 1, T, D), lse (B, H, 1, T, 1).
    """
    b, h, t, d = q.shape
    n = -(-t // window)  # blocks
    pad = n * window - t
    # One block of zeros in front, so block 0 has a "previous" block (masked out).
    qb = F.pad(q, (0, 0, 0, pad)).view(b, h, n, window, d)
    kb, vb = (F.pad(x, (0, 0, window, pad)).view(b, h, n + 1, window, d) for x in (k, v))
    keys = torch.cat([kb[:, :, :-1], kb[:, :, 1:]], dim=3)  # (B, H, n, 2W, D)
    values = torch.cat([vb[:, :, :-1], vb[:, :, 1:]], dim=3)
    q_pos = torch.arange(n * window, device=q.device).view(n, window, 1)
    k_pos = (torch.arange(n, device=q.device) * window).view(n, 1, 1) + torch.arange(-window, window, device=q.device)
    allowed = (k_pos < q_pos) & (k_pos >= q_pos - window) & (k_pos >= 0)  # (n, W, 2W)
    allowed[0, 0, window] = True  # position 0 has nothing before it: itself
    scores = (qb @ keys.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    out, lse = _round_results(scores, values)  # (B, H, n, W, D), (B, H, n, W, 1)
    return out.view(b, h, 1, n * window, d)[:, :, :, :t], lse.view(b, h, 1, n * window, 1)[:, :, :, :t]


def _lsh_attend_bucketed(q, k, v, buckets, n_buckets: int, window: int = 0) -> torch.Tensor:
    """The same semantics as `_lsh_attend` for a whole sequence from position 0,
    computed inside buckets: sort positions by (bucket, position), pad every
    bucket to the largest one (M), attend within each bucket. Costs
    O(n_buckets * M^2) instead of O(T^2); exact, not the paper's chunk
    approximation. Falls back to the dense form when buckets are very uneven.
    The local round runs in blocks either way: O(T W).

    q, k, v (B, H, T, D); buckets (B, H, R, T) -> (B, H, T, D).
    """
    b, t = buckets.shape[0], buckets.shape[3]
    counts = F.one_hot(buckets, n_buckets).sum(dim=3)  # (B, H, R, n)
    m = int(counts.max())
    if 4 * n_buckets * m * m > t * t:  # padding would cost more than it saves
        pos = torch.arange(t, device=q.device).expand(b, t)
        return _lsh_attend(q, k, v, buckets, buckets, pos, pos, window)
    out, lse = _bucket_rounds(q, k, v, buckets, n_buckets, counts, m)
    if window:
        local_out, local_lse = _local_round(q, k, v, window)
        out, lse = torch.cat([out, local_out], dim=2), torch.cat([lse, local_lse], dim=2)
    return _mix_rounds(out, lse)


def _bucket_rounds(q, k, v, buckets, n_buckets: int, counts, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hashed rounds, sorted and padded to buckets of m: (B, H, R, T, D), (B, H, R, T, 1)."""
    b, h, r, t = buckets.shape
    d = q.shape[-1]
    order = (buckets * t + torch.arange(t, device=q.device)).argsort(dim=-1)  # (B, H, R, T) positions by bucket
    sorted_buckets = buckets.gather(-1, order)
    offsets = counts.cumsum(dim=-1) - counts  # first sorted index of each bucket
    slot = torch.arange(t, device=q.device) - offsets.gather(-1, sorted_buckets)
    padded_index = (sorted_buckets * m + slot)[..., None].expand(b, h, r, t, d)
    order_d = order[..., None].expand(b, h, r, t, d)

    def to_buckets(x):  # (B, H, T, D) -> (B, H, R, n, M, D), zero padding
        xs = x[:, :, None].expand(b, h, r, t, d).gather(3, order_d)
        return x.new_zeros(b, h, r, n_buckets * m, d).scatter(3, padded_index, xs).view(b, h, r, n_buckets, m, d)

    qp, kp, vp = to_buckets(q), to_buckets(k), to_buckets(v)
    # Earlier members of the bucket; the first member (nothing earlier) sees itself.
    allowed = torch.ones(m, m, dtype=torch.bool, device=q.device).tril(-1)
    allowed[0, 0] = True
    scores = (qp @ kp.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))  # (B, H, R, n, M, M)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ vp  # (B, H, R, n, M, D)
    out = torch.cat([out, lse], dim=-1).view(b, h, r, n_buckets * m, d + 1)
    # Back from bucket slots to positions.
    gathered = out.gather(3, torch.cat([padded_index, padded_index[..., :1]], dim=-1))
    unsorted = torch.empty_like(gathered).scatter(3, torch.cat([order_d, order_d[..., :1]], dim=-1), gathered)
    return unsorted[..., :d], unsorted[..., d:]  # (B, H, R, T, D), (B, H, R, T, 1)
