"""`rnnserve train --init-from FILE`: a new run that starts from a trained model's weights.

Unlike `--resume`, which continues a checkpoint's own schedule, this starts a
fresh schedule and optimiser from the weights of a shipped `.safetensors`
file. Settings that own no parameters may differ from the file's, so a model
can be retrained under another hashing (Reformer buckets, rounds, local
window) or dropout; every other architecture field must match. A buffer that
keeps its shape is copied (Reformer's rotations, when the hashing's shape is
unchanged); one whose shape changes stays as this run drew it.

A run may also build more layers than the file has (`--layers`): the file's
blocks fill the bottom and each new block on top starts as an identity, so
the grown model begins exactly where the file's model was.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from model import Transformer
from model.config import ModelConfig
from model.attention.kinds import ATTENTION_KINDS, kind_options
from model.io.weights import WeightsError, load_model

from .resume import config_differences
from .errors import TrainError


def parameter_free_fields() -> frozenset[str]:
    """Config fields that size no parameter, so a warm start may change them: dropout and the attention options
    declared so (model/attention/kinds.py)."""
    return frozenset({"dropout"} | {key for key, option in kind_options().items() if option.parameter_free})


def check_warm_start_config(path: str, saved: ModelConfig, built: ModelConfig) -> None:
    """Name every field that differs and would change the parameters (bar added layers). The attention kind
    may change (a softmax model linearized): `check_parameters_fit` then checks that the file's parameters
    all fit the new kind's, and neither kind's own options are compared."""
    free = parameter_free_fields()
    if saved.attention != built.attention:
        free |= {
            "attention",
            *ATTENTION_KINDS[saved.attention].option_keys,
            *ATTENTION_KINDS[built.attention].option_keys,
        }
    differences = config_differences(saved, built, free | {"n_layers"})
    if differences:
        allowed = ", ".join(sorted(free))
        raise TrainError(
            f"--init-from {path}: the file has {differences}; only {allowed} may differ from the "
            "file's (they own no parameters), and n_layers may grow"
        )
    if built.n_layers < saved.n_layers:
        raise TrainError(
            f"--init-from {path}: the file has n_layers={saved.n_layers}; this run builds "
            f"n_layers={built.n_layers}: a warm start may add layers (they start as identities), "
            "not drop them"
        )


def check_parameters_fit(path: str, source: Transformer, model: Transformer) -> None:
    """Every parameter of the file has a place of the same shape in the model built (new ones, e.g. a learned
    feature map's, start as drawn)."""
    shapes = {name: tensor.shape for name, tensor in model.named_parameters()}
    misfit = [name for name, tensor in source.named_parameters() if shapes.get(name) != tensor.shape]
    if misfit:
        raise TrainError(
            f"--init-from {path}: the file's {source.config.attention} parameter {misfit[0]} has no "
            f"place of its shape in a {model.config.attention} model ({len(misfit)} such); a warm start "
            "may change the attention kind only to one that holds every parameter of the file's "
            "(softmax -> linear)"
        )


def init_from(path: str, model: Transformer) -> list[str]:
    """Copy the file's parameters (and same-shape buffers) into `model`; returns the buffers left as drawn."""
    try:
        source, _ = load_model(path)
    except WeightsError as exc:
        raise TrainError(f"--init-from: {exc}") from exc
    check_warm_start_config(path, source.config, model.config)
    check_parameters_fit(path, source, model)
    state = source.state_dict()
    parameters = {name for name, _ in model.named_parameters()}
    kept = []
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if name not in state:
                continue  # a grown block's own tensor
            if name not in parameters and state[name].shape != target.shape:
                kept.append(name)
                continue
            target.copy_(state[name].to(target.dtype))
    added = model.blocks[source.config.n_layers :]
    for block in added:
        block.start_as_identity()
    changed = {
        name: (getattr(source.config, name), getattr(model.config, name))
        for name in sorted(parameter_free_fields())
        if getattr(source.config, name) != getattr(model.config, name)
    }
    if source.config.attention != model.config.attention:
        changed["attention"] = (source.config.attention, model.config.attention)
    if added:
        changed["n_layers"] = (source.config.n_layers, f"{model.config.n_layers} (new blocks start as identities)")
    listed = "; ".join(f"{name} {old} -> {new}" for name, (old, new) in sorted(changed.items())) or "no change"
    print(f"initialised from {Path(path)} ({listed}; {len(kept)} buffers drawn anew)", file=sys.stderr)
    return kept
