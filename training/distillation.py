"""`rnnserve train --teacher FILE ...`: learn from trained models' predictions as well as the data.

The teacher is the average of the given models' next-token distributions (a
mixture: it scores better than any of its members when they err differently),
in equal shares or in the shares `--teacher-shares` gives (a mixture leaning on
its best member can score better than an equal one).
At every position of a training sequence the student is pulled towards the
teacher's whole 256-way distribution, not just the observed pixel:

    loss = (1 - w) * CE(data, student) + w * CE(teacher, student)      (nats/token)

With only 10,000 training digits a soft target carries more than the one
observed grey level (how likely its neighbours were), which is what a model
that has begun to fit its training digits lacks. The teachers run without
gradients under the student's autocast; each is fixed by a digest of its
config and tensors (not of its file, whose stored info `rnnserve eval --store`
rewrites), so a resume refuses a teacher that changed and takes one that only
gained results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from model import Transformer
from model.config import ModelConfig
from model.io.weights import CONFIG_KEY, WeightsError, load_model, read_metadata

from .run_state import RunSettings
from .errors import TrainError

DEFAULT_DISTILL_WEIGHT = 0.5


@dataclass(frozen=True)
class Distillation:
    """Frozen teacher models whose averaged distribution the student learns from, and that target's weight."""

    models: tuple[Transformer, ...]
    files: tuple[str, ...]
    digests: tuple[str, ...]  # weights_digest of each teacher: what a resume checks
    file_digests: tuple[str, ...]  # sha256 of each file as loaded: what the model file records beside them
    weight: float  # of the teacher's cross-entropy in the loss; the data's gets 1 - weight
    given_shares: tuple[float, ...] = ()  # --teacher-shares, normalised to sum to 1; none: equal shares

    @property
    def shares(self) -> tuple[float, ...]:
        """Each teacher's share of the mixture."""
        return self.given_shares or (1.0 / len(self.models),) * len(self.models)

    @torch.no_grad()
    def probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T, V) float32: the mixture's distribution of each token given those before it."""
        log_probs = torch.stack(
            [
                model.next_token_log_probs(tokens).float() + math.log(share)
                for model, share in zip(self.models, self.shares)
            ]
        )  # (M, B, T, V)
        return torch.logsumexp(log_probs, dim=0).exp()

    def loss(self, model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, data cross-entropy), both nats/token, for a (B, T) batch."""
        target = self.probs(tokens)  # (B, T, V)
        log_probs = model.next_token_log_probs(tokens)  # (B, T, V) float32
        data = -log_probs.gather(-1, tokens[..., None]).mean()
        soft = -(target * log_probs).sum(-1).mean()
        return (1.0 - self.weight) * data + self.weight * soft, data

    def describe(self) -> dict[str, Any]:
        """What the training info stores: each teacher by file name, file digest and weights digest, and the weight."""
        teachers = zip(self.files, self.file_digests, self.digests, self.shares)
        return {
            "weight": self.weight,
            "teachers": [
                {"file": Path(f).name, "sha256": fd, "weights_sha256": d, "share": s} for f, fd, d, s in teachers
            ],
        }


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def weights_digest(path: str | Path) -> str:
    """sha256 of a model file's config and tensors (names, dtypes, shapes, bytes), blind to its stored info. The
    config as the file stores it: re-serialised by this version, it would gain the keys added since the file
    was written, and a run distilled from the file could no longer resume after an upgrade."""
    read_metadata(path)  # a valid model file, or WeightsError naming the problem
    with safe_open(str(path), framework="pt") as f:
        digest = hashlib.sha256(f.metadata()[CONFIG_KEY].encode())
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name).contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def accept_file_digests(saved: RunSettings, now: RunSettings, teachers: list[str]) -> RunSettings:
    """A checkpoint written before teachers were named by weights digest named them by file digest: when
    those match this run's files, read it as naming them by weights digest (later checkpoints will)."""
    if not saved.teacher_digests or saved.teacher_digests == now.teacher_digests:
        return saved
    if len(saved.teacher_digests) != len(teachers) or saved.teacher_digests != tuple(map(file_digest, teachers)):
        return saved
    print(
        "the checkpoint names its teachers by file digest; they match these files: now named by weights digest",
        file=sys.stderr,
    )
    return dataclasses.replace(saved, teacher_digests=now.teacher_digests)


def check_teacher_shares(shares: list[float] | None, teachers: list[str]) -> None:
    """--teacher-shares: one positive share per --teacher."""
    if shares is None:
        return
    if not teachers:
        raise TrainError("--teacher-shares weighs the teachers in their mixture: add --teacher FILE")
    if len(shares) != len(teachers):
        raise TrainError(
            f"--teacher-shares has {len(shares)} shares for {len(teachers)} --teacher files; "
            f"expected one share per teacher, in the order of the --teacher flags"
        )
    if not all(math.isfinite(s) and s > 0 for s in shares):
        raise TrainError(f"--teacher-shares must be positive numbers, got {' '.join(map(str, shares))}")


def load_distillation(
    paths: list[str], weight: float, student: ModelConfig, device: torch.device, shares: list[float] | None = None
) -> Distillation:
    """Load and check every teacher: each must predict the student's tokens over the student's lengths.
    `shares` (one per teacher, positive) have been checked with the other flags (check_teacher_shares)."""
    models = []
    for path in paths:
        if not Path(path).is_file():
            raise TrainError(f"--teacher {path}: no such file; expected a .safetensors model written by rnnserve")
        try:
            model, _ = load_model(path, device=device)
        except WeightsError as exc:
            raise TrainError(f"--teacher: {exc}") from exc
        check_teacher(path, model.config, student)
        models.append(model.float().eval().requires_grad_(False))
    given = tuple(s / sum(shares) for s in shares) if shares else ()
    return Distillation(
        tuple(models), tuple(paths), tuple(map(weights_digest, paths)), tuple(map(file_digest, paths)), weight, given
    )


def check_teacher(path: str, teacher: ModelConfig, student: ModelConfig) -> None:
    if teacher.task != student.task or teacher.vocab_out != student.vocab_out:
        raise TrainError(
            f"--teacher {path}: a {teacher.task} model with {teacher.vocab_out} classes cannot teach "
            f"this {student.task} model with {student.vocab_out}; expected a model of the same task"
        )
    if teacher.max_len < student.max_len:
        raise TrainError(
            f"--teacher {path}: it reads up to {teacher.max_len} tokens, this run trains on "
            f"{student.max_len}; expected a teacher at least as long"
        )
