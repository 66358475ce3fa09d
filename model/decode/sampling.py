"""Sampling as small pure functions over a batch of logits.

Randomness is counter-based: a row's uniform number for a draw is a hash of
its seed and position, so a request draws the same tokens whatever else is
in its batch, on CPU and GPU alike, eager or compiled, with no per-row
generator objects. The hash is 32-bit arithmetic in int64 tensors whose
products never overflow, which every backend computes alike.
Sampling is by inverse CDF: the token where a row's uniform falls in the
running sum of its weights exp(logits / T - max), in whole units of 2^-24
summed exactly as integers, is a draw from softmax(logits / T) to that
resolution. One hash per row and one exp per token: Gumbel-max
(argmax of logits plus noise) needs a hash and two logs per token, and a
hash's 64-bit multiplies run lane by lane on CPUs without them in their
vectors (AVX2, NEON).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK32 = (1 << 32) - 1
_GOLDEN32 = 0x9E3779B9  # 2^32 / golden ratio, odd: steps a Weyl sequence through every 32-bit value
POINT_BITS = 23  # where in [0, 1) a row's draw falls, in units of 2^-POINT_BITS
WEIGHT_BITS = 24  # a token's weight relative to its row's best, in units of 2^-WEIGHT_BITS


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    seed: int = 0
    # OpenAI's penalties over the tokens generated so far, and a bias per token id (see penalize)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0  # 0 means off: tokens below min_p times the best token's probability are never drawn
    repetition_penalty: float = 1.0  # 1 means off (see repetition_penalized): prompt and generated tokens alike
    # vLLM's: the end-of-text and stop token ids cannot be drawn before this many tokens, nor a stop sequence end
    # the sample (server/engine/stopping.py)
    min_tokens: int = 0
    ignore_eos: bool = False  # the end-of-text token does not end the sample
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a sample as the end-of-text token does

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or self.repetition_penalty != 1
            or self.min_tokens
        )

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p narrows the draw."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass
class BatchSampling:
    """Per-row sampling parameters as tensors, (B,) each."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    # Whether any row asks for top-k, top-p or min-p, when the caller knows (the engine does); None: read it
    # off top_k, top_p and min_p, reads back from the device per draw.
    filters: bool | None = None
    min_p: torch.Tensor | None = None  # None: no row asks for min-p

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "BatchSampling":
        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        return cls(
            col("temperature", torch.float32),
            col("top_k", torch.long),
            col("top_p", torch.float32),
            col("seed", torch.long),
            filters=any(p.filters for p in params),
            min_p=col("min_p", torch.float32),
        )


