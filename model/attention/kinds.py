"""The explicit list of attention kinds: name -> where its class lives and the hyperparameters it owns. Plain
data, importing nothing, so that the config (which validates a kind's name and options), the registry (which
imports the classes) and the CLI (whose `--help` must not import torch) all read it.

Adding a kind: write a module with a subclass of `model.attention.base.Attention` (its capabilities and per-token
cost included) and add one entry here, with the hyperparameters the class reads from its config. Each option
becomes a config key (stored in every model file's metadata), a `rnnserve train` flag (`--key-with-dashes`),
and a check on load. Tests add a kind for their duration with
`monkeypatch.setitem(ATTENTION_KINDS, name, AttentionKind("module:Class", (KindOption(...),)))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

OptionValue = Union[bool, int, float, str]
TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _of_type(value: object, expected: type) -> bool:
    """JSON's types as an option reads them: an integer is a number too, a boolean is not an integer."""
    if isinstance(value, bool) or expected is bool:
        return isinstance(value, bool) and expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


@dataclass(frozen=True)
class KindOption:
    """One hyperparameter of an attention kind. `key` names it in the config and the file's metadata (prefix it
    with the kind: every kind's options share one namespace); `default` is what a file without it has."""

    key: str
    default: OptionValue
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    even: bool = False
    new_model_default: OptionValue | None = None  # what `rnnserve train` builds with, when not `default`
    parameter_free: bool = False  # sizes no parameter: a warm start (`--init-from`) may change it

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def train_default(self) -> OptionValue:
        return self.default if self.new_model_default is None else self.new_model_default

    def problem(self, value: object) -> str | None:
        """Why `value` is not valid for this option, or None."""
        if not _of_type(value, self.type):
            return f"{self.key} must be {TYPE_NAMES[self.type]}, got {value!r}"
        if self.choices and value not in self.choices:
            return f"unknown {self.key} {value!r}; expected one of {', '.join(self.choices)}"
        if self.minimum is not None and isinstance(value, (int, float)) and value < self.minimum:
            return f"{self.key} must be >= {self.minimum}, got {value}"
        if self.even and isinstance(value, int) and value % 2:
            return f"{self.key} must be an even number, got {value}"
        return None


@dataclass(frozen=True)
class AttentionKind:
    cls: str  # "module:Class"
    options: tuple[KindOption, ...] = ()
    # What it implements of imported models' attention (model/architecture.py): "rotary" positions, "kv_heads"
    # (grouped-query attention), a "sliding_window", projections without biases ("qkv_bias", "attn_out_bias").
    # A model of a kind without one cannot set it.
    implements: tuple[str, ...] = ()

    @property
    def option_keys(self) -> tuple[str, ...]:
        return tuple(option.key for option in self.options)


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "softmax": AttentionKind(
        "model.attention.softmax:SoftmaxAttention",
        implements=("rotary", "kv_heads", "sliding_window", "qkv_bias", "attn_out_bias"),
    ),
    "linear": AttentionKind(
        "model.attention.linear:LinearAttention",
        (
            KindOption("linear_eps", 1e-6, "added to the normaliser phi(q)^T Z", minimum=0.0),
            KindOption(
                "linear_feature_map",
                "elu",
                "phi: elu(x) + 1, or one learned to mimic softmax attention when "
                "a softmax model is linearized (model/attention/feature_maps.py): t2r, relu(W x + b); hedgehog, "
                "softmax over +-(W x + b)",
                choices=("elu", "t2r", "hedgehog"),
            ),
            KindOption(
                "linear_features",
                0,
                "outputs per head of t2r's or hedgehog's projection W (0: the head "
                "size); phi has as many with t2r, twice as many with hedgehog",
                minimum=0,
            ),
        ),
        implements=("rotary", "kv_heads", "qkv_bias", "attn_out_bias"),
    ),
    "linformer": AttentionKind(
        "model.attention.linformer:LinformerAttention",
        (
            KindOption(
                "linformer_k", 32, "length k the keys and values are projected to", minimum=1, new_model_default=64
            ),
            KindOption(
                "linformer_sharing",
                "headwise",
                "projections shared by the heads (headwise), by keys and values too (kv), or by nothing (none)",
                choices=("none", "headwise", "kv"),
            ),
        ),
    ),
    "hybrid": AttentionKind(
        "model.attention.hybrid:HybridAttention",
        (
            KindOption("hybrid_window", 64, "exact softmax over the last W positions, linear attention before", (), 1),
            KindOption(
                "hybrid_feature_map",
                "elu",
                "phi of the linear part over tokens older than the window (as linear_feature_map)",
                choices=("elu", "t2r", "hedgehog"),
            ),
            KindOption(
                "hybrid_features", 0, "outputs per head of a learned map's projection (0: the head size)", (), 0
            ),
            KindOption("hybrid_eps", 1e-6, "added to the shared normaliser", minimum=0.0),
        ),
        implements=("rotary", "kv_heads", "qkv_bias", "attn_out_bias"),
    ),
    "reformer": AttentionKind(
        "model.attention.reformer.attention:ReformerAttention",
        (
            KindOption("reformer_rounds", 1, "hashing rounds", minimum=1, parameter_free=True),
            KindOption(
                "reformer_buckets",
                32,
                "hash buckets per round (bucket = argmax([xR; -xR]))",
                minimum=2,
                even=True,
                parameter_free=True,
            ),
            # Files from before this option have no window; new models get one: without it a shared-QK character
            # model learns no more than a bigram (see model/attention/reformer/attention.py).
            KindOption(
                "reformer_local_window",
                0,
                "also attend to the W positions before each query (0: hashed buckets only)",
                minimum=0,
                new_model_default=32,
                parameter_free=True,
            ),
        ),
    ),
}


def attention_kinds() -> tuple[str, ...]:
    """Every registered kind, in registry order."""
    return tuple(ATTENTION_KINDS)


def kind_options() -> dict[str, KindOption]:
    """Every kind's options by key, in registry order."""
    return {option.key: option for kind in ATTENTION_KINDS.values() for option in kind.options}
