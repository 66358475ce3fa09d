"""The explicit list of attention kinds: name -> where its class lives.

Names are known without importing torch (config validation, CLI choices,
a fast `rnnserve train --help`); a class is imported when first asked for.

Adding a kind: write a module with a subclass of `model.attention.Attention`
(its capabilities and per-token cost included) and add one line to
ATTENTION_CLASSES. Tests add a kind for their duration with
`monkeypatch.setitem(ATTENTION_CLASSES, name, "module:Class")`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .attention import Attention, Capabilities

# kind -> "module:Class"
ATTENTION_CLASSES: dict[str, str] = {
    "softmax": "model.softmax_attention:SoftmaxAttention",
    "linear": "model.linear_attention:LinearAttention",
    "linformer": "model.linformer_attention:LinformerAttention",
    "reformer": "model.reformer_attention:ReformerAttention",
}


def attention_kinds() -> tuple[str, ...]:
    """Every registered kind, in registry order."""
    return tuple(ATTENTION_CLASSES)


def attention_class(kind: str) -> type[Attention]:
    """The class of `kind`, imported on first use."""
    from .attention import Attention

    if kind not in ATTENTION_CLASSES:
        raise KeyError(f"unknown attention kind {kind!r}; expected one of {', '.join(ATTENTION_CLASSES)}")
    module_name, _, class_name = ATTENTION_CLASSES[kind].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
        raise TypeError(f"attention kind {kind!r} names {ATTENTION_CLASSES[kind]}, which is not an Attention subclass")
    return cls


def attention_registry() -> dict[str, type[Attention]]:
    """kind -> class for every registered kind (imports them all)."""
    return {kind: attention_class(kind) for kind in ATTENTION_CLASSES}


def capabilities(kind: str) -> Capabilities:
    return attention_class(kind).capabilities


def kinds_where(test: Callable[[Capabilities], bool]) -> tuple[str, ...]:
    """The kinds whose capabilities pass `test`, e.g. kinds_where(lambda c: c.graphable)."""
    return tuple(kind for kind in ATTENTION_CLASSES if test(capabilities(kind)))
