"""Flags of `rnnserve train`, `eval`, `pictures`, `curves` and `train-classifier`.

Kept apart from the code that runs them and free of torch, so that
`rnnserve train --help` answers without importing it.
"""

from __future__ import annotations

import argparse
import os

from model.attention.kinds import ATTENTION_KINDS, attention_kinds, kind_options

from .presets import PRESETS

SAVE_DTYPE_NAMES = ("bfloat16", "float16", "float32")  # torch dtypes of these names
OCCLUSIONS = ("bottom-half", "right-half", "centre-box")  # `eval --completions`: which pixels are unknown
DEFAULT_CLASSIFIER = "weights/classifier/digit-classifier.safetensors"
CHECKPOINT_PRECISIONS = ("bfloat16", "float32", "compact")  # training/checkpoint.py PRECISIONS
DEVICES = ("cpu", "cuda", "auto")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=("mnist", "text"), required=True)
    parser.add_argument("--attention", choices=attention_kinds(), required=True)
    parser.add_argument("--data", required=True, help="MNIST: folder (or train images file); text: a UTF-8 file")
    parser.add_argument("--eval-data", help="MNIST test images folder/file (default: the --data folder)")
    parser.add_argument("--out", required=True, help="output weights file, e.g. weights/mnist-linear.safetensors")
    _add_architecture_arguments(parser.add_argument_group("architecture (override the preset)"))
    _add_kind_options(parser)
    _add_optimisation_arguments(parser.add_argument_group("optimisation"))
    _add_run_arguments(parser.add_argument_group("run"))


def _add_architecture_arguments(arch) -> None:
    arch.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    arch.add_argument("--layers", type=int)
    arch.add_argument("--d-model", type=int)
    arch.add_argument("--heads", type=int)
    arch.add_argument("--d-ff", type=int)
    arch.add_argument("--context", type=int, default=256, help="text: window length in bytes (= max_len)")
    arch.add_argument("--dropout", type=float, default=0.0)
    arch.add_argument("--pos-encoding", choices=("learned", "sinusoidal"), default="learned")
    arch.add_argument(
        "--output-head",
        choices=("categorical", "logistic_mixture"),
        default="categorical",
        help="MNIST: 256 free logits, or a mixture of logistics over the grey levels (the paper's)",
    )
    arch.add_argument(
        "--mixtures", type=int, default=10, help="logistics per pixel with --output-head logistic_mixture"
    )


def _add_kind_options(parser: argparse.ArgumentParser) -> None:
    """Each attention kind's own hyperparameters, as it declares them (model/attention/kinds.py); a model of another
    kind stores them with their defaults and does not read them."""
    for kind, declared in ATTENTION_KINDS.items():
        if not declared.options:
            continue
        group = parser.add_argument_group(f"{kind} attention")
        for option in declared.options:
            group.add_argument(
                option.flag,
                type=option.type,
                choices=option.choices or None,
                default=option.train_default,
                help=f"{option.help} (default {option.train_default})",
            )


def _add_optimisation_arguments(opt) -> None:
    opt.add_argument("--minutes", type=float, help="wall-clock budget for training (eval not included)")
    opt.add_argument("--steps", type=int, help="number of optimiser steps")
    opt.add_argument("--batch-size", type=int)
    opt.add_argument("--lr", type=float, help="peak learning rate (AdamW)")
    opt.add_argument("--warmup-steps", type=int, default=100)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train low-rank adapters of the attention projections (q, k, v, output) of this rank, and a "
        "linearized model's feature maps, with every other weight frozen; merged into the weights when "
        "saved (default 0: train every weight)",
    )
    opt.add_argument("--lora-alpha", type=float, help="the adapters' scale is alpha / rank (default: 2 x rank)")
    opt.add_argument(
        "--ema-decay",
        type=float,
        default=0.0,
        help="keep a moving average of the weights (e.g. 0.999: about the last 1,000 steps) and save it "
        "as the model; the checkpoint keeps it for --resume (0: off); may change with --resume --extend",
    )
    opt.add_argument(
        "--teacher",
        action="append",
        metavar="FILE",
        help="distil: also learn each token's distribution from this trained model of the same task "
        "(repeat the flag for several: their average teaches); fixed for the run by a digest of "
        "its config and tensors",
    )
    opt.add_argument(
        "--teacher-shares",
        type=float,
        nargs="+",
        metavar="SHARE",
        help="with several --teacher: each one's share of the teachers' mixture, in the order of the "
        "--teacher flags (normalised to sum to 1; default: equal shares)",
    )
    opt.add_argument(
        "--distill-weight",
        type=float,
        help="with --teacher: the teachers' share of the loss, the data's is the rest "
        "(default 0.5; 1: the teachers alone)",
    )
    opt.add_argument(
        "--max-shift",
        type=int,
        default=0,
        help="MNIST augmentation: shift each training digit by up to this many pixels along each axis, "
        "filled with 0 (0: off); may change with --resume --extend",
    )


