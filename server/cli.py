"""`rnnserve` console script: serve, train, eval, bench.

Each subcommand lives in its own module, imported only when chosen, so
`rnnserve --help` stays fast and no module does work at import time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "serve": ("server.serve", "serve the models in weights/ over HTTP"),
    "train": ("training.train", "train a model and save it as .safetensors"),
    "eval": ("training.evaluate", "evaluate a model: MNIST bits/dim or text loss"),
    "bench": ("benchmarks.run", "benchmark decoding in-process, or a running server with --url"),
    "pictures": ("training.pictures", "draw occluded digits and each model's completions to a PNG"),
    "train-classifier": ("training.classifier", "train the digit classifier that `eval --completions` reads with"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rnnserve", description=__doc__.splitlines()[0])
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module=module_name)
        if name in _chosen(sys.argv[1:]):
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def _chosen(argv: list[str]) -> set[str]:
    return {a for a in argv[:1] if a in SUBCOMMANDS}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
