"""`rnnserve`: serve, train, eval, bench and draw pictures from one command.

`main(argv)` parses the arguments it is given and never reads or writes
sys.argv. Each subcommand takes its flags from a module that does not import
torch, and the module that runs it is imported only when it runs, so
`rnnserve SUBCOMMAND --help` answers quickly.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: str  # "module:function(parser)"; the module imports no torch
    run: str  # "module:function(args) -> exit code"; imported only to run


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("serve the models in weights/ over HTTP", "server.serve:add_arguments", "server.serve:run"),
    "build-kernels": Subcommand(
        "build the CPU decode kernels and compile the models' decode steps ahead of serving",
        "server.prebuild:add_arguments",
        "server.prebuild:run",
    ),
    "ray-status": Subcommand(
        "what a running `rnnserve serve --ray` serves: applications, deployments, replicas",
        "server.rayserve.status:add_arguments",
        "server.rayserve.status:run",
    ),
    "train": Subcommand(
        "train a model and save it as .safetensors", "training.arguments:add_train_arguments", "training.train:run"
    ),
    "import": Subcommand(
        "import a model trained elsewhere (a Hugging Face GPT-2, Llama, Qwen2 or Mistral folder) as an rnnserve file",
        "model.io.hf_import:add_arguments",
        "model.io.hf_import:run",
    ),
    "linearize": Subcommand(
        "turn a softmax model into a linear-attention RNN and fine-tune it",
        "training.arguments:add_linearize_arguments",
        "training.linearize:run",
    ),
    "eval": Subcommand(
        "evaluate a model: MNIST bits/dim or text loss",
        "training.arguments:add_eval_arguments",
        "rnnserve_cli:run_eval",
    ),
    "bench": Subcommand(
        "benchmark decoding in-process, or a running server with --url",
        "benchmarks.run:add_arguments",
        "benchmarks.run:run",
    ),
    "pictures": Subcommand(
        "draw occluded digits and each model's completions to a PNG",
        "training.arguments:add_pictures_arguments",
        "training.pictures:run",
    ),
    "curves": Subcommand(
        "draw the training curves stored in model files and checkpoints to a PNG",
        "training.arguments:add_curves_arguments",
        "training.curves:run",
    ),
    "train-classifier": Subcommand(
        "train the digit classifier that `eval --completions` reads with",
        "training.arguments:add_classifier_arguments",
        "training.classifier:run",
    ),
}


def _load(reference: str) -> Callable:
    module_name, _, name = reference.partition(":")
    return getattr(importlib.import_module(module_name), name)


def run_eval(args: argparse.Namespace) -> int:
    """`rnnserve eval`, handed what it borrows from the server (training/completions.py's EvalParts): the
    engine's particle sampler and the API's reading of a mask PNG. Here, so that training/ imports no server/."""
    from server.api.imaging import read_mask_png
    from server.engine.offline import complete_with_particles
    from training.completions import EvalParts
    from training.evaluate import run

    return run(args, EvalParts(complete_with_particles, read_mask_png))


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`. Only the chosen subcommand's flags are added (the others'
    modules stay unimported); every parse records the command line as `command_line`."""
    parser = argparse.ArgumentParser(
        prog="rnnserve", description="Serve, train, evaluate and benchmark rnnserve models."
    )
    parser.set_defaults(command_line=shlex.join(["rnnserve", *argv]))
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=command.help, description=command.help)
        if argv[:1] == [name]:
            _load(command.add_arguments)(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


def main(argv: list[str]) -> int:
    """Run `rnnserve ARGV...`; returns the exit code."""
    args = parse_args(argv)
    return int(_load(SUBCOMMANDS[args.command].run)(args) or 0)


def console_main() -> int:
    """The `rnnserve` console script: the one place the process's arguments are read."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(console_main())