def _add_run_arguments(run) -> None:
    run.add_argument("--device", choices=DEVICES, default="auto")
    run.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for torch")
    run.add_argument("--save-dtype", choices=sorted(SAVE_DTYPE_NAMES), default="bfloat16")
    run.add_argument(
        "--autocast",
        choices=("auto", "bf16", "off"),
        default="auto",
        help="bfloat16 autocast; auto: on for CUDA and for CPUs with native bf16 (AVX512-BF16, AMX)",
    )
    run.add_argument(
        "--checkpoint",
        help="checkpoint path (default: checkpoints/NAME.ckpt in the folder of --out, "
        "NAME the stem of --out: weights/checkpoints/ is kept in git)",
    )
    run.add_argument(
        "--checkpoint-every",
        type=int,
        default=500,
        help="steps between checkpoints, also written on SIGTERM/SIGINT (0: never)",
    )
    run.add_argument(
        "--checkpoint-precision",
        choices=CHECKPOINT_PRECISIONS,
        default="bfloat16",
        help="AdamW moments and weight average in the checkpoint (weights stay float32); float32: resumes bit "
        "for bit; compact (with --ema-decay): bfloat16, and the weights as int8 steps from their "
        "average (about 7 bytes a parameter)",
    )
    run.add_argument("--resume", action="store_true", help="continue from the checkpoint if it exists")
    run.add_argument(
        "--init-from",
        metavar="FILE",
        help="start a new run from a trained .safetensors file's weights (fresh schedule and optimiser); "
        "Reformer hashing and dropout may differ from the file's, and --layers may add blocks on top "
        "(each starts as an identity). With --resume, a checkpoint "
        "that exists wins, so a stopped warm start resumes with the same command",
    )
    run.add_argument(
        "--extend",
        action="store_true",
        help="with --resume: accept a --steps/--minutes/--max-shift other than the checkpoint's run "
        "(the cosine schedule is recomputed over the new horizon)",
    )
    run.add_argument("--no-eval", action="store_true", help="skip the evaluation at the end")
    run.add_argument("--eval-limit", type=int, help="evaluate on the first N test images / windows only")
    run.add_argument("--eval-batch-size", type=int, default=32)
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs print a line per checkpoint)")


