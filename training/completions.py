"""`rnnserve eval --completions`: how well a model completes occluded test digits.

For each of N test digits, the pixels an occlusion marks unknown are sampled
by the model, in raster order, as the server does: the pixels before the first
unknown one are the prompt, and known pixels after it are forced, not
sampled. The project's digit classifier then reads every completion, and the
report gives the share read as the true digit beside the same share for the
occluded input alone (unknown pixels set to 0) and for the original digits.

It also gives bits/dim over the unknown pixels alone: the mean -log2 p of
each true unknown pixel given the true pixels before it in raster order, read
exactly off one parallel pass. For an occlusion whose known pixels all come
first (bottom half) that is -log2 p(unknown | known) per unknown pixel; for
others the model, like its sampler, cannot see the known pixels after it.

Sampling noise is a pure function of (seed, digit index, position), so a run
is reproducible and its result does not depend on --batch-size.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from model import Transformer
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.io.weights import WeightsError, read_metadata, update_info

from . import arguments
from .classifier import DigitClassifier, accuracy, load_classifier
from .data import MNIST_PIXELS, MNIST_SIDE, DataError, load_labeled_mnist
from .loading import load_evaluated

OCCLUSIONS = arguments.OCCLUSIONS
CENTRE_BOX = slice(7, 21)  # the central 14 x 14 pixels
SEED_STRIDE = 1_000_000  # row seed = seed * stride + digit index: runs with different seeds never share noise
DEFAULT_BATCH = 200
# (model, forced (N, 784), first unknown, seeds, temperature, particles, rows) -> .images (N, 784), .mean_resamplings
ParticleSampler = Callable[..., Any]
MaskReader = Callable[[bytes], Any]  # PNG bytes -> (28, 28) bool, True where unknown; ValueError if it is not one


@dataclass(frozen=True)
class EvalParts:
    """What `eval --completions` borrows from the server: its particle sampler (an in-process engine), and its
    reading of a mask PNG, so that an evaluation runs what a request runs. rnnserve_cli.py hands them in:
    training/ imports nothing from server/."""

    complete_with_particles: ParticleSampler | None = None
    read_mask: MaskReader | None = None


def occlusion_mask(name: str) -> torch.Tensor:
    """A named occlusion -> (784,) bool, True where the pixel is unknown."""
    unknown = torch.zeros(MNIST_SIDE, MNIST_SIDE, dtype=torch.bool)
    if name == "bottom-half":
        unknown[MNIST_SIDE // 2 :] = True
    elif name == "right-half":
        unknown[:, MNIST_SIDE // 2 :] = True
    elif name == "centre-box":
        unknown[CENTRE_BOX, CENTRE_BOX] = True
    else:
        raise DataError(f"unknown occlusion {name!r}; expected one of {', '.join(OCCLUSIONS)} or --mask FILE.png")
    return unknown.view(-1)


def mask_from_file(path: str | Path, read_mask: MaskReader | None) -> torch.Tensor:
    """A 28x28 mask PNG (white or transparent = unknown, read by `read_mask`: the server's reading) -> (784,) bool."""
    if read_mask is None:
        raise DataError("--mask needs the server's reading of a mask PNG: run it as `rnnserve eval`")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--mask {path}: no such file; expected a 28x28 PNG, white where pixels are unknown")
    try:
        unknown = read_mask(path.read_bytes())
    except ValueError as exc:
        raise DataError(f"--mask {path}: {exc}") from None
    if not unknown.any():
        raise DataError(
            f"--mask {path}: no pixel is white (>= 128) or transparent, so nothing is unknown; "
            "expected a 28x28 PNG, white where pixels are unknown"
        )
    return torch.from_numpy(unknown.reshape(-1).copy())


@dataclass(frozen=True)
class Occlusion:
    name: str  # "bottom-half", ... or "mask NAME.png"
    unknown: torch.Tensor  # (784,) bool

    @property
    def first_unknown(self) -> int:
        return int(self.unknown.nonzero()[0])

    def hide(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 784) -> the occluded input alone: unknown pixels set to 0."""
        return images.masked_fill(self.unknown, 0)

    def forced(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 784) -> (N, 784) long: known grey levels to keep, -1 where the model samples."""
        return images.long().masked_fill(self.unknown, -1)


def choose_occlusion(name: str | None, mask_path: str | None, read_mask: MaskReader | None = None) -> Occlusion:
    if mask_path is not None:
        return Occlusion(f"mask {Path(mask_path).name}", mask_from_file(mask_path, read_mask))
    name = name or "bottom-half"
    return Occlusion(name, occlusion_mask(name))


def complete_batch(
    model: Transformer, images: torch.Tensor, occlusion: Occlusion, seeds: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(B, 784) digits -> (B, 784) uint8 with the unknown pixels sampled; seeds (B,) one per digit."""
    device = model.device
    params = [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds]
    forced = occlusion.forced(images).to(device)  # (B, 784)
    prompt = forced[:, : occlusion.first_unknown]  # (B, P): all known
    tokens = generate(model, prompt, MNIST_PIXELS, BatchSampling.from_params(params, device), forced=forced)
    return tokens.cpu().to(torch.uint8)


def complete_digits(
    model: Transformer,
    images: torch.Tensor,
    occlusion: Occlusion,
    seed: int = 0,
    temperature: float = 1.0,
    batch_size: int = DEFAULT_BATCH,
    show_progress: bool = False,
) -> torch.Tensor:
    """(N, 784) digits -> (N, 784) completions; digit i draws its noise from seed * SEED_STRIDE + i."""
    out = []
    starts = range(0, images.shape[0], batch_size)
    for start in tqdm(starts, desc="completions", disable=not show_progress, mininterval=2.0):
        batch = images[start : start + batch_size]
        seeds = seed * SEED_STRIDE + torch.arange(start, start + batch.shape[0])
        out.append(complete_batch(model, batch, occlusion, seeds, temperature))
    return torch.cat(out)


@torch.inference_mode()
def unknown_bits_per_dim(
    model: Transformer, images: torch.Tensor, unknown: torch.Tensor, batch_size: int = 32
) -> float:
    """Mean -log2 p(true pixel | true pixels before it) over the unknown pixels of every image."""
    total = 0.0
    for start in range(0, images.shape[0], batch_size):
        tokens = images[start : start + batch_size].long().to(model.device)  # (B, 784)
        total -= float(model.token_log_probs(tokens)[:, unknown.to(model.device)].double().sum())
    return total / (images.shape[0] * int(unknown.sum()) * math.log(2))


@dataclass(frozen=True)
class CompletionRun:
    """What one evaluation is asked to do."""

    data: str
    classifier: str
    occlusion: Occlusion
    limit: int | None = None
    seed: int = 0
    temperature: float = 1.0
    batch_size: int = DEFAULT_BATCH
    show_progress: bool = False
    particles: int | None = None  # None: the plain sampler; K: the server's particle sampler, K per digit
    complete_with_particles: ParticleSampler | None = None  # that sampler (EvalParts)


@dataclass(frozen=True)
class CompletionResult:
    occlusion: str
    unknown_pixels: int  # per digit
    digits: int
    read_as_true_completed: float  # share of completions the classifier reads as the true digit
    read_as_true_occluded: float  # the same for the occluded input alone (unknown pixels 0)
    read_as_true_original: float  # the same for the original digits
    bits_per_dim_unknown: float
    images_per_s: float  # completions sampled per second (sampling alone)
    seconds: float  # the whole evaluation
    seed: int
    temperature: float
    batch_size: int
    device: str
    data: str
    classifier: str
    classifier_test_accuracy: float | None
    particles: int | None = None  # per digit, with the particle sampler
    mean_resamplings: float | None = None  # per digit, with the particle sampler

    def as_dict(self) -> dict[str, Any]:
        return {"metric": "completions", **asdict(self)}

    @property
    def key(self) -> str:
        """Where it is stored: the occlusion, and the particles when the particle sampler ran."""
        return self.occlusion if self.particles is None else f"{self.occlusion}, particles={self.particles}"


def evaluate_completions(path: str | Path, run: CompletionRun, device: torch.device) -> CompletionResult:
    """Complete, score and classify `run.limit` test digits with the model in `path`."""
    start = time.perf_counter()
    classifier, classifier_info = load_classifier(run.classifier)
    model = load_completion_model(path, device)
    test = load_labeled_mnist(run.data, "test")
    images, labels = test.images[: run.limit], test.labels[: run.limit]
    sampling_start = time.perf_counter()
    resamplings = None
    if run.particles is None:
        completed = complete_digits(
            model, images, run.occlusion, run.seed, run.temperature, run.batch_size, run.show_progress
        )
    else:
        if run.complete_with_particles is None:
            raise DataError("--particles needs the server's particle sampler: run it as `rnnserve eval`")
        seeds = [run.seed * SEED_STRIDE + i for i in range(len(images))]
        done = run.complete_with_particles(
            model,
            run.occlusion.forced(images),
            run.occlusion.first_unknown,
            seeds,
            run.temperature,
            run.particles,
            run.batch_size,
        )
        completed, resamplings = done.images, round(done.mean_resamplings, 2)
    sampling_s = time.perf_counter() - sampling_start
    reads = shares_read_as_true(classifier, labels, completed, run.occlusion.hide(images), images)
    return CompletionResult(
        run.occlusion.name,
        int(run.occlusion.unknown.sum()),
        int(images.shape[0]),
        *reads,
        bits_per_dim_unknown=unknown_bits_per_dim(model, images, run.occlusion.unknown),
        images_per_s=round(images.shape[0] / sampling_s, 3),
        seconds=round(time.perf_counter() - start, 1),
        seed=run.seed,
        temperature=run.temperature,
        batch_size=run.batch_size,
        device=describe(device),
        data=test.path + (f" (first {len(images)} images)" if len(images) < len(test.images) else ""),
        classifier=str(run.classifier),
        classifier_test_accuracy=classifier_info.get("test_accuracy"),
        particles=run.particles,
        mean_resamplings=resamplings,
    )


def load_completion_model(path: str | Path, device: torch.device) -> Transformer:
    model, _ = load_evaluated(path, device)
    if model.config.task != "mnist":
        raise WeightsError(
            path, f"this is a {model.config.task} model; --completions needs an MNIST model (trained with --task mnist)"
        )
    return model


def shares_read_as_true(
    classifier: DigitClassifier, labels: torch.Tensor, *image_sets: torch.Tensor
) -> tuple[float, ...]:
    """For each (N, 784) set, the share of images the classifier reads as their label."""
    return tuple(accuracy(classifier, images, labels) for images in image_sets)


def describe(device: torch.device) -> str:
    return f"cpu ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)


def store_result(path: str | Path, result: CompletionResult) -> None:
    """Into info["eval"]["completions"][occlusion], keeping every other stored result."""
    _, info = read_metadata(path)
    evaluation = dict(info.get("eval") or {})
    evaluation["completions"] = {**evaluation.get("completions", {}), result.key: result.as_dict()}
    update_info(path, {"eval": evaluation})


def print_table(rows: list[tuple[str, CompletionResult]], file=sys.stdout) -> None:
    first = rows[0][1]
    sampler = "plain sampler" if first.particles is None else f"{first.particles} particles per digit"
    print(
        f"{first.occlusion} ({first.unknown_pixels} unknown pixels), {sampler}, {first.digits} test digits, "
        f"temperature {first.temperature:g}, seed {first.seed}; classifier {first.classifier} "
        f"(test accuracy {first.classifier_test_accuracy})",
        file=file,
    )  # as stored: None if it has none
    width = max(len(name) for name, _ in rows)
    print(
        f"{'model':<{width}}  {'completed':>9}  {'occluded':>8}  {'original':>8}  {'bits/dim unknown':>16}  "
        f"{'images/s':>8}",
        file=file,
    )
    for name, r in rows:
        print(
            f"{name:<{width}}  {r.read_as_true_completed:>9.1%}  {r.read_as_true_occluded:>8.1%}  "
            f"{r.read_as_true_original:>8.1%}  {r.bits_per_dim_unknown:>16.4f}  {r.images_per_s:>8.2f}",
            file=file,
        )
