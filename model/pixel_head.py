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

LEVELS = 256
MIN_LOG_SCALE = -7.0  # PixelCNN++'s floor: a component never narrower than e^-7 (a tenth of a bin)
INITIAL_LOG_SCALE = -2.0  # e^-2 = 0.135 on [-1, 1]: about 17 grey levels
OPEN_EDGE = 1e3  # stands for +-infinity: levels 0 and 255 take all the mass beyond them


def bin_edges(device: torch.device | None = None) -> torch.Tensor:
    """(257,) edges of the levels' bins on [-1, 1]: level v is centred at 2v/255 - 1, half a step wide each side."""
    inner = torch.linspace(-1.0, 1.0, LEVELS, device=device)[:-1] + 1.0 / (LEVELS - 1)  # (255,)
    return torch.cat([inner.new_tensor([-OPEN_EDGE]), inner, inner.new_tensor([OPEN_EDGE])])


def mixture_log_probs(logit_weights: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """(..., n) mixture parameters -> (..., 256) log-probabilities of the grey levels' bins.

    A bin [lo, hi] of one logistic has mass sigmoid(a) - sigmoid(b), a = (hi - mu)/s, b = (lo - mu)/s,
    computed in log space as logsigmoid(a) + logsigmoid(-b) + log(1 - e^(b - a)) so that far tails stay finite.
    """
    inv_scale = torch.exp(-log_scales.clamp(min=MIN_LOG_SCALE))  # (..., n)
    edges = bin_edges(means.device)
    z = (edges - means[..., None]) * inv_scale[..., None]  # (..., n, 257): each edge in the component's units
    upper = F.logsigmoid(z[..., 1:])  # (..., n, 256): log CDF at each bin's upper edge
    below = F.logsigmoid(-z[..., :-1])  # (..., n, 256): log(1 - CDF) at its lower edge
    width = (edges[1:] - edges[:-1]) * inv_scale[..., None]  # (..., n, 256)
    log_mass = upper + below + torch.log(-torch.expm1(-width))
    return torch.logsumexp(F.log_softmax(logit_weights, dim=-1)[..., None] + log_mass, dim=-2)


class LogisticMixtureHead(nn.Module):
    def __init__(self, d_model: int, mixtures: int):
        super().__init__()
        self.mixtures = mixtures
        self.proj = nn.Linear(d_model, 3 * mixtures)  # weights, means, log-scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., 256) log-probabilities, in float32 whatever the model's dtype."""
        logit_weights, means, log_scales = self.proj(x).float().chunk(3, dim=-1)  # (..., n) each
        # Means are free: one beyond -1 or 1 puts its mass on level 0 or 255, where most MNIST pixels are.
        return mixture_log_probs(logit_weights, means, log_scales)

    def initialise(self) -> None:
        """Components spread over the grey levels and a few levels wide: an optimiser moves a bias by about
        its learning rate per step, so starting at scale 1 (all levels) would take thousands of steps to sharpen."""
        n = self.mixtures
        with torch.no_grad():
            self.proj.bias[n:2 * n] = torch.linspace(-1.0, 1.0, n)
            self.proj.bias[2 * n:] = INITIAL_LOG_SCALE


def build_output_head(cfg: ModelConfig) -> nn.Module:
    if cfg.output_head == "logistic_mixture":
        return LogisticMixtureHead(cfg.d_model, cfg.mixtures)
    return nn.Linear(cfg.d_model, cfg.vocab_out)
