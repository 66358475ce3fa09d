"""One hashed round over a whole sequence as a single causal attention call.

Training runs here: one round, and buckets far too uneven for `bucketed` (most
MNIST background pixels share a bucket). How `visibility`'s rule maps onto
`scaled_dot_product_attention(is_causal=True)`, whose fused kernel skips the
upper triangle and needs no (T, T) mask:

- earlier keys: keys move one slot right (slot j + 1 holds key j), so the causal
  mask shows query i exactly the keys before it. Slot 0 holds a *sink* key.
- same bucket: queries and keys gain the L bits of their bucket as +-1 features,
  the query's scaled by c_i, plus a level feature (-L c_i against 1): a key's
  score gains 0 in the query's bucket and at most -2 c_i in any other. c_i exceeds
  the spread of the query's scores by MARGIN, so another bucket's key weighs less
  than e^-MARGIN of the best visible key. c_i is a power of two, so the codes
  cancel exactly in bfloat16 too.
- the local round, folded in through the sink: its score is the local round's
  logsumexp and its value a unit column. The call then returns the hashed keys'
  share of the two rounds' softmax plus the sink's weight p, and
  hashed share + p * local output = `mix_rounds` of the two rounds.
- itself: a query first in its bucket (`first_in_bucket`) sees only itself in
  the hashed round; its mix is computed directly.

The head dimension grows from D to D + L + 2 (rounded up to 16), which costs
little: the fused kernel's time is mostly spent outside the dot products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .bucketed import local_round
from .visibility import first_in_bucket

MARGIN = 32.0  # e^-32 ~ 1e-14: another bucket's key weighs nothing at float32 precision


def attend_causal(q, k, v, buckets, n_buckets: int, window: int = 0) -> torch.Tensor:
    """q, k, v (B, H, T, D) from position 0; buckets (B, H, 1, T), one round -> (B, H, T, D)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if window:
        local_out, local_lse = (x[:, :, 0] for x in local_round(q, k, v, window))  # (B, H, T, D), (B, H, T, 1)
    else:
        local_out = local_lse = None
    qx, kx, vx = _coded_inputs(q * scale, k, v, buckets[:, :, 0], n_buckets, local_lse)
    out = F.scaled_dot_product_attention(qx, kx, vx, is_causal=True, scale=1.0)  # (B, H, T, width)
    d = q.shape[-1]
    hashed, sink_weight = out[..., :d], out[..., d:d + 1]
    itself = (q * scale * k).sum(dim=-1, keepdim=True)  # (B, H, T, 1) score of the query's own key
    if window:
        mixed = hashed + sink_weight * local_out
        own_weight = torch.sigmoid(itself - local_lse)  # the two rounds' mix when the hashed one is itself
        alone = own_weight * v + (1 - own_weight) * local_out
    else:
        mixed, alone = hashed, v
    return torch.where(first_in_bucket(buckets[:, :, 0], n_buckets)[..., None], alone, mixed)


def _coded_inputs(q, k, v, buckets, n_buckets: int, sink_score):
    """Scaled q (B, H, T, D), k, v, buckets (B, H, T), sink score (B, H, T, 1) or None ->
    qx, kx, vx (B, H, T, width) for one causal call, in q's dtype."""
    b, h, t, d = q.shape
    dtype = q.dtype
    bits = bucket_bits(buckets, n_buckets, dtype)  # (B, H, T, L)
    n_bits = bits.shape[-1]
    width = -(-(n_bits + 2 + d) // 16) * 16
    c = _code_scale(q, k).to(dtype)  # (B, H, T, 1)
    if sink_score is None:  # no local round: the sink weighs like another bucket's key
        sink_score = -2 * c
    features = [bits * c, -n_bits * c, sink_score.to(dtype), q]  # bits, level, sink, query
    qx = torch.cat(features + [q.new_zeros(b, h, t, width - n_bits - 2 - d)], dim=-1)
    kx = q.new_zeros(b, h, t, width)
    kx[:, :, 1:, :n_bits] = bits[:, :, :-1]  # key j in slot j + 1
    kx[:, :, 1:, n_bits] = 1
    kx[:, :, 0, n_bits + 1] = 1  # the sink
    kx[:, :, 1:, n_bits + 2:n_bits + 2 + d] = k[:, :, :-1].to(dtype)
    vx = q.new_zeros(b, h, t, width)  # values as wide as keys: the fused kernel wants one head size
    vx[:, :, 1:, :d] = v[:, :, :-1].to(dtype)
    vx[:, :, 0, d] = 1
    return qx, kx, vx


def bucket_bits(buckets: torch.Tensor, n_buckets: int, dtype: torch.dtype) -> torch.Tensor:
    """(...,) bucket ids -> (..., L) their L = ceil(log2 n_buckets) bits as -1 / +1."""
    shifts = torch.arange(max(1, (n_buckets - 1).bit_length()), device=buckets.device)
    return (((buckets[..., None] >> shifts) & 1) * 2 - 1).to(dtype)


@torch.no_grad()
def _code_scale(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, H, T, 1) power of two c_i >= |q_i| max_j |k_j| + MARGIN / 2: the bucket gap 2 c_i exceeds the
    spread of query i's scores (at most 2 |q_i| max |k|) by MARGIN."""
    bound = q.float().norm(dim=-1, keepdim=True) * k.float().norm(dim=-1).amax(dim=-1)[..., None, None]
    return torch.exp2(torch.ceil(torch.log2(bound + MARGIN / 2)))
