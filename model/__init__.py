"""rnnserve model core: causal attention kinds behind one chunk-and-state contract.

The names below are imported on first access, so reading the config or the
registry of kinds (CLI argument parsing, `--help`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers only: at run time __getattr__ imports them on first access
    # `X as X`: an explicit re-export (the names below are the package's, not only its submodules')
    from .config import BOS_TOKEN as BOS_TOKEN, BYTE_VOCAB as BYTE_VOCAB, ModelConfig as ModelConfig
    from .state import ModelState as ModelState
    from .transformer import SequenceTooLong as SequenceTooLong, Transformer as Transformer
    from .transformer import build_model as build_model

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
