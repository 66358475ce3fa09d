"""`rnnserve linearize FILE --out OUT --feature-map hedgehog|t2r|elu`: a softmax model turned into an RNN.

The linear model has the softmax model's shape and keeps every one of its weights (linear attention has the
same projections); a learned feature map adds its own per-head projection (model/attention/feature_maps.py). It is then
fine-tuned by `rnnserve train` itself, started from FILE's weights (`--init-from FILE`) and, unless
--no-teacher, distilled from FILE (`--teacher FILE`): checkpoints, `--resume`, curves, lineage and the
evaluation at the end are training's. The flags after FILE are train's fine-tuning and run flags.

With `--transfer-steps N` a first stage comes before (training/attention_transfer.py): the feature maps alone
learn to copy FILE's attention weights, the result is written beside the checkpoint (`NAME.transfer.safetensors`,
with its own run in the lineage) and the fine-tuning starts from it. A resumed command finds that file and goes
straight on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from model.attention.kinds import ATTENTION_KINDS, kind_options
from model.transformer import build_model
from model.io.vocabulary import vocabulary_for
from model.config import ConfigError
from model.io.weights import WeightsError, load_model, read_metadata, save_model

from .arguments import add_train_arguments
from .attention_transfer import transfer
from .data import DataError
from .errors import TrainError
from .lineage import inherited_lineage
from .train import (
    Batches,
    autocast_context,
    build_config,
    checkpoint_path,
    inherited_from,
    load_training_data,
    uses_autocast,
)
from .train import run as run_training
from .warm_start import init_from


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
            f"{args.model} is a {config.attention} model; linearize turns a softmax model into a linear or hybrid one"
        )
    try:
        config.replace(attention=args.kind)
    except ConfigError as exc:
        raise LinearizeError(f"{args.model}: {exc}") from exc
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    train = parser.parse_args(["--task", config.task, "--attention", args.kind, "--data", args.data, "--out", args.out])
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
    own_options = ATTENTION_KINDS[args.kind].option_keys  # train's defaults, bar those set below
    vars(train).update({key: value for key, value in config.options.items() if key not in own_options})
    vars(train).update(kind_options_of(args))
    train.init_from = args.model
    train.teacher = None if args.no_teacher else [args.model, *(args.teacher or [])]
    train.command_line = args.command_line
    return train


def kind_options_of(args: argparse.Namespace) -> dict[str, object]:
    """The linearized kind's options from this command's flags."""
    if args.kind == "linear":
        if args.window is not None:
            raise LinearizeError("--window sizes a hybrid's softmax window: add --kind hybrid")
        return {"linear_feature_map": args.feature_map, "linear_features": args.features}
    window = kind_options()["hybrid_window"].train_default if args.window is None else args.window
    if not isinstance(window, int) or window < 1:
        raise LinearizeError(f"--window must be at least 1 position, got {window}")
    return {"hybrid_feature_map": args.feature_map, "hybrid_features": args.features, "hybrid_window": window}


def run(args: argparse.Namespace) -> int:
    try:
        train = train_arguments(args)
        if args.transfer_steps:
            train.init_from = str(first_stage(args, train))
    except (LinearizeError, TrainError, DataError) as exc:
        print(f"rnnserve linearize: error: {exc}", file=sys.stderr)
        return 2
    return run_training(train)


def first_stage_path(train: argparse.Namespace) -> Path:
    ckpt = checkpoint_path(train)
    return ckpt.with_name(ckpt.stem + ".transfer.safetensors")


def first_stage(args: argparse.Namespace, train: argparse.Namespace) -> Path:
    """The linear model with its feature maps taught FILE's attention weights (made once; a resume reuses it)."""
    path = first_stage_path(train)
    if path.is_file():
        print(f"first stage: {path} exists, fine-tuning from it", file=sys.stderr)
        return path
    if args.feature_map == "elu" and args.kind == "linear":
        raise LinearizeError("--transfer-steps teaches a learned feature map; elu has none (use hedgehog or t2r)")
    if args.transfer_loss == "weight-ce" and args.kind != "linear":
        raise LinearizeError(
            "--transfer-loss weight-ce compares pure linear attention weights with softmax's; "
            f"a {args.kind} model learns from the layers' outputs (--transfer-loss output-mse)"
        )
    torch.set_num_threads(train.threads)
    inherited = inherited_from(train)
    student = build_model(build_config(train, inherited))
    init_from(args.model, student)
    teacher, _ = load_model(args.model)
    teacher.requires_grad_(False)
    data, _ = load_training_data(train, vocabulary_for(student.config, inherited.tokenizer))
    generator = torch.Generator().manual_seed(train.seed)
    batches = Batches(data, student.config.max_len, train.batch_size or 16, generator, 0)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    autocast = autocast_context(student.device, train.autocast)
    result = transfer(
        student,
        teacher,
        batches.next,
        args.transfer_steps,
        args.transfer_lr,
        generator,
        log,
        args.transfer_loss,
        autocast,
    )
    info = {
        "command": train.command_line,
        "attention_transfer": {
            "steps": result.steps,
            "loss": args.transfer_loss,
            "first_loss": result.first_loss,
            "last_loss": result.last_loss,
            "autocast_bf16": uses_autocast(student.device, train.autocast),
        },
        "examples_seen": result.steps * batches.batch_size,
        "wall_time_s": round(result.seconds, 1),
        "lineage": inherited_lineage(args.model),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # The final model is fine-tuned from this file and keeps its chat template (train.py's Inherited): pass FILE's on.
    save_model(student, path, info, tokenizer=inherited.tokenizer, chat_template=inherited.chat_template)
    log(f"first stage: {path} ({args.transfer_loss} {result.first_loss:.4f} -> {result.last_loss:.4f})")
    return path
