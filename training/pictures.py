"""`rnnserve pictures`: occluded MNIST test digits and each model's completions, as one PNG.

Rows are digits. Columns: the original, the occluded input (bottom half hidden),
then one completion per model, sampled from the model given the top rows as
its prompt. Each column is labelled with the model's attention kind.
The flags are defined in training/arguments.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.io.weights import WeightsError, load_model

from .data import MNIST_PIXELS, MNIST_SIDE, DataError, load_mnist
from .evaluate import resolve_device

HIDDEN_RGB = (40, 60, 120)  # colour of occluded pixels, so they can't pass for black ink
LABEL_HEIGHT = 16
GAP = 4


def pick_digits(images: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """(N, 784) -> (count, 784), a seeded random choice of test images."""
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    return images[order[:count]]


def complete(
    path: str, prompts: torch.Tensor, device: torch.device, seed: int, temperature: float
) -> tuple[torch.Tensor, str]:
    """Sample the rest of each (B, P) prompt to 784 pixels with one model; returns (B, 784) and its label."""
    model, _ = load_model(path, device=device)
    if model.config.task != "mnist":
        raise WeightsError(
            path,
            f"this is a {model.config.task} model; `rnnserve pictures` draws digits, so "
            "--models takes MNIST models (trained with --task mnist)",
        )
    params = [SamplingParams(temperature=temperature, seed=seed + row) for row in range(prompts.shape[0])]
    tokens = generate(model, prompts.to(device), MNIST_PIXELS, BatchSampling.from_params(params, device))
    return tokens.cpu(), model.config.attention


def to_rgb(pixels: torch.Tensor, scale: int, hidden_from: int | None = None) -> Image.Image:
    """One (784,) digit as an RGB image; pixels from `hidden_from` on are drawn as occluded."""
    grey = pixels.to(torch.uint8).view(MNIST_SIDE, MNIST_SIDE).numpy()
    image = Image.fromarray(grey).convert("RGB")
    if hidden_from is not None:
        ImageDraw.Draw(image).rectangle((0, hidden_from // MNIST_SIDE, MNIST_SIDE, MNIST_SIDE), fill=HIDDEN_RGB)
    return image.resize((MNIST_SIDE * scale, MNIST_SIDE * scale), Image.NEAREST)


def compose(columns: list[tuple[str, list[Image.Image]]]) -> Image.Image:
    """Columns of equal-size tiles, each under its label, on a white sheet."""
    tile = columns[0][1][0].size[0]
    rows = len(columns[0][1])
    sheet = Image.new("RGB", (len(columns) * (tile + GAP) + GAP, LABEL_HEIGHT + rows * (tile + GAP) + GAP), "white")
    draw = ImageDraw.Draw(sheet)
    for c, (label, tiles) in enumerate(columns):
        x = GAP + c * (tile + GAP)
        draw.text((x, 2), label, fill="black")
        for r, image in enumerate(tiles):
            sheet.paste(image, (x, LABEL_HEIGHT + r * (tile + GAP)))
    return sheet


def draw_completions(args: argparse.Namespace) -> Image.Image:
    device = resolve_device(args.device)
    digits = pick_digits(load_mnist(args.data, "test").images, args.digits, args.seed)  # (N, 784)
    keep = args.keep_rows * MNIST_SIDE
    prompts = digits[:, :keep].long()  # (N, keep): the visible top rows
    columns = [
        ("original", [to_rgb(d, args.scale) for d in digits]),
        ("occluded", [to_rgb(d, args.scale, hidden_from=keep) for d in digits]),
    ]
    for path in args.models:
        completed, label = complete(path, prompts, device, args.seed, args.temperature)
        columns.append((label, [to_rgb(d, args.scale) for d in completed]))
    return compose(columns)


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.keep_rows < MNIST_SIDE:
        raise DataError(f"--keep-rows must be in 0..{MNIST_SIDE - 1}, got {args.keep_rows}")
    if args.digits < 1 or args.scale < 1:
        raise DataError(f"--digits and --scale must be >= 1, got {args.digits} and {args.scale}")
    if args.temperature < 0:
        raise DataError(f"--temperature must be >= 0, got {args.temperature}")
    if not Path(args.out).parent.is_dir():
        raise DataError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        draw_completions(args).save(args.out)
    except (DataError, WeightsError) as exc:
        print(f"rnnserve pictures: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
