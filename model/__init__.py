"""rnnserve model core: causal attention kinds behind one chunk-and-state contract.

The names below are imported on first access, so reading the config or the
registry of kinds (CLI argument parsing, `--help`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers only: at run time __getattr__ imports them on first access
    from .config import BOS_TOKEN, BYTE_VOCAB, ModelConfig  # noqa: F401
    from .state import ModelState  # noqa: F401
    from .transformer import SequenceTooLong, Transformer, build_model  # noqa: F401

# exported name -> submodule that defines it
_EXPORTS = {
    "BOS_TOKEN": "config",
    "BYTE_VOCAB": "config",
    "ModelConfig": "config",
    "ModelState": "state",
    "SequenceTooLong": "transformer",
    "Transformer": "transformer",
    "build_model": "transformer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
