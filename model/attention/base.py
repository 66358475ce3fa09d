"""What every attention kind is: a module with the chunk-and-state contract
that declares, as class attributes, what its decoding can do and cost.

Everything that treats kinds differently (CUDA graphs, compiled CPU decode
steps, padded decode steps, the benchmark's flatness check, the roofline)
reads these declarations instead of naming kinds, so a new kind is one module derived from
`Attention` plus one line in `model/attention/classes.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import ModelConfig
from ..state import RowState

STATE_NUMBER_BYTES = 4  # decode states are costed as float32 numbers


@dataclass(frozen=True)
class Capabilities:
    constant_state: bool  # the state does not grow with length: every decode step costs the same
    graphable: bool  # a decode step has fixed shapes, so a CUDA graph can capture it
    paddable: bool  # padding rows may run decode steps from position 0 without harm
    compilable: bool  # a decode step traces whole into a torch.compile graph (model/decode/compiled/decoder.py)


@dataclass(frozen=True)
class TokenCost:
    """One layer's attention work for one generated token of one sequence."""

    flops: float
    state_bytes: float  # decode-state bytes read plus written
    # Of state_bytes, those of cached keys and values, which a kind with `kv_cache` stores in the cache dtype
    # (counted here as float32); None: all of them for such a kind.
    cached_bytes: float | None = None


class Attention(nn.Module, ABC):
    """Base of every attention kind.

    forward(x (B, T, C), start (B,), state or None) -> (y (B, T, C), state):
    with state None, x is a whole sequence from position 0; otherwise each
    row continues from `start` and the state is updated in place.
    """

    capabilities: ClassVar[Capabilities]
    projections: ClassVar[int] = 4  # (d_model x d_model) weight matrices per layer: Q, K, V, output
    # The state is a cache of keys and values that may be stored in another dtype than the model computes in
    # (Transformer.kv_cache_dtype), read by a kernel that widens it as it loads. Recurrent sums are not: they stay
    # float32 whatever the model's dtype. Reformer's cache is not either (yet): it stays in the model's dtype.
    kv_cache: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            raise TypeError(f"{cls.__name__} must declare `capabilities = Capabilities(...)`")

    @abstractmethod
    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> RowState:
        """An empty decoding state for `batch` rows."""

    @classmethod
    @abstractmethod
    def token_cost(cls, cfg: ModelConfig, t: float) -> TokenCost:
        """Cost of decoding one token at position t (the roofline's attention term)."""
