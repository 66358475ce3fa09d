"""The model `rnnserve eval` scores: a shipped weights file, or a training checkpoint of a run in progress.

A checkpoint gives the model its run would save if it stopped now: the moving
average of the weights when the run keeps one (--ema-decay), else the last
step's weights. So a long run can be scored without stopping it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model import Transformer
from model.io.weights import WeightsError, load_model, read_tokenizer

from .checkpoint import model_of
from .data import DataError
from .errors import TrainError


def is_checkpoint(path: str | Path) -> bool:
    return Path(path).suffix == ".ckpt"


def load_evaluated(path: str | Path, device: torch.device) -> tuple[Transformer, dict[str, Any] | None]:
    """The model in float32, and what the checkpoint held (None for a weights file)."""
    if not is_checkpoint(path):
        return load_model(path, device=device, dtype=torch.float32)[0], None
    try:
        return model_of(Path(path), device)
    except TrainError as exc:
        raise DataError(str(exc)) from exc


def stored_tokenizer(path: str | Path) -> str | None:
    """The tokenizer a weights file or checkpoint carries (a model imported with one, or trained from one);
    None for byte models and for checkpoints of the older format."""
    try:
        return read_tokenizer(path)
    except WeightsError:
        return None