def add_linearize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="FILE", help="the softmax model (.safetensors) to turn into an RNN")
    parser.add_argument("--out", required=True, help="the RNN's file, e.g. weights/mnist-hybrid.safetensors")
    parser.add_argument(
        "--kind",
        choices=("linear", "hybrid"),
        default="linear",
        help="linear: linear attention over every past token; hybrid: exact softmax over a window of the last "
        "--window tokens and linear attention before it (both a constant-size state; default linear)",
    )
    parser.add_argument(
        "--window", type=int, help="--kind hybrid: positions of exact softmax attention (default: the kind's, 64)"
    )
    parser.add_argument(
        "--feature-map",
        choices=kind_options()["linear_feature_map"].choices,
        default="hedgehog",
        help="phi of the linear attention: hedgehog (learned, mimics softmax's weights; default), "
        "t2r (learned, relu(W x + b)) or elu (elu(x) + 1, no parameters)",
    )
    parser.add_argument(
        "--features", type=int, default=0, help="outputs per head of a learned map's projection (0: the head size)"
    )
    parser.add_argument("--data", required=True, help="what to fine-tune on: as `rnnserve train --data`")
    parser.add_argument("--eval-data", help="MNIST test images folder/file (default: the --data folder)")
    parser.add_argument(
        "--no-teacher",
        action="store_true",
        help="fine-tune on the data alone (default: FILE also teaches, as `--teacher FILE`)",
    )
    parser.add_argument(
        "--transfer-steps",
        type=int,
        default=0,
        help="first teach the feature maps (and a hybrid's mix) alone to stand in for FILE's attention for this "
        "many steps (attention transfer), then fine-tune (the whole model, or adapters with --lora-rank); "
        "default 0: no first stage",
    )
    parser.add_argument("--transfer-lr", type=float, default=1e-2, help="the first stage's learning rate")
    parser.add_argument(
        "--transfer-loss",
        choices=("output-mse", "weight-ce"),
        default="output-mse",
        help="what the first stage matches: each layer's attention output (output-mse, LoLCATs; default) or, "
        "for --kind linear, each query's attention weights (weight-ce, Hedgehog)",
    )
    _add_optimisation_arguments(parser.add_argument_group("fine-tuning (as `rnnserve train`)"))
    _add_run_arguments(parser.add_argument_group("run (as `rnnserve train`)"))


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models",
        nargs="+",
        help="one or more .safetensors files, or training checkpoints (.ckpt: the model its run would save now)",
    )
    parser.add_argument(
        "--data",
        required=True,
        help="MNIST: folder with t10k-images-idx3-ubyte[.gz] (or the file); text: the UTF-8 file",
    )
    parser.add_argument("--limit", type=int, help="only the first N test images / validation windows")
    parser.add_argument(
        "--batch-size", type=int, help="images or windows per batch (default 32; 200 with --completions)"
    )
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument(
        "--store",
        action="store_true",
        help="also write each result into its file's metadata (info['eval'], completions under "
        "info['eval']['completions'][OCCLUSION]), as `rnnserve train` does at its end; the "
        "tensors are written back unchanged",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--attention-share",
        action="store_true",
        help="hybrid models: the linear part's share of each layer and head's attention normaliser against the "
        "window's, over the test images / validation windows (--limit N of them; batches of 8 by default)",
    )
    add_completion_arguments(parser.add_argument_group("completions (rnnserve eval --completions)"))


def add_completion_arguments(group) -> None:
    group.add_argument(
        "--completions",
        action="store_true",
        help="complete occluded test digits instead: the share the digit classifier reads as the "
        "true digit (completions, occluded input, originals) and bits/dim over unknown pixels",
    )
    group.add_argument("--occlusion", choices=OCCLUSIONS, help="which pixels are unknown (default bottom-half)")
    group.add_argument("--mask", help="a 28x28 mask PNG instead, white (or transparent) where pixels are unknown")
    group.add_argument(
        "--classifier",
        default=DEFAULT_CLASSIFIER,
        help=f"digit classifier file (default {DEFAULT_CLASSIFIER}, from `rnnserve train-classifier`)",
    )
    group.add_argument("--seed", type=int, default=0, help="seeds the sampling; digit i uses its own noise")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument(
        "--particles",
        type=int,
        help="complete with the server's particle sampler (sequential Monte Carlo), K particles per "
        "digit, --batch-size decode slots (default: the plain sampler, known pixels forced)",
    )


def add_classifier_arguments(parser: argparse.ArgumentParser) -> None:
    """`rnnserve train-classifier`; the defaults are training.classifier.TrainSettings'."""
    parser.add_argument(
        "--data",
        required=True,
        help="folder with the MNIST train and test images and labels (IDX, e.g. ../shared/data/mnist)",
    )
    parser.add_argument("--out", default=DEFAULT_CLASSIFIER, help=f"output file (default {DEFAULT_CLASSIFIER})")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--max-shift",
        type=int,
        default=2,
        help="augmentation: shift each training digit by up to this many pixels (0: off)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")


def add_pictures_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", required=True, help="MNIST .safetensors files, one column each")
    parser.add_argument("--data", required=True, help="folder with the MNIST test images (or the file)")
    parser.add_argument("--out", required=True, help="output PNG path")
    parser.add_argument("--digits", type=int, default=6, help="how many test digits (rows)")
    parser.add_argument("--keep-rows", type=int, default=14, help="rows of each digit shown to the models")
    parser.add_argument("--seed", type=int, default=0, help="picks the digits and seeds the sampling")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--scale", type=int, default=3, help="pixels per MNIST pixel in the PNG")
    parser.add_argument("--device", choices=DEVICES, default="auto")


def add_curves_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="model .safetensors files or training checkpoints (.ckpt) of one task, one line each",
    )
    parser.add_argument("--out", required=True, help="output PNG path")
    parser.add_argument(
        "--target",
        type=float,
        action="append",
        help="draw this loss as a dashed line (bits/dim for MNIST, nats/byte for text); repeatable",
    )
    parser.add_argument("--title", help="the figure's title (default: the task)")
