"""What a training checkpoint holds, as read from its file or about to be written: progress, the run's settings a
resume must match, the generators' states, and the checkpoint itself before it is applied to a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from model import ModelConfig
from model.config import ConfigError

from .errors import TrainError

CURVE_EVERY = 50  # steps between two points of the training curve
CURVE_COLUMNS = ("step", "examples", "elapsed_s", "train_loss_nats")


@dataclass
class Progress:
    """Everything that changes step to step, besides model and optimiser."""

    step: int = 0
    examples: int = 0
    elapsed_s: float = 0.0
    loss_ema: float = float("nan")
    # The training curve, kept across resumes: [step, examples, elapsed_s, loss_ema] every CURVE_EVERY steps.
    curve: list[list[float]] = field(default_factory=list)
    # The runs behind the --init-from file (training/lineage.py), fixed when the run starts: a resume keeps them even
    # if that file has since been replaced (continuing a run whose command names the file it ships to).
    lineage: list[dict[str, Any]] = field(default_factory=list)

    def record_curve(self) -> None:
        if self.step % CURVE_EVERY == 0:
            self.curve.append(self._point())

    def finished_curve(self) -> list[list[float]]:
        """The curve with the last step's point, for the model file (a run rarely ends on a multiple of 50)."""
        done = bool(self.curve) and self.curve[-1][0] == self.step
        return self.curve if done or self.step == 0 else [*self.curve, self._point()]

    def _point(self) -> list[float]:
        return [self.step, self.examples, round(self.elapsed_s, 1), round(self.loss_ema, 5)]


@dataclass(frozen=True)
class RunSettings:
    """The flags that fix the learning-rate schedule and the data order: a resume must match them."""

    # May change with --extend: the horizon, and the augmentation (to fine-tune a model against overfitting).
    # ema_decay too: the average is not part of the schedule (turned on later, it starts from the weights of then).
    EXTENDABLE: ClassVar[tuple[str, ...]] = ("steps", "minutes", "max_shift", "ema_decay")

    steps: int | None
    minutes: float | None
    batch_size: int
    lr: float
    warmup_steps: int
    weight_decay: float
    data_items: int  # training images, or bytes of training text
    max_shift: int = 0  # MNIST augmentation (pixels); checkpoints written before it had none
    ema_decay: float = 0.0  # of the weight average (0: none); checkpoints written before it had none
    teacher_digests: tuple[str, ...] = ()  # of each --teacher's config and tensors (older: its file); none: no teacher
    distill_weight: float = 0.0  # the teachers' share of the loss
    teacher_shares: tuple[float, ...] = ()  # each teacher's share of their mixture; none: equal shares
    lora_rank: int = 0  # of the attention projections' adapters (0: every weight trained)
    lora_alpha: float = 0.0  # their scale's numerator

    @classmethod
    def from_header(cls, saved: dict[str, Any]) -> RunSettings:
        """From a checkpoint's JSON header, where tuples came back as lists."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


@dataclass
class RngStates:
    data: torch.Tensor  # the batch sampler's generator, uint8
    torch: torch.Tensor  # torch's default CPU generator (dropout, Reformer rotations), uint8
    cuda: list[torch.Tensor] | None  # one per GPU; None without CUDA

    @classmethod
    def capture(cls, generator: torch.Generator) -> RngStates:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return cls(generator.get_state(), torch.get_rng_state(), cuda)

    def restore(self, generator: torch.Generator) -> None:
        generator.set_state(self.data)
        torch.set_rng_state(self.torch)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)

    def tensors(self) -> dict[str, torch.Tensor]:
        cuda = {f"rng.cuda.{i}": state for i, state in enumerate(self.cuda or [])}
        return {"rng.data": self.data, "rng.torch": self.torch} | cuda


@dataclass
class Checkpoint:
    """A checkpoint as read from its file, not yet applied to a model."""

    config: ModelConfig
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch's state_dict form: {"state": {index: {...}}, "param_groups": [...]}
    param_names: list[str] | None  # the parameter of each optimiser index; None in the older format
    progress: Progress
    rng: RngStates
    run: RunSettings | None  # None in the older format
    precision: str  # of the moments
    average: dict[str, torch.Tensor] | None = None  # the weight average (--ema-decay), if the run kept one


def parse_config(path: Path, text: str) -> ModelConfig:
    try:
        return ModelConfig.from_json(text)
    except (ConfigError, TypeError, ValueError) as exc:
        raise TrainError(f"{path}: bad model config in checkpoint: {exc}") from exc
