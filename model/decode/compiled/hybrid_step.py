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
from .drawing import DrawRows
from .linear_step import blocks_of, block_refusal, step_weights


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
class WholeHybridStep:
    """One decode step of a hybrid twin as one operator call: tokens (n,) for a state's rows -> logits (n, V)."""

    twin: Transformer
    embeddings: tuple[torch.Tensor, torch.Tensor]  # tokens' and positions'
    weights: list[torch.Tensor]
    head_inside: bool  # the categorical head runs in the call; else `twin.head` runs on its output
    mixes: list[torch.Tensor]  # per block (H,)
    maps: list[torch.Tensor]  # per block the map's weight and bias, none for elu + 1
    map_kind: int

    @classmethod
    def of(cls, twin: Transformer) -> "WholeHybridStep":
        layers = [_attention(block) for block in blocks_of(twin)]
        mixes = [attn.mix.detach().contiguous() for attn in layers]
        maps = [t.contiguous() for attn in layers for t in _map_tensors(attn)]
        return cls(twin, *step_weights(twin), mixes, maps, layers[0].map_kind() if layers else 0)

    def __call__(self, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
        return self.on_rows(state)(tokens)

    def with_draw(self, tokens: torch.Tensor, state: ModelState, rows: DrawRows, drawn: torch.Tensor) -> torch.Tensor:
        """A step, then each row's next token drawn from its logits into `drawn` (n,) as `categorical_draw` draws
        it: for a twin whose head runs inside the step (`head_inside`). Returns the logits (n, V)."""
        return self.on_rows(state).with_draw(tokens, rows, drawn)

    def on_rows(self, state: ModelState) -> "HybridStepOnRows":
        """The step on these rows of a state, its call's arguments gathered once (as `WholeLinearStep.on_rows`): a
        caller that steps the same rows again and again keeps it rather than gathering them every token."""
        cfg = self.twin.config
        states = [t for layer in state.layers for t in _state_tensors(cast(HybridState, layer))]
        after_tokens = (
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
        return HybridStepOnRows(self, after_tokens)


@dataclass(frozen=True)
class HybridStepOnRows:
    """A `WholeHybridStep` on one state's rows: tokens (n,) -> logits (n, V). It holds that state's tensors, which
    the call updates in place, so it stays right for as long as the state keeps them."""

    step: WholeHybridStep
    after_tokens: tuple[object, ...]  # hybrid_decode_step's arguments after the tokens

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.rnnserve.hybrid_decode_step(tokens, *self.after_tokens)
        return out if self.step.head_inside else self.step.twin.head(out)

    def with_draw(self, tokens: torch.Tensor, rows: DrawRows, drawn: torch.Tensor) -> torch.Tensor:
        """`WholeHybridStep.with_draw` on these rows: the step's call, then categorical_draw's."""
        assert self.step.head_inside  # the draw needs the head's logits, which the call returns only then
        logits = self(tokens)
        torch.ops.rnnserve.categorical_draw(logits, *rows, drawn)
        return logits


def _state_tensors(layer: HybridState) -> list[torch.Tensor]:
    return [layer.k, layer.v, layer.s, layer.z]


def whole_hybrid_step(twin: Transformer) -> WholeHybridStep | None:
    """The one-call step for this decode twin, or None when it does not take it (`hybrid_step_refusal`)."""
    return WholeHybridStep.of(twin) if hybrid_step_refusal(twin) is None else None
