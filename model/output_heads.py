"""Output heads: the 256 next-token logits from the last hidden state.

"categorical" is one linear layer, 256 free logits. "logistic_mixture" is the
paper's image head (after PixelCNN++): per pixel, a mixture of n logistics over
the grey levels, each level the probability mass of its bin. Neighbouring levels
then share strength, which a categorical head must learn level by level. It
returns the bins' log-probabilities, so sampling, scoring, training and the
engine use it as they use logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decode.sampling import token_logprobs

LEVELS = 256
MIN_LOG_SCALE = -7.0  # PixelCNN++'s floor: a component never narrower than e^-7 (about a ninth of a bin)
INITIAL_LOG_SCALE = -2.0  # e^-2 = 0.135 on [-1, 1]: about 17 grey levels
OPEN_EDGE = 1e3  # stands for +-infinity: levels 0 and 255 take all the mass beyond them


def bin_edges(device: torch.device | None = None) -> torch.Tensor:
    """(257,) edges of the levels' bins on [-1, 1]: level v is centred at 2v/255 - 1, half a step wide each side."""
    inner = torch.linspace(-1.0, 1.0, LEVELS, device=device)[:-1] + 1.0 / (LEVELS - 1)  # (255,)
    return torch.cat([inner.new_tensor([-OPEN_EDGE]), inner, inner.new_tensor([OPEN_EDGE])])


def _log_bin_mass(
    means: torch.Tensor, inv_scale: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor
) -> torch.Tensor:
    """log of one logistic's mass on [lower, upper], elementwise (broadcast).

    The mass is sigmoid(a) - sigmoid(b), a = (upper - mu)/s, b = (lower - mu)/s, computed as
    logsigmoid(a) + logsigmoid(-b) + log(1 - e^(b - a)) so that far tails stay finite."""
    a, b = (upper - means) * inv_scale, (lower - means) * inv_scale
    return F.logsigmoid(a) + F.logsigmoid(-b) + torch.log(-torch.expm1(b - a))


def mixture_log_probs(
    logit_weights: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor, levels: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., n) mixture parameters -> log-probabilities of all 256 grey levels (..., 256), or of `levels` (...) only.

    Training and scoring need only the observed level: 256 times less work than the whole distribution."""
    inv_scale = torch.exp(-log_scales.clamp(min=MIN_LOG_SCALE))  # (..., n)
    log_weights = F.log_softmax(logit_weights, dim=-1)
    edges = bin_edges(means.device)
    if levels is not None:
        lower, upper = edges[levels][..., None], edges[levels + 1][..., None]  # (..., 1)
        return torch.logsumexp(log_weights + _log_bin_mass(means, inv_scale, lower, upper), dim=-1)
    log_mass = _log_bin_mass(means[..., None], inv_scale[..., None], edges[:-1], edges[1:])  # (..., n, 256)
    return torch.logsumexp(log_weights[..., None] + log_mass, dim=-2)


class CategoricalHead(nn.Linear):
    """256 free logits (an nn.Linear: its parameters keep the names `head.weight`, `head.bias`)."""

    def log_probs_at(self, x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """(..., d_model), (...) -> (...) log-probabilities of `levels`."""
        return token_logprobs(self(x), levels)


class TiedHead(nn.Module):
    """Logits from the input embedding's own matrix, no bias (GPT-2): it owns no parameter, so a file stores the
    matrix once, as the embedding's."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = [embedding]  # a list: not a submodule, so the matrix appears once in the state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._embedding[0].weight)  # (..., d_model) -> (..., V)

    def log_probs_at(self, x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self(x), levels)


class LogisticMixtureHead(nn.Module):
    def __init__(self, d_model: int, mixtures: int):
        super().__init__()
        self.mixtures = mixtures
        self.proj = nn.Linear(d_model, 3 * mixtures)  # weights, means, log-scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., 256) log-probabilities, in float32 whatever the model's dtype."""
        return mixture_log_probs(*self._parameters_of(x))

    def log_probs_at(self, x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """(..., d_model), (...) -> (...) log-probabilities of `levels`."""
        return mixture_log_probs(*self._parameters_of(x), levels=levels)

    def _parameters_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Means are free: one beyond -1 or 1 puts its mass on level 0 or 255, where most MNIST pixels are.
        # The projection runs in float32 even under a bfloat16 autocast: bfloat16 keeps 8 bits, so near +-1 a
        # mean would move in steps of half a bin, too coarse for components a fraction of a bin wide.
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float())
        logit_weights, means, log_scales = out.chunk(3, dim=-1)  # (..., n) each
        return logit_weights, means, log_scales

    def initialise(self) -> None:
        """Components spread over the grey levels and a few levels wide: an optimiser moves a bias by about
        its learning rate per step, so starting at scale 1 (all levels) would take thousands of steps to sharpen."""
        n = self.mixtures
        with torch.no_grad():
            self.proj.bias[n : 2 * n] = torch.linspace(-1.0, 1.0, n)
            self.proj.bias[2 * n :] = INITIAL_LOG_SCALE


OutputHead = CategoricalHead | TiedHead | LogisticMixtureHead


def build_output_head(cfg: ModelConfig, embedding: nn.Embedding) -> OutputHead:
    if cfg.tied_head:
        return TiedHead(embedding)
    if cfg.output_head == "logistic_mixture":
        return LogisticMixtureHead(cfg.d_model, cfg.mixtures)
    return CategoricalHead(cfg.d_model, cfg.vocab_out, bias=cfg.head_bias)
