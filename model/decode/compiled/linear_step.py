"""A linear model's whole decode step as one C++ call (model/kernels/linear_step.cpp), on its decode twin's weights.

What the compiled CPU decoder (model/decode/compiled/decoder.py) runs for the models it
takes: linear attention with the paper's elu + 1 features, learned positions,
exact GELU, float32, heads a whole number of the route's vectors. Its step
computes what `Transformer.decode_step` does (tests/test_linear_step.py holds it
to the eager model on the machine's route, tests/test_cpu_kernels.py on the
others that can be forced there), without a graph's wrappers or an operator
call per layer. A categorical head runs inside the call; any other head (the
logistic mixture, a tied one) runs after it, on the final hidden state.
`with_draw` also draws each row's next token from the logits, inside the same
call where the head is (model/kernels/categorical_draw.cpp).
Anything else (learned feature maps, sinusoidal or rotary positions, grouped-query
attention, GPT-2's tanh GELU) keeps the compiled step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ...attention.linear import LinearState
from ...attention.projections import FusedProjections
from ...kernels.packed_linear import PackedLinear
from ...state import ModelState
from ...transformer import Block, Transformer
from .whole_step import StepOperator, WholeStep


def whole_step_refusal(twin: Transformer) -> str | None:
    """Why the one-call step does not take this decode twin (model/kernels/packed_linear.py), or None when it does.
    Needs the kernels loaded (model/kernels/loader.py)."""
    cfg = twin.config
    if cfg.attention != "linear":
        return f"{cfg.attention} attention (it takes linear attention)"
    if cfg.linear_feature_map != "elu":
        return f"{cfg.linear_feature_map} features (it takes elu + 1)"
    refusal = block_refusal(twin)
    if refusal is not None:
        return refusal
    if cfg.n_kv_heads != cfg.n_heads:  # it reads one state per query head; the compiled step takes the others
        return f"kv_heads {cfg.n_kv_heads} (it takes one key head per query head)"
    if not torch.ops.rnnserve.linear_step_takes_head(cfg.d_head):
        return f"heads of {cfg.d_head} numbers (not a whole number of this CPU route's vectors)"
    return None


def block_refusal(twin: Transformer) -> str | None:
    """Why model/kernels/decode_block.h's step around the attention does not take this decode twin, or None."""
    cfg = twin.config
    if twin.pos_emb is None:  # rotary positions among them: the call adds a position embedding, turns nothing
        return f"{cfg.pos_encoding} positions (it takes learned ones)"
    if (cfg.norm, cfg.feed_forward) != ("layer", "gelu") or not all((cfg.qkv_bias, cfg.attn_out_bias, cfg.ff_bias)):
        return f"{cfg.norm} norms and a {cfg.feed_forward} feed-forward (it takes GPT-2's block with its biases)"
    if cfg.gelu != "exact":
        return f"{cfg.gelu} GELU (it takes the exact one)"
    if twin.dtype != torch.float32 or twin.device.type != "cpu":
        return f"{twin.dtype} weights on {twin.device} (it takes float32 on the CPU)"
    if not all(isinstance(m, PackedLinear) for block in blocks_of(twin) for m in linear_layers(block)):
        return "linear layers that are not packed"
    return None


def blocks_of(twin: Transformer) -> list[Block]:
    return [cast(Block, block) for block in twin.blocks]


def linear_layers(block: Block) -> list[nn.Module]:
    """A block's linear layers, in the order the one-call steps read them: PackedLinear in a decode twin (its
    packing swaps them in, which no static type records)."""
    attn = cast(FusedProjections, block.attn)
    return [attn.qkv, attn.proj, block.ff.up, block.ff.down]


def _bias(layer: PackedLinear) -> torch.Tensor:
    return layer.bias if layer.bias is not None else torch.zeros(layer.out_features)


def packed(layer: PackedLinear) -> list[torch.Tensor]:
    return [layer.packed, _bias(layer)]


def norm_weights(norm: nn.Module) -> list[torch.Tensor]:
    """A LayerNorm's weight and bias (block_refusal checked the block has LayerNorms)."""
    layer = cast(nn.LayerNorm, norm)
    return [layer.weight, layer.bias]


def block_weights(block: Block) -> list[torch.Tensor]:
    """In the order the one-call steps read them (the twin's layers are packed: block_refusal checked)."""
    qkv, proj, up, down = (cast(PackedLinear, layer) for layer in linear_layers(block))
    return [
        *norm_weights(block.ln_attn),
        *packed(qkv),
        *packed(proj),
        *norm_weights(block.ln_ff),
        *packed(up),
        *packed(down),
    ]


def step_weights(twin: Transformer) -> tuple[tuple[torch.Tensor, torch.Tensor], list[torch.Tensor], bool]:
    """A one-call step's embeddings (tokens', positions'), its `weights` list as model/kernels/decode_block.h's
    `step_weights` reads it, and whether the categorical head runs inside the call (`block_refusal` checked)."""
    weights = [w for block in blocks_of(twin) for w in block_weights(block)] + norm_weights(twin.ln_f)
    head: nn.Module = twin.head
    head_inside = isinstance(head, PackedLinear)
    if isinstance(head, PackedLinear):
        weights += packed(head)
    # Plain tensors, detached once here rather than every step (the call would not take parameters as they
    # are under inference mode).
    weights = [w.detach().contiguous() for w in weights]
    assert twin.pos_emb is not None  # block_refusal: learned positions
    embeddings = (twin.tok_emb.weight.detach(), twin.pos_emb.weight.detach())
    return embeddings, weights, head_inside


@dataclass(frozen=True)
class WholeLinearStep(WholeStep):
    """A linear twin's decode step as one `linear_decode_step` call; `linear_decode_step_draw` draws in it too."""

    @classmethod
    def of(cls, twin: Transformer) -> "WholeLinearStep":
        return cls(twin, *step_weights(twin))

    def operators(self) -> tuple[StepOperator, StepOperator | None]:
        return torch.ops.rnnserve.linear_decode_step, torch.ops.rnnserve.linear_decode_step_draw

    def after_tokens(self, state: ModelState) -> tuple[object, ...]:
        cfg = self.twin.config
        states = [cast(LinearState, layer).sz_t for layer in state.layers]
        return (state.lengths, *self.embeddings, self.weights, states, cfg.n_heads, cfg.ln_eps, cfg.linear_eps)


def whole_linear_step(twin: Transformer) -> WholeLinearStep | None:
    """The one-call step for this decode twin, or None when it does not take it (`whole_step_refusal`)."""
    return WholeLinearStep.of(twin) if whole_step_refusal(twin) is None else None