def _times(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x c) mod 2^32 for int64 x in [0, 2^32) and a constant c in [0, 2^32), with no int64 product that
    overflows: a wrapping signed product is undefined in the C++ that inductor and PyTorch's kernels compile
    from, so the draws would rest on each compiler's choice. A c of 2^31 or more is multiplied by its 16-bit
    halves."""
    if c < 1 << 31:
        return (x * c) & _MASK32
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds (all 64 bits count) and positions -> (B,) 32-bit keys, distinct for a seed's distinct
    positions (below 2^32)."""
    of_seed = _hash32(_hash32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    return _hash32((of_seed + _times(position & _MASK32, _GOLDEN32)) & _MASK32)


def row_points(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """(B,) seeds and positions -> (B,) int64 points in [0, 2^23): where in [0, 1), in units of 2^-23, each row's
    draw falls. A pure function of its inputs."""
    return row_keys(seed, position) >> (32 - POINT_BITS)


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set all but each row's k largest logits to -inf (k <= 0: keep all)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    # topk of the largest k asked for, not a full sort of the vocabulary.
    largest = logits.topk(int(k.max()), dim=-1).values
    kth = largest.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf each token whose probability is below min_p times its row's best token's (min_p 0: keep all).
    (B, V) logits (after temperature), (B,) min_p -> (B, V). The best token always stays."""
    probs = logits.softmax(dim=-1)  # (B, V)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (B, 1)
    return logits.masked_fill(probs < floor, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of tokens whose probability reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the best token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_logits(logits: torch.Tensor, params: BatchSampling) -> torch.Tensor:
    """(B, V) logits -> the (B, V) logits `sample` draws from: divided by temperature, then min-p (on the
    probabilities after temperature, as vLLM), top-k and top-p applied."""
    filtered = scaled_by_temperature(logits.float(), params.temperature)
    # The filters sort the vocabulary: skip them when no row asks (a large share of a
    # small model's decode step on CPU).
    if params.filters is False:
        return filtered
    if params.min_p is not None and bool((params.min_p > 0).any()):
        filtered = min_p_mask(filtered, params.min_p)
    if bool((params.top_k > 0).any()):
        filtered = top_k_mask(filtered, params.top_k)
    if bool((params.top_p < 1).any()):
        filtered = top_p_mask(filtered, params.top_p)
    return filtered


def scaled_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(B, V) logits / (B,) temperatures. A temperature of 0 (greedy: its token is the argmax of the logits
    themselves) divides by 1e-5 instead, so that the row stays finite."""
    return logits / temperature.clamp(min=1e-5)[:, None]


def draw_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """`sample` for rows that ask for no top-k or top-p, in one function the compiled path fuses whole:
    (B, V) float logits, (B,) x 3 -> (B,) tokens."""
    return draw(logits, scaled_by_temperature(logits, temperature), temperature, seed, position)


def sampling_logprobs(logits: torch.Tensor, params: BatchSampling, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of (B,) `tokens` under the distribution `sample` draws from (temperature > 0):
    the weight a particle takes for a known token. -inf where the filters exclude the token."""
    return token_logprobs(filtered_logits(logits, params), tokens)


def sample(logits: torch.Tensor, params: BatchSampling, position: torch.Tensor) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens; position (B,) is the index being drawn."""
    logits = logits.float()
    return draw(logits, filtered_logits(logits, params), params.temperature, params.seed, position)


def draw(
    logits: torch.Tensor, filtered: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """Each row's draw from softmax(filtered), or its greedy token (the argmax of its logits) where temperature
    is 0. (B, V) x 2, (B,) x 3 -> (B,)."""
    drawn = inverse_cdf(filtered, row_points(seed, position))
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def inverse_cdf(filtered: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """(B, V) logits and (B,) points in [0, 2^23) -> (B,) the token at which each row's running sum of weights
    first exceeds point / 2^23 of its total. A token whose weight rounds to 0 (the filters' -inf among them) is
    never drawn."""
    # Whole units of 2^-24 of the row's best token's weight (exp cannot overflow; the best weighs 2^24), summed
    # in int64: exact, so every device, batch size and order of additions gives the same sums.
    weights = ((filtered - filtered.amax(dim=-1, keepdim=True)).exp() * (1 << WEIGHT_BITS)).int()  # (B, V)
    sums = weights.cumsum(dim=-1, dtype=torch.int64)  # (B, V), non-decreasing, the last >= 2^24
    # Below the last sum (point < 2^23), so the count stops at a token whose weight raised the sum.
    target = fraction_of(sums[:, -1], point)
    return (sums <= target[:, None]).sum(dim=-1)


def fraction_of(total: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """floor(total * point / 2^23) for int64 totals below 2^62 and points in [0, 2^23), in products below 2^63:
    the total's high and low parts apart."""
    high, low = total >> POINT_BITS, total & ((1 << POINT_BITS) - 1)
    return high * point + ((low * point) >> POINT_BITS)


def penalize(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """OpenAI's adjustment: logit[j] - count[j] * frequency - (count[j] > 0) * presence + bias[j].

    (B, V) logits, counts (how often each token was generated so far) and bias; (B,) penalties.
    """
    return logits + bias - counts * frequency[:, None] - (counts > 0) * presence[:, None]


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's repetition penalty (as Hugging Face's and vLLM's): the logit of each token seen so far (in the prompt
    or generated) divided by the penalty where positive, multiplied by it where negative; a penalty of 1 changes
    nothing. (B, V) logits, (B, V) bool seen, (B,) penalties -> (B, V)."""
    scale = penalty[:, None]
    penalized = torch.where(logits > 0, logits / scale, logits * scale)
    return torch.where(seen, penalized, logits)


def suppressed_until(
    logits: torch.Tensor, ends: torch.Tensor, position: torch.Tensor, until: torch.Tensor
) -> torch.Tensor:
    """vLLM's min_tokens: the tokens that would end a sample (`ends`, (B, V) bool) set to -inf while a row draws
    a position before its `until` (its prompt's length plus min_tokens). (B, V) logits, (B,) positions -> (B, V)."""
    return logits.masked_fill(ends & (position < until)[:, None], float("-inf"))


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens and their log-probabilities: (..., V) -> ids (..., k), values (..., k)."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, values


def force_tokens(sampled: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Keep known tokens: where forced >= 0 it replaces the sample. (B,) each."""
    return torch.where(forced >= 0, forced, sampled)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of `tokens` under the model's own distribution. (..., V), (...) -> (...)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]
