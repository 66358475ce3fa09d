"""Checkpoint file sizes of the cpu-preset models in each --checkpoint-precision, with and without an average.

Each model is built (not trained), given one AdamW step on random gradients so that both
moments exist, and saved through the same CheckpointWriter `rnnserve train` uses; "with an average"
adds a moving average of the weights as --ema-decay keeps one (here the weights themselves).
Run: `.venv/bin/python -m benchmarks.checkpoint_sizes` (prints a Markdown table).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from model import build_model
from model.attention.kinds import attention_kinds
from training import train
from training.arguments import add_train_arguments
from training.checkpoint import CheckpointWriter
from training.run_state import Progress, RunSettings

TASKS = {"mnist": ["--task", "mnist"], "shakespeare": ["--task", "text", "--context", "256"]}
KINDS = attention_kinds()


def train_args(task: str, kind: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(
        [*TASKS[task], "--attention", kind, "--data", "-", "--out", f"{task}-{kind}.safetensors", "--preset", "cpu"]
    )


COLUMNS = {  # (precision, with an average) -> the table's heading
    ("bfloat16", False): "bfloat16 (default)",
    ("float32", False): "float32",
    ("bfloat16", True): "bfloat16, with an average",
    ("compact", True): "compact (with an average)",
}


def checkpoint_sizes(args: argparse.Namespace, folder: Path) -> tuple[int, dict[tuple[str, bool], int]]:
    """(parameters, (precision, with an average) -> file bytes)."""
    torch.manual_seed(0)
    model = build_model(train.build_config(args))
    opt = train.make_optimizer(model, 1e-3, args.weight_decay)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    run = RunSettings(1000, None, 16, 1e-3, args.warmup_steps, args.weight_decay, 10_000)
    average = {name: param.detach().clone() for name, param in model.named_parameters()}
    sizes = {}
    for precision, averaged in COLUMNS:
        writer = CheckpointWriter(folder / f"{precision}.ckpt", precision, run)
        writer.save(model, opt, Progress(step=1), torch.Generator(), average if averaged else None)
        sizes[precision, averaged] = writer.path.stat().st_size
    return model.num_parameters(), sizes


def main() -> None:
    torch.set_num_threads(1)
    print("| model | parameters | " + " | ".join(COLUMNS.values()) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    with tempfile.TemporaryDirectory() as folder:
        for task in TASKS:
            for kind in KINDS:
                params, sizes = checkpoint_sizes(train_args(task, kind), Path(folder))
                print(
                    f"| {task}-{kind} | {params:,} | "
                    + " | ".join(f"{sizes[column] / 1e6:.2f} MB" for column in COLUMNS)
                    + " |"
                )


if __name__ == "__main__":
    main()
