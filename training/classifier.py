"""`rnnserve train-classifier`: a small CNN that reads 28x28 digits, the judge of `eval --completions`.

It is trained on the MNIST training digits (with random shifts of up to
--max-shift pixels), then scored once on the official test set; that
accuracy is stored in the file's metadata, so every report that uses the
classifier can say how far to trust it. The file lives in
weights/classifier/, below the folder `rnnserve serve` reads (which takes
only weights/*.safetensors), and carries no `rnnserve.config` entry, so it
can never pass for a generative model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from model.io.weights import INFO_KEY, WeightsError

from . import arguments
from .data import MNIST_SIDE, DataError, LabeledMnist, load_labeled_mnist, random_shift

CLASSIFIER_KEY = "rnnserve.classifier"
DEFAULT_CLASSIFIER = Path(arguments.DEFAULT_CLASSIFIER)
DIGITS = 10
TRAIN_COMMAND = "rnnserve train-classifier --data ../shared/data/mnist --out " + str(DEFAULT_CLASSIFIER)


@dataclass(frozen=True)
class ClassifierConfig:
    channels: tuple[int, ...] = (16, 32, 32)  # one 3x3 conv + 2x2 max-pool per entry: 28 -> 14 -> 7 -> 3
    hidden: int = 64

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ClassifierConfig":
        fields = json.loads(text)
        return cls(channels=tuple(int(c) for c in fields["channels"]), hidden=int(fields["hidden"]))


class DigitClassifier(nn.Module):
    """Grey levels (B, 784) -> digit logits (B, 10)."""

    def __init__(self, cfg: ClassifierConfig):
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        for c_in, c_out in zip((1, *cfg.channels), cfg.channels):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        side = MNIST_SIDE >> len(cfg.channels)  # each pool halves, rounding down
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(cfg.channels[-1] * side * side, cfg.hidden),
            nn.ReLU(),
            nn.Linear(cfg.hidden, DIGITS),
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.float().view(-1, 1, MNIST_SIDE, MNIST_SIDE) / 255.0  # (B, 1, 28, 28)
        return self.head(self.features(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.inference_mode()
def classify(classifier: DigitClassifier, images: torch.Tensor, batch_size: int = 500) -> torch.Tensor:
    """(N, 784) grey levels -> (N,) predicted digits."""
    out = [classifier(images[i : i + batch_size]).argmax(dim=-1) for i in range(0, images.shape[0], batch_size)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def accuracy(classifier: DigitClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of `images` read as their `labels` (an exact fraction of the count)."""
    return int((classify(classifier, images) == labels.long()).sum()) / max(labels.numel(), 1)


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 30
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    max_shift: int = 2
    seed: int = 0


def train_classifier(
    train: LabeledMnist, settings: TrainSettings, cfg: ClassifierConfig = ClassifierConfig()
) -> DigitClassifier:
    """AdamW with a cosine learning rate over `epochs` passes of shifted, shuffled digits."""
    torch.manual_seed(settings.seed)
    classifier = DigitClassifier(cfg)
    opt = torch.optim.AdamW(classifier.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    n = train.images.shape[0]
    steps_per_epoch = math.ceil(n / settings.batch_size)
    total = settings.epochs * steps_per_epoch
    classifier.train()
    for step in range(total):
        if step % steps_per_epoch == 0:
            order = torch.randperm(n, generator=gen)
        rows = order[(step % steps_per_epoch) * settings.batch_size :][: settings.batch_size]
        for group in opt.param_groups:
            group["lr"] = settings.lr * 0.5 * (1 + math.cos(math.pi * step / total))
        images = random_shift(train.images[rows], settings.max_shift, gen)
        loss = F.cross_entropy(classifier(images), train.labels[rows].long())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return classifier.eval()


def save_classifier(classifier: DigitClassifier, path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Tensors and config in one safetensors file, written under a temporary name first."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in classifier.state_dict().items()}
    metadata = {CLASSIFIER_KEY: classifier.config.to_json(), INFO_KEY: json.dumps(info, sort_keys=True)}
    tmp = Path(f"{path}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_classifier(path: str | os.PathLike) -> tuple[DigitClassifier, dict[str, Any]]:
    """A classifier file -> (eval-mode classifier, info); WeightsError says what is wrong."""
    if not Path(path).is_file():
        raise WeightsError(
            path,
            f"no digit classifier here; train one with `{TRAIN_COMMAND}` "
            "(from the repository root), or pass --classifier PATH",
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(
            path,
            f"not a valid safetensors file ({exc}); expected a digit classifier written by `rnnserve train-classifier`",
        ) from exc
    if CLASSIFIER_KEY not in metadata:
        raise WeightsError(
            path,
            f"metadata has no '{CLASSIFIER_KEY}' entry: this is not a digit classifier "
            "(a generative model file?); expected one written by `rnnserve train-classifier`",
        )
    classifier = DigitClassifier(ClassifierConfig.from_json(metadata[CLASSIFIER_KEY]))
    try:
        classifier.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise WeightsError(path, f"tensors do not match its classifier config: {exc}") from exc
    return classifier.eval(), json.loads(metadata.get(INFO_KEY, "{}"))


# ---------------------------------------------------------------- command line


def check_args(args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DataError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= args.max_shift <= 4:
        raise DataError(f"--max-shift must be in 0..4 pixels, got {args.max_shift}")
    if not Path(args.out).parent.is_dir():
        raise DataError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        train, test = load_labeled_mnist(args.data, "train"), load_labeled_mnist(args.data, "test")
        settings = TrainSettings(args.epochs, args.batch_size, args.lr, max_shift=args.max_shift, seed=args.seed)
        start = time.perf_counter()
        classifier = train_classifier(train, settings)
        seconds = time.perf_counter() - start
        info = classifier_info(classifier, train, test, settings, seconds, getattr(args, "command_line", None))
        save_classifier(classifier, args.out, info)
    except (DataError, WeightsError) as exc:
        print(f"rnnserve train-classifier: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {info['parameters']:,} parameters, trained in {seconds:.0f} s on "
        f"{info['train_images']:,} digits; test accuracy {info['test_accuracy']:.4f} "
        f"on {info['test_images']:,} test digits"
    )
    return 0


def classifier_info(
    classifier: DigitClassifier,
    train: LabeledMnist,
    test: LabeledMnist,
    settings: TrainSettings,
    seconds: float,
    command: str | None,
) -> dict[str, Any]:
    """What the file records about itself: its test accuracy and how it was made."""
    return {
        "kind": "digit classifier",
        "test_accuracy": accuracy(classifier, test.images, test.labels),
        "test_images": int(test.images.shape[0]),
        "test_data": test.path,
        "train_accuracy": accuracy(classifier, train.images, train.labels),
        "train_images": int(train.images.shape[0]),
        "train_data": train.path,
        "parameters": classifier.num_parameters(),
        "training": asdict(settings),
        "seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "command": command,
    }
