"""Decoder-only transformer over bytes/grey levels, any attention kind.

Contract shared by training, prefill and decoding:
    logits, state = model(tokens, state)
tokens (B, T) with T >= 1. With state=None the chunk is a whole sequence
from position 0 and no state is kept (training, scoring). With a state from
`new_state`, each row continues from its own position and the state is
updated in place and returned.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from .attention.base import Attention, Capabilities
from .block_parts import GeluFeedForward, SwiGLUFeedForward, build_feed_forward, build_norm
from .config import BOS_TOKEN, ModelConfig
from .attention.head_shapes import chunk_positions
from .output_heads import LogisticMixtureHead, build_output_head
from .attention.classes import attention_class
from .state import ModelState, RowState


class SequenceTooLong(ValueError):
    """A chunk would run past the model's max_len."""


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x))."""

    attn: Attention
    ff: GeluFeedForward | SwiGLUFeedForward

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn = build_norm(cfg)
        self.attn = attention_class(cfg.attention)(cfg)
        self.ln_ff = build_norm(cfg)
        self.ff = build_feed_forward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def start_as_identity(self) -> None:
        """Zero the last layer of both residual branches: the block passes x through unchanged,
        so a model grown by a block computes what it did (gradients still reach both branches)."""
        for last in (cast(nn.Linear, self.attn.proj), self.ff.last_layer()):
            nn.init.zeros_(last.weight)
            if last.bias is not None:
                nn.init.zeros_(last.bias)

    def forward(
        self, x: torch.Tensor, start: torch.Tensor, state: RowState | None
    ) -> tuple[torch.Tensor, RowState | None]:
        a, state = self.attn(self.ln_attn(x), start, state)
        x = x + self.drop(a)
        return x + self.ff(self.ln_ff(x)), state


def sinusoidal_encoding(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, T) positions -> (B, T, dim) fixed sin/cos features."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device) / half)
    angles = pos[..., None].float() * freq
    enc = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return F.pad(enc, (0, dim - 2 * half))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_in, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.pos_encoding == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = build_norm(cfg)
        self.head = build_output_head(cfg, self.tok_emb)
        # Keys and values of kinds that cache them (softmax) are stored in this dtype; None: the model's.
        # A runtime choice (the server's --kv-cache-dtype), not part of the weights.
        self.kv_cache_dtype: torch.dtype | None = None
        self.apply(_init_weights)
        if isinstance(self.head, LogisticMixtureHead):
            self.head.initialise()

    @property
    def device(self) -> torch.device:
        return self.ln_f.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ln_f.weight.dtype

    @property
    def capabilities(self) -> Capabilities:
        """What this model's attention kind can do when decoding."""
        return self.attentions()[0].capabilities

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_state(self, batch_size: int) -> ModelState:
        """Empty decoding state for `batch_size` rows, preallocated for max_len."""
        layers = [attn.new_state(batch_size, self.device, self._state_dtype(attn)) for attn in self.attentions()]
        return ModelState(layers, torch.zeros(batch_size, dtype=torch.long, device=self.device))

    def cache_dtype(self) -> torch.dtype | None:
        """The dtype its cached keys and values are stored in; None for kinds that do not take a cache dtype."""
        attn = self.attentions()[0]
        return self._state_dtype(attn) if attn.kv_cache else None

    def attentions(self) -> list[Attention]:
        """Each block's attention layer, in order."""
        return [cast(Block, block).attn for block in self.blocks]

    def _state_dtype(self, attn: Attention) -> torch.dtype:
        return self.kv_cache_dtype if attn.kv_cache and self.kv_cache_dtype is not None else self.dtype

    def limit_context(self, max_len: int) -> None:
        """Serve at most `max_len` positions, fewer than it was made for (vLLM's --max-model-len): the config says
        the shorter context, and caches that keep every position (softmax, Reformer) are preallocated for it."""
        if max_len >= self.config.max_len:
            return
        self.config = dataclasses.replace(self.config, max_len=max_len)
        for block in self.blocks:
            if hasattr(block.attn, "max_len"):
                block.attn.max_len = max_len

    def state_bytes_per_sequence(self, length: int | None = None) -> int:
        """Bytes of decode state one sequence holds at `length` (default max_len)."""
        state = self.new_state(1)
        state.lengths.fill_(self.config.max_len if length is None else length)
        return state.nbytes_in_use()

    if TYPE_CHECKING:  # what calling the module returns: its forward's result (nn.Module types the call as Any)

        @overload
        def __call__(self, tokens: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]: ...

        @overload
        def __call__(self, tokens: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]: ...

        def __call__(
            self, tokens: torch.Tensor, state: ModelState | None = None
        ) -> tuple[torch.Tensor, ModelState | None]: ...

    def forward(self, tokens: torch.Tensor, state: ModelState | None = None) -> tuple[torch.Tensor, ModelState | None]:
        b, t = tokens.shape
        start = state.lengths if state is not None else tokens.new_zeros(b)
        end = int(start.max()) + t
        if end > self.config.max_len:
            raise SequenceTooLong(f"sequence would reach {end} tokens; this model's max_len is {self.config.max_len}")
        return self._run(tokens, start, state), state

    def decode_step(self, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
        """One token per row: (B,) -> next-token logits (B, V); the state moves on in place.

        Unlike `forward` there is no max_len check: reading the lengths on the host
        would wait for the device, and a CUDA graph cannot capture that wait.
        Callers keep every row below max_len (the engine checks at admission).
        """
        return self._run(tokens[:, None], state.lengths, state)[:, -1]

    def token_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T): log p(tokens[:, t] | tokens[:, :t]), one parallel pass from BOS (training, scoring).
        The head scores only the observed tokens, which a mixture head does far faster than all 256."""
        hidden = self._hidden(with_bos(tokens, self.config.bos), tokens.new_zeros(tokens.shape[0]), None)
        return self.head.log_probs_at(hidden, tokens)

    def next_token_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V): log p(v | tokens[:, :t]) for every class v, one parallel pass from BOS
        (distillation compares whole distributions)."""
        return (
            self._run(with_bos(tokens, self.config.bos), tokens.new_zeros(tokens.shape[0]), None)
            .float()
            .log_softmax(-1)
        )

    def _run(self, tokens: torch.Tensor, start: torch.Tensor, state: ModelState | None) -> torch.Tensor:
        """(B, T) tokens from positions `start` -> (B, T, V) logits."""
        logits: torch.Tensor = self.head(self._hidden(tokens, start, state))
        return logits

    def _hidden(self, tokens: torch.Tensor, start: torch.Tensor, state: ModelState | None) -> torch.Tensor:
        """(B, T) tokens from positions `start` -> (B, T, d_model), the final layer norm applied."""
        x = self.tok_emb(tokens) + self._positions(chunk_positions(start, tokens.shape[1]))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x, _ = block(x, start, state.layers[i] if state is not None else None)
        if state is not None:
            state.lengths += tokens.shape[1]
        normed: torch.Tensor = self.ln_f(x)
        return normed

    def _positions(self, pos: torch.Tensor) -> torch.Tensor | float:
        """What the input adds for its positions: nothing for rotary ones, which attention applies."""
        if self.pos_emb is not None:
            embedded: torch.Tensor = self.pos_emb(pos)
            return embedded
        if self.config.pos_encoding == "rotary":
            return 0.0
        return sinusoidal_encoding(pos, self.config.d_model).to(self.dtype)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig) -> Transformer:
    return Transformer(cfg)


def with_bos(tokens: torch.Tensor, bos_token: int = BOS_TOKEN) -> torch.Tensor:
    """Prepend the start token (the model's `config.bos`): the input that predicts `tokens`. (B, T) -> (B, T)."""
    bos = torch.full_like(tokens[:, :1], bos_token)
    return torch.cat([bos, tokens[:, :-1]], dim=1)
