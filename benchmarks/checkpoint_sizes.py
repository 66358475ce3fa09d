"""Checkpoint file sizes of the cpu-preset models, with 16- and 32-bit optimiser moments.

Each model is built (not trained), given one AdamW step on random gradients so that both
moments exist, and saved through the same CheckpointWriter `rnnserve train` uses.
Run: `.venv/bin/python -m benchmarks.checkpoint_sizes` (prints a Markdown table).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from model import build_model
from model.registry import attention_kinds
from training import train
from training.checkpoint import CheckpointWriter, Progress, RunSettings

TASKS = {"mnist": ["--task", "mnist"], "shakespeare": ["--task", "text", "--context", "256"]}
KINDS = attention_kinds()


def train_args(task: str, kind: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args([*TASKS[task], "--attention", kind, "--data", "-", "--out", f"{task}-{kind}.safetensors",
                              "--preset", "cpu"])


def checkpoint_sizes(args: argparse.Namespace, folder: Path) -> tuple[int, dict[str, int]]:
    """(parameters, precision -> file bytes)."""
    torch.manual_seed(0)
    model = build_model(train.build_config(args))
    opt = train.make_optimizer(model, 1e-3, args.weight_decay)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    run = RunSettings(1000, None, 16, 1e-3, args.warmup_steps, args.weight_decay, 10_000)
    sizes = {}
    for precision in ("bfloat16", "float32"):
        writer = CheckpointWriter(folder / f"{precision}.ckpt", precision, run)
        writer.save(model, opt, Progress(step=1), torch.Generator())
        sizes[precision] = writer.path.stat().st_size
    return model.num_parameters(), sizes


def main() -> None:
    torch.set_num_threads(1)
    print("| model | parameters | bfloat16 moments (default) | float32 moments |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for task in TASKS:
            for kind in KINDS:
                params, sizes = checkpoint_sizes(train_args(task, kind), Path(folder))
                print(f"| {task}-{kind} | {params:,} | {sizes['bfloat16'] / 1e6:.2f} MB | "
                      f"{sizes['float32'] / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
