"""Resuming a run from its checkpoint: the weights, optimiser and generator states put back, after checking that
the checkpoint's architecture and run settings are this run's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from model import ModelConfig, Transformer

from .checkpoint import optimizer_param_names
from .errors import TrainError
from .run_state import Checkpoint, Progress, RunSettings


def restore(
    path: Path, ckpt: Checkpoint, model: Transformer, opt: torch.optim.Optimizer, generator: torch.Generator
) -> Progress:
    """Load weights, optimiser state and RNG states into this run; returns the progress to continue from."""
    check_config(path, ckpt.config, model.config)
    if ckpt.param_names is not None and ckpt.param_names != optimizer_param_names(model, opt):
        raise TrainError(f"{path}: the optimiser's parameter groups differ from this run's")
    try:
        model.load_state_dict(ckpt.model)
        opt.load_state_dict(ckpt.optimizer)  # casts bfloat16 moments back to the parameters' float32
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainError(f"{path}: checkpoint does not fit this model: {exc}") from exc
    ckpt.rng.restore(generator)
    return ckpt.progress


def config_differences(saved: ModelConfig, built: ModelConfig, ignored: frozenset[str] = frozenset()) -> str | None:
    """'attention=linear; this run builds attention=softmax' for the fields that differ (bar `ignored`), or None."""
    was, now = saved.as_dict(), built.as_dict()
    fields = [name for name in was if was[name] != now[name] and name not in ignored]
    if not fields:
        return None
    had = ", ".join(f"{name}={was[name]}" for name in fields)
    return f"{had}; this run builds " + ", ".join(f"{name}={now[name]}" for name in fields)


def check_config(path: Path, saved: ModelConfig, built: ModelConfig) -> None:
    """Name every architecture field that differs, e.g. 'attention=linear; this run builds attention=softmax'."""
    differences = config_differences(saved, built)
    if differences:
        raise TrainError(
            f"{path}: checkpoint has {differences}; use the same architecture flags as the run that wrote it"
        )


def run_changes(saved: RunSettings, now: RunSettings) -> dict[str, tuple[Any, Any]]:
    """Settings that differ: name -> (checkpoint's value, this run's)."""
    return {
        f.name: (getattr(saved, f.name), getattr(now, f.name))
        for f in dataclasses.fields(saved)
        if getattr(saved, f.name) != getattr(now, f.name)
    }
