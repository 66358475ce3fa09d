"""What every engine shares, on a thread or in a process of its own: its limits, and what it answers
without asking its worker (the model's config, the checks of a request)."""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.transformer import Transformer

from server.engine.validation import check_fits, check_samples


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 64
    max_waiting: int = 256
    cuda_graphs: bool = True  # capture decode steps on CUDA (linear, Linformer)
    compile_decode: bool = False  # compile decode steps on the CPU (the server passes --compile-decode, default on)
    scheduler_steps: int = 8  # decode steps per scheduling pass when no client watches each step (multi-step)


class EngineFacts:
    """What an engine answers without asking its worker: the model's config, and the request checks."""

    name: str
    model: Transformer
    limits: EngineLimits

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def attention(self) -> str:
        return self.model.config.attention

    def check_prompt(self, tokens: list[int], samples: int) -> None:
        """Raise InvalidRequest unless `tokens` are valid and fit this model's context, and `samples` of them
        would fit --max-batch (a request that generates nothing is held to the limits of one that does)."""
        check_fits(tokens, 0, self.name, self.config.max_len)
        check_samples(samples, self.limits.max_batch)
