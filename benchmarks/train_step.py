"""Time training steps of each attention kind side by side, as `rnnserve train` runs them.

    python -m benchmarks.train_step --data ../shared/data/mnist --threads 1 --repeats 5

Each kind gets the model `rnnserve train --task mnist --preset P` builds (length 784),
AdamW and one `optimizer_step` (forward, backward, clip, update) under the same
autocast as training. The kinds take turns within every repeat (softmax, reformer,
softmax, reformer, ...), so a slow spell of the shared machine hits them all; the
table gives the median and best step time and each kind's median over softmax's.
Without --data the batches are random bytes (bucket occupancy then differs from
real digits'); --weights DIR starts each kind from DIR/mnist-KIND.safetensors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model import build_model
from model.attention.kinds import attention_kinds
from model.transformer import Transformer
from model.io.weights import load_model
from training import train
from training.arguments import add_train_arguments
from training.data import MNIST_PIXELS, load_mnist


@dataclass
class Contender:
    kind: str
    model: Transformer
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)  # wall-clock s per step
    cpu_times: list[float] = field(default_factory=list)  # process CPU s per step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(attention_kinds()), help="comma-separated attention kinds")
    parser.add_argument("--preset", default="cpu", choices=sorted(train.PRESETS))
    parser.add_argument("--batch-size", type=int, help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per kind (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto", help="as `rnnserve train`")
    parser.add_argument("--data", help="MNIST folder for real digits (default: random bytes)")
    parser.add_argument("--weights", help="folder of mnist-KIND.safetensors to start from (default: fresh models)")
    args = parser.parse_args(argv)
    unknown = [k for k in args.kinds.split(",") if k not in attention_kinds()]
    if unknown:
        parser.error(f"unknown kind(s) {','.join(unknown)}; expected some of {','.join(attention_kinds())}")
    return args


def build_contender(kind: str, args: argparse.Namespace) -> Contender:
    """The model and optimiser `rnnserve train` would build for this kind."""
    train_parser = argparse.ArgumentParser()
    add_train_arguments(train_parser)
    train_args = train_parser.parse_args(
        ["--task", "mnist", "--attention", kind, "--data", "-", "--out", "-", "--preset", args.preset]
    )
    torch.manual_seed(0)
    if args.weights:
        model, _ = load_model(Path(args.weights) / f"mnist-{kind}.safetensors")
    else:
        model = build_model(train.build_config(train_args))
    preset = train.PRESETS[args.preset]
    return Contender(kind, model.train(), train.make_optimizer(model, preset.lr, train_args.weight_decay))


def batches(args: argparse.Namespace, batch_size: int):
    gen = torch.Generator().manual_seed(0)
    images = load_mnist(args.data, "train").images if args.data else None
    while True:
        if images is None:
            yield torch.randint(0, 256, (batch_size, MNIST_PIXELS), generator=gen)
        else:
            yield images[torch.randint(images.shape[0], (batch_size,), generator=gen)].long()


def time_step(contender: Contender, tokens: torch.Tensor, autocast) -> tuple[float, float]:
    """(wall-clock s, process CPU s) of one optimiser step."""
    wall, cpu = time.perf_counter(), time.process_time()
    train.optimizer_step(contender.model, contender.opt, tokens, autocast)
    return time.perf_counter() - wall, time.process_time() - cpu


def print_table(contenders: list[Contender]) -> None:
    """Wall-clock and CPU time per step; ratios to softmax's medians (CPU time: the process's own
    seconds, less moved than wall-clock by other work on a shared machine)."""
    wall = {c.kind: statistics.median(c.times) for c in contenders}
    cpu = {c.kind: statistics.median(c.cpu_times) for c in contenders}

    def ratio(medians: dict[str, float], kind: str) -> str:
        return f"{medians[kind] / medians['softmax']:.2f}x" if "softmax" in medians else "-"

    print("| kind | median s/step | best s/step | / softmax | median CPU s/step | / softmax (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in contenders:
        print(
            f"| {c.kind} | {wall[c.kind]:.3f} | {min(c.times):.3f} | {ratio(wall, c.kind)} "
            f"| {cpu[c.kind]:.3f} | {ratio(cpu, c.kind)} |"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    autocast = train.autocast_context(device, args.autocast)
    batch_size = args.batch_size or train.PRESETS[args.preset].batch_size
    contenders = [build_contender(kind, args) for kind in args.kinds.split(",")]
    data = batches(args, batch_size)
    print(
        f"preset {args.preset}, batch {batch_size}, length {MNIST_PIXELS}, {args.threads} thread(s), "
        f"bf16 autocast {train.uses_autocast(device, args.autocast)}, data {args.data or 'random bytes'}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        tokens = next(data)  # (B, 784), the same batch for every kind
        for contender in contenders:
            wall, cpu = time_step(contender, tokens, autocast)
            if repeat:
                contender.times.append(wall)
                contender.cpu_times.append(cpu)
    print_table(contenders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
