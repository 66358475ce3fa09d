"""`rnnserve linearize FILE --out OUT --feature-map hedgehog|t2r|elu`: a softmax model turned into an RNN.

The linear model has the softmax model's shape and keeps every one of its weights (linear attention has the
same projections); a learned feature map adds its own per-head projection (model/feature_maps.py). It is then
fine-tuned by `rnnserve train` itself, started from FILE's weights (`--init-from FILE`) and, unless
--no-teacher, distilled from FILE (`--teacher FILE`): checkpoints, `--resume`, curves, lineage and the
evaluation at the end are training's. The flags after FILE are train's fine-tuning and run flags.
"""

from __future__ import annotations

import argparse
import sys

from model.kinds import ATTENTION_KINDS
from model.weights_io import WeightsError, read_metadata

from .arguments import add_train_arguments
from .train import run as run_training


class LinearizeError(ValueError):
    """FILE cannot be linearized."""


def train_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """The `rnnserve train` arguments that fine-tune FILE's linear twin: its architecture, this command's
    fine-tuning and run flags, the feature map, and FILE as the start (and the teacher)."""
    try:
        config, _ = read_metadata(args.model)
    except (WeightsError, OSError) as exc:
        raise LinearizeError(f"{args.model}: {exc}") from exc
    if config.attention != "softmax":
        raise LinearizeError(
            f"{args.model} is a {config.attention} model; linearize turns a softmax model into a linear one"
        )
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    train = parser.parse_args(["--task", config.task, "--attention", "linear", "--data", args.data, "--out", args.out])
    for name, value in vars(args).items():
        if hasattr(train, name):  # data, out, eval data, and train's fine-tuning and run flags
            setattr(train, name, value)
    architecture = {
        "layers": config.n_layers,
        "d_model": config.d_model,
        "heads": config.n_heads,
        "d_ff": config.d_ff,
        "context": config.max_len,
        "dropout": config.dropout,
        "pos_encoding": config.pos_encoding,
        "output_head": config.output_head,
        "mixtures": config.mixtures,
    }
    vars(train).update(architecture)
    linear_options = ATTENTION_KINDS["linear"].option_keys  # train's defaults, bar the two below
    vars(train).update({key: value for key, value in config.options.items() if key not in linear_options})
    train.linear_feature_map, train.linear_features = args.feature_map, args.features
    train.init_from = args.model
    train.teacher = None if args.no_teacher else [args.model, *(args.teacher or [])]
    train.command_line = args.command_line
    return train


def run(args: argparse.Namespace) -> int:
    try:
        train = train_arguments(args)
    except LinearizeError as exc:
        print(f"rnnserve linearize: error: {exc}", file=sys.stderr)
        return 2
    return run_training(train)
