"""The attention kinds' classes, imported when first asked for (the names are in model/attention/kinds.py).

Names are known without importing torch (config validation, CLI choices, a fast `rnnserve train --help`).
"""

from __future__ import annotations

import importlib
from typing import Callable

from .base import Attention, Capabilities
from .kinds import ATTENTION_KINDS, attention_kinds

__all__ = ["ATTENTION_KINDS", "attention_class", "attention_kinds", "attention_registry", "capabilities", "kinds_where"]


def attention_class(kind: str) -> type[Attention]:
    """The class of `kind`, imported on first use."""
    if kind not in ATTENTION_KINDS:
        raise KeyError(f"unknown attention kind {kind!r}; expected one of {', '.join(ATTENTION_KINDS)}")
    module_name, _, class_name = ATTENTION_KINDS[kind].cls.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Attention)):
        raise TypeError(
            f"attention kind {kind!r} names {ATTENTION_KINDS[kind].cls}, which is not an Attention subclass"
        )
    return cls


def attention_registry() -> dict[str, type[Attention]]:
    """kind -> class for every registered kind (imports them all)."""
    return {kind: attention_class(kind) for kind in ATTENTION_KINDS}


def capabilities(kind: str) -> Capabilities:
    return attention_class(kind).capabilities


def kinds_where(test: Callable[[Capabilities], bool]) -> tuple[str, ...]:
    """The kinds whose capabilities pass `test`, e.g. kinds_where(lambda c: c.graphable)."""
    return tuple(kind for kind in ATTENTION_KINDS if test(capabilities(kind)))
