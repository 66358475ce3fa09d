"""Model configuration: every hyper-parameter that defines a checkpoint.

The config travels inside the safetensors metadata, so it must round-trip
through JSON exactly (plain ints, floats, strings). The attention kinds' own
hyperparameters are declared with the kinds (model/attention/kinds.py) and kept in
`options`; they read as attributes (`config.linformer_k`) and are stored as
top-level keys, as every file has them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .architecture import NEEDS_KIND_SUPPORT, block_options
from .attention.kinds import ATTENTION_KINDS, attention_kinds, kind_options

TASKS = ("mnist", "text")
POS_ENCODINGS = ("learned", "sinusoidal", "rotary")
OUTPUT_HEADS = ("categorical", "logistic_mixture")
GELU_FORMS = ("exact", "tanh")  # GELU as erf, or its tanh approximation (GPT-2's)

BYTE_VOCAB = 256  # grey levels for pixels, bytes for text
BOS_TOKEN = 256  # start-of-sequence token, only ever an input


class ConfigError(ValueError):
    """A config value is out of range or unknown."""


@dataclass(frozen=True, init=False)
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
    # Output: 256 free logits, or (MNIST) a mixture of logistics over the grey levels (model/output_heads.py)
    output_head: str = "categorical"
    mixtures: int = 10
    # The vocabulary: bytes by default, a tokenizer's for imported models (model/io/hf_import.py).
    vocab_size: int = BYTE_VOCAB
    # The token every sequence starts from: -1 is one more input token after the vocabulary (rnnserve's own
    # models); an imported model names one of its own (GPT-2: <|endoftext|>).
    bos_token: int = -1
    eos_token: int = -1  # a token that ends a generated text (GPT-2: <|endoftext|>); -1: none, byte models
    tied_head: bool = False  # the output layer is the input embedding, without a bias (GPT-2)
    gelu: str = "exact"
    ln_eps: float = 1e-5
    extra: dict[str, Any] = field(default_factory=dict)
    # Every kind's hyperparameters by key (model/attention/kinds.py) and the block's parts (model/architecture.py),
    # defaults filled in: a file has them all.
    options: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        """Fields by name; a kind's hyperparameters and the block's options by their keys (`linformer_k=64`,
        `norm="rms"`) or in `options`."""
        declared = declared_options()
        given = dict(values.pop("options", None) or {})
        given.update({key: values.pop(key) for key in list(values) if key in declared})
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(self)} | set(given) - set(declared))
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        for f in dataclasses.fields(self):
            default = f.default_factory() if callable(f.default_factory) else f.default
            object.__setattr__(self, f.name, values.get(f.name, default))
        object.__setattr__(self, "options", {key: given.get(key, option.default) for key, option in declared.items()})
        self._check()

    def __getattr__(self, name: str) -> Any:
        """A kind's hyperparameter, e.g. `config.linformer_k` (only reached when no field has the name)."""
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__} has no field or attention option {name!r}")

    def _check(self) -> None:
        self._check_choice("attention", attention_kinds())
        self._check_choice("task", TASKS)
        self._check_choice("pos_encoding", POS_ENCODINGS)
        self._check_choice("output_head", OUTPUT_HEADS)
        self._check_choice("gelu", GELU_FORMS)
        self._check_vocabulary()
        if self.output_head == "logistic_mixture" and self.task != "mnist":
            raise ConfigError(
                f"output_head logistic_mixture models grey levels; task {self.task!r} predicts bytes, "
                f"which have no order: use output_head categorical"
            )
        for key, option in declared_options().items():
            if (problem := option.problem(self.options[key])) is not None:
                raise ConfigError(problem)
        self._check_block()
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "max_len", "mixtures"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    def _check_block(self) -> None:
        implements = ATTENTION_KINDS[self.attention].implements
        if self.pos_encoding == "rotary" and "rotary" not in implements:
            raise ConfigError(f"pos_encoding rotary: {self.attention} attention does not implement rotary positions")
        for key, plain in NEEDS_KIND_SUPPORT.items():
            if self.options[key] != plain and key not in implements:
                raise ConfigError(f"{key} {self.options[key]}: {self.attention} attention does not implement it")
        if self.options["kv_heads"] and self.n_heads % self.options["kv_heads"]:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of kv_heads ({self.options['kv_heads']})")

    def _check_vocabulary(self) -> None:
        if self.vocab_size < 2:
            raise ConfigError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not -1 <= self.bos_token < self.vocab_size:
            raise ConfigError(
                f"bos_token must be -1 (a token of its own) or a token below vocab_size "
                f"({self.vocab_size}), got {self.bos_token}"
            )
        if not -1 <= self.eos_token < self.vocab_size:
            raise ConfigError(
                f"eos_token must be -1 (none) or a token below vocab_size ({self.vocab_size}), got {self.eos_token}"
            )
        if self.tied_head and self.bos_token < 0:
            raise ConfigError(
                "tied_head shares the input embedding with the output layer, so the start token must "
                "be one of the vocabulary: set bos_token"
            )
        if self.output_head == "logistic_mixture" and self.vocab_size != BYTE_VOCAB:
            raise ConfigError(
                f"output_head logistic_mixture models {BYTE_VOCAB} grey levels; vocab_size is {self.vocab_size}"
            )
        if not self.ln_eps > 0:
            raise ConfigError(f"ln_eps must be > 0, got {self.ln_eps}")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ConfigError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        """Key and value heads: fewer than the query heads in grouped-query attention."""
        return self.options["kv_heads"] or self.n_heads

    @property
    def bos(self) -> int:
        """The start token's id."""
        return self.vocab_size if self.bos_token < 0 else self.bos_token

    @property
    def reads_bos_first(self) -> bool:
        """Whether every prompt is read after the start token. rnnserve's own models were trained that way (their
        start token is an input of its own); an imported model reads a prompt as its tokenizer wrote it (Hugging
        Face's convention: the tokenizer adds a start token if the model wants one), so only an empty prompt
        starts from the start token."""
        return self.bos_token < 0

    def prompt_lead(self, prompt_length: int) -> list[int]:
        """The tokens the model reads before a prompt of `prompt_length` tokens: the start token, or nothing."""
        return [self.bos] if self.reads_bos_first or prompt_length == 0 else []

    @property
    def vocab_in(self) -> int:
        return self.vocab_size + 1 if self.bos_token < 0 else self.vocab_size  # the start token may be extra

    @property
    def vocab_out(self) -> int:
        return self.vocab_size

    def as_dict(self) -> dict[str, Any]:
        """Flat: the fields, and each option under its own key (what a file stores)."""
        data = dataclasses.asdict(self)
        data.update(data.pop("options"))
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if "options" in data:  # stored flat; a nested one would be read twice
            raise ConfigError("unknown config keys: options")
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
        return ModelConfig(**{**self.as_dict(), **changes})


def declared_options() -> dict[str, Any]:
    """Every option a config holds by key: the attention kinds' and the block's."""
    return {**kind_options(), **block_options()}
