"""Model configuration: every hyper-parameter that defines a checkpoint.

The config travels inside the safetensors metadata, so it must round-trip
through JSON exactly (plain ints, floats, strings).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .kinds import attention_kinds

TASKS = ("mnist", "text")
POS_ENCODINGS = ("learned", "sinusoidal")
LINFORMER_SHARING = ("none", "headwise", "kv")
OUTPUT_HEADS = ("categorical", "logistic_mixture")

BYTE_VOCAB = 256  # grey levels for pixels, bytes for text
BOS_TOKEN = 256  # start-of-sequence token, only ever an input


class ConfigError(ValueError):
    """A config value is out of range or unknown."""


@dataclass(frozen=True)
class ModelConfig:
    attention: str = "linear"
    task: str = "text"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_len: int = 256
    dropout: float = 0.0
    pos_encoding: str = "learned"
    # linear attention
    linear_eps: float = 1e-6
    # Linformer: projected length k and parameter sharing
    linformer_k: int = 32
    linformer_sharing: str = "headwise"
    # Reformer: hashing rounds and buckets (even: bucket = argmax([xR; -xR]))
    reformer_rounds: int = 1
    reformer_buckets: int = 32
    # Reformer: one more round over the W positions before each query (0: none;
    # files from before this option have none)
    reformer_local_window: int = 0
    # Output: 256 free logits, or (MNIST) a mixture of logistics over the grey levels (model/output_heads.py)
    output_head: str = "categorical"
    mixtures: int = 10
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_choice("attention", attention_kinds())
        self._check_choice("task", TASKS)
        self._check_choice("pos_encoding", POS_ENCODINGS)
        self._check_choice("linformer_sharing", LINFORMER_SHARING)
        self._check_choice("output_head", OUTPUT_HEADS)
        if self.output_head == "logistic_mixture" and self.task != "mnist":
            raise ConfigError(f"output_head logistic_mixture models grey levels; task {self.task!r} predicts bytes, "
                              f"which have no order: use output_head categorical")
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "max_len", "linformer_k", "reformer_rounds", "mixtures"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.reformer_buckets < 2 or self.reformer_buckets % 2:
            raise ConfigError(f"reformer_buckets must be an even number >= 2, got {self.reformer_buckets}")
        if self.reformer_local_window < 0:
            raise ConfigError(f"reformer_local_window must be >= 0, got {self.reformer_local_window}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ConfigError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def vocab_in(self) -> int:
        return BYTE_VOCAB + 1  # bytes plus BOS

    @property
    def vocab_out(self) -> int:
        return BYTE_VOCAB

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("config JSON must be an object")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
