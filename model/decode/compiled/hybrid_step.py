"""A hybrid model's whole decode step as one C++ call (model/kernels/hybrid_step.cpp), on its decode twin's weights.

What linear_step.py is for linear models, for the hybrid kind: the same block around the attention (learned
positions, layer norms, exact GELU, biases, packed products, the head inside the call when it is categorical), with
the hybrid attention of model/kernels/hybrid_attention.h: any feature map (elu + 1, t2r, Hedgehog) and grouped-query
heads, for the sizes that kernel takes. Its step computes what `Transformer.decode_step` does
(tests/test_hybrid_kernel.py holds it to the eager model). Anything else keeps the compiled step, whose layers
still run the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ...attention.hybrid import HybridAttention, HybridState
from ...state import ModelState
from ...transformer import Transformer
from .linear_step import blocks_of, block_refusal, step_weights
from .whole_step import StepOperator, WholeStep


def hybrid_step_refusal(twin: Transformer) -> str | None:
    """Why the one-call hybrid step does not take this decode twin, or None when it does. Needs the kernels loaded
    (model/kernels/loader.py)."""
    cfg = twin.config
    if cfg.attention != "hybrid":
        return f"{cfg.attention} attention (it takes hybrid attention)"
    refusal = block_refusal(twin)
    if refusal is not None:
        return refusal
    if not all(_attention(block).kernel_takes() for block in blocks_of(twin)):
        return (
            f"heads of {cfg.d_head} numbers, a window of {cfg.hybrid_window} and {cfg.hybrid_feature_map} features "
            "(not taken by this CPU route's attention kernel)"
        )
    return None


def _attention(block: torch.nn.Module) -> HybridAttention:
    return cast(HybridAttention, block.attn)


def _map_tensors(attn: HybridAttention) -> list[torch.Tensor]:
    """The learned map's weight (KV, P, D) and bias (KV, P); none for elu + 1."""
    projection = attn.projection()
    return [] if projection is None else [projection.weight.detach(), projection.bias.detach()]


@dataclass(frozen=True)
class WholeHybridStep(WholeStep):
    """A hybrid twin's decode step as one `hybrid_decode_step` call; `categorical_draw` draws after it."""

    mixes: list[torch.Tensor]  # per block (H,)
    maps: list[torch.Tensor]  # per block the map's weight and bias, none for elu + 1
    map_kind: int

    @classmethod
    def of(cls, twin: Transformer) -> "WholeHybridStep":
        layers = [_attention(block) for block in blocks_of(twin)]
        mixes = [attn.mix.detach().contiguous() for attn in layers]
        maps = [t.contiguous() for attn in layers for t in _map_tensors(attn)]
        return cls(twin, *step_weights(twin), mixes, maps, layers[0].map_kind() if layers else 0)

    def operators(self) -> tuple[StepOperator, StepOperator | None]:
        return torch.ops.rnnserve.hybrid_decode_step, None

    def after_tokens(self, state: ModelState) -> tuple[object, ...]:
        cfg = self.twin.config
        states = [t for layer in state.layers for t in _state_tensors(cast(HybridState, layer))]
        return (
            state.lengths,
            *self.embeddings,
            self.weights,
            states,
            self.mixes,
            self.maps,
            cfg.n_heads,
            cfg.n_kv_heads,
            self.map_kind,
            cfg.ln_eps,
            cfg.hybrid_eps,
        )


def _state_tensors(layer: HybridState) -> list[torch.Tensor]:
    return [layer.k, layer.v, layer.s, layer.z]


def whole_hybrid_step(twin: Transformer) -> WholeHybridStep | None:
    """The one-call step for this decode twin, or None when it does not take it (`hybrid_step_refusal`)."""
    return WholeHybridStep.of(twin) if hybrid_step_refusal(twin) is None else None
