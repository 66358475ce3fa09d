"""Feature maps of linear attention: phi, applied to queries and keys, (B, H, T, D) -> (B, H, T, F).

Linear attention scores a key by phi(q)^T phi(k) instead of exp(q^T k / sqrt(D)), so its state holds
sums over phi(k) of F numbers per head whatever the length. Three maps, chosen by the linear kind's
`linear_feature_map` option:
  * elu: elu(x) + 1 (Katharopoulos et al. 2020). F = D, no parameters.
  * t2r: relu(W x + b), W (H, F, D) learned per head, shared by queries and keys (Kasai et al. 2021,
    "Finetuning Pretrained Transformers into RNNs"). Made to be fine-tuned from a softmax model.
  * hedgehog: [softmax(W x + b), softmax(-(W x + b))] over the F/2 projected features (Zhang et al. 2024,
    "The Hedgehog & the Porcupine"): spiky and monotone like exp, so it can mimic softmax attention's
    weights. W starts as the identity; phi has twice the projection's outputs.
Both learned maps' projections are per head and start where the model's behaviour is closest to the
softmax model it was made from; their parameters are `feature_map.weight` and `feature_map.bias`. In
grouped-query attention they are per key head: the query heads of a group are mapped by their key head's
projection, so that phi(k) is one for the whole group and the sums over it are held once per key head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn


def projected_count(head_dim: int, features: int) -> int:
    """P, the projection's outputs of a learned map: `features` when given (> 0), else the head size."""
    return features if features > 0 else head_dim


def feature_count(name: str, head_dim: int, features: int) -> int:
    """F, the length of phi(x) (what the state holds per head and value): D for elu, P for t2r, 2P for
    hedgehog."""
    if name == "elu":
        return head_dim
    return projected_count(head_dim, features) * (2 if name == "hedgehog" else 1)


class FeatureMap(nn.Module):
    """phi: (B, H, T, D) -> (B, H, T, F)."""

    if TYPE_CHECKING:  # torch types nn.Module's call as returning Any: a map returns a tensor

        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class EluFeatureMap(FeatureMap):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0


class ProjectedFeatureMap(FeatureMap):
    """x -> W x + b per head, then the map's nonlinearity."""

    def __init__(self, heads: int, head_dim: int, projected: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, projected, head_dim))  # (H, P, D)
        self.bias = nn.Parameter(torch.zeros(heads, projected))  # (H, P)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (B, H, T, P); H is the map's heads, or a multiple of them (a group of query heads
        per key head, side by side, each group mapped by its key head's projection)."""
        heads = self.weight.shape[0]
        if x.shape[1] == heads:  # (B, H, T, D) x (H, P, D) -> (B, H, T, P)
            return torch.einsum("bhtd,hpd->bhtp", x, self.weight.float()) + self.bias.float()[:, None, :]
        grouped = torch.unflatten(x, 1, (heads, -1))  # (B, KV, G, T, D)
        projected = torch.einsum("bjgtd,jpd->bjgtp", grouped, self.weight.float()) + self.bias.float()[:, None, None]
        return projected.flatten(1, 2)


class T2RFeatureMap(ProjectedFeatureMap):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.project(x))


class HedgehogFeatureMap(ProjectedFeatureMap):
    def reset_parameters(self) -> None:
        with torch.no_grad():  # the identity (on the first D features when P > D): start from softmax(x)
            self.weight.zero_()
            rows = min(self.weight.shape[1], self.weight.shape[2])
            self.weight[:, range(rows), range(rows)] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.project(x)  # (B, H, T, P)
        return torch.cat([torch.softmax(projected, dim=-1), torch.softmax(-projected, dim=-1)], dim=-1)


def make_feature_map(name: str, heads: int, head_dim: int, features: int) -> FeatureMap:
    """The map `name` (the config checks it against model/attention/kinds.py's list) with `features` projected
    outputs."""
    if name == "t2r":
        return T2RFeatureMap(heads, head_dim, projected_count(head_dim, features))
    if name == "hedgehog":
        return HedgehogFeatureMap(heads, head_dim, projected_count(head_dim, features))
    return EluFeatureMap()
