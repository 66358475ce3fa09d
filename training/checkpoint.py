"""Training checkpoints: a run goes on for hours in pieces, stopped at any moment and resumed exactly.

One safetensors file (no pickle: loading it runs no code) holds
  model.NAME                   the weights, float32 (bfloat16 would round away a step's small updates); with
                               --checkpoint-precision compact, int8 steps from the stored average (below)
  model_scale.NAME             compact only: the float32 size of one int8 step, per row
  average.NAME                 with --ema-decay: the moving average of the weights (training/averaging.py),
                               in --checkpoint-precision
  optim.KEY.NAME               AdamW's moments (KEY exp_avg, exp_avg_sq) in --checkpoint-precision
  rng.data, rng.torch, rng.cuda.I   the batch sampler's, torch's and each GPU's generator state (uint8)
and one metadata entry `rnnserve.checkpoint` (JSON): format version, model config, progress, the
optimiser's steps and hyper-parameters, and the run settings a resume must match.

bfloat16 moments halve the optimiser's share of the file. exp_avg_sq is positive and spans many
decades; bfloat16 keeps float32's exponent range, so nothing underflows to zero (float16 flushes
values under 6e-8, which would blow up 1/sqrt(v)), and its 8-bit mantissa moves sqrt(v) by at most
0.1%. float32 moments make a resume bit for bit identical to an uninterrupted run.

compact (bfloat16 moments and average, weights as int8 steps from that average) keeps a run with
--ema-decay at about 7 bytes a parameter instead of 8 (bfloat16) or 12 (float32), so the committed
checkpoints stay near 10 MB. A run's weights sit close to their moving average, so 8 bits of their
distance from it, scaled per row, land nearer the float32 weights than 16 bits of the weights would.

The older format (a torch.save dict: config, model, optimizer, progress, data_rng, torch_rng,
cuda_rng) still loads, read with weights_only=True (tensors and plain values only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import ModelConfig, Transformer, build_model
from model.config import ConfigError
from model.io.weights import TOKENIZER_KEY

from .averaging import WeightAverage
from .lora import add_lora, merge_lora
from .errors import TrainError

FORMAT = 2  # 1: the torch.save dict
METADATA_KEY = "rnnserve.checkpoint"
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "compact": torch.bfloat16}  # moments, average
INT8_STEPS = 127
LEGACY_KEYS = ("config", "model", "optimizer", "progress", "data_rng", "torch_rng", "cuda_rng")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
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


@dataclass(frozen=True)
class CheckpointWriter:
    """Where and how this run writes its checkpoints."""

    path: Path
    precision: str  # a key of PRECISIONS
    run: RunSettings
    tokenizer: str | None = None  # a model with a tokenizer keeps it in its checkpoints too (rnnserve eval reads it)

    def save(
        self,
        model: Transformer,
        opt: torch.optim.Optimizer,
        prog: Progress,
        generator: torch.Generator,
        average: dict[str, torch.Tensor] | None = None,
    ) -> None:
        tensors, metadata = encode(
            model, opt, prog, RngStates.capture(generator), self.run, self.precision, average or {}
        )
        if self.tokenizer is not None:
            metadata[TOKENIZER_KEY] = self.tokenizer
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


# ---------------------------------------------------------------- writing


def optimizer_param_names(model: Transformer, opt: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each optimiser index (torch numbers parameters group after group)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in opt.param_groups for p in group["params"]]


def encode(
    model: Transformer,
    opt: torch.optim.Optimizer,
    prog: Progress,
    rng: RngStates,
    run: RunSettings,
    precision: str,
    average: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a checkpoint file."""
    names = optimizer_param_names(model, opt)
    state = opt.state_dict()
    stored_average = {
        f"average.{k}": v.detach().to(PRECISIONS[precision]).cpu().contiguous() for k, v in average.items()
    }
    as_steps = precision == "compact" and bool(average)
    tensors = (
        encode_weights(model, stored_average)
        if as_steps
        else {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    )
    steps: dict[str, float] = {}
    keys: set[str] = set()
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if key == "step":
                steps[names[index]] = float(value)
            else:
                keys.add(key)
                tensors[f"optim.{key}.{names[index]}"] = value.detach().to(PRECISIONS[precision]).cpu().contiguous()
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": [names[i] for i in g["params"]]}
        for g in state["param_groups"]
    ]
    header = {
        "format": FORMAT,
        "config": json.loads(model.config.to_json()),
        "progress": dataclasses.asdict(prog),
        "optimizer": {"steps": steps, "keys": sorted(keys), "param_groups": groups},
        "run": dataclasses.asdict(run),
        "precision": precision,
    }
    return tensors | stored_average | rng.tensors(), {METADATA_KEY: json.dumps(header)}


def encode_weights(model: Transformer, stored_average: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compact: each averaged weight as int8 steps from its average as stored; anything else float32."""
    tensors = {}
    for name, weight in model.state_dict().items():
        base = stored_average.get(f"average.{name}")
        if base is None:
            tensors[f"model.{name}"] = weight.detach().cpu().contiguous()
            continue
        distance = weight.detach().cpu().float() - base.float()
        rows = distance.reshape(-1, weight.shape[-1]) if weight.dim() > 1 else distance.reshape(1, -1)
        scale = rows.abs().amax(dim=1) / INT8_STEPS  # (rows,)
        steps = torch.where(scale[:, None] > 0, rows / scale.clamp_min(1e-38)[:, None], 0.0)
        tensors[f"model.{name}"] = steps.round().to(torch.int8).reshape(weight.shape).contiguous()
        tensors[f"model_scale.{name}"] = scale.contiguous()
    return tensors


def decode_weights(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as saved: float32 as they are, compact ones (those with a step size) average + steps x scale."""
    weights = {}
    for key, value in tensors.items():
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        scale = tensors.get(f"model_scale.{name}")
        if scale is None:
            weights[name] = value
            continue
        base = tensors.get(f"average.{name}")
        if base is None or base.shape != value.shape or value.dtype != torch.int8:
            raise TrainError(f"{path}: compact checkpoint: {name} has no matching average to step from")
        rows = value.reshape(scale.shape[0], -1).float() * scale[:, None]
        weights[name] = base.float() + rows.reshape(value.shape)
    return weights


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp), flush it to disk, then rename over `path`: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading


def read_checkpoint(path: Path) -> Checkpoint:
    """Read either format; every problem is one TrainError naming the file."""
    if not path.is_file():
        raise TrainError(f"{path}: no such checkpoint file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == ZIP_MAGIC:
        return read_legacy(path)
    check_complete(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrainError(f"{path}: corrupt checkpoint ({exc}); expected a .ckpt written by rnnserve train") from exc
    if header is None:
        raise TrainError(
            f"{path}: not a training checkpoint (no '{METADATA_KEY}' metadata; a model .safetensors "
            "file holds no optimiser state); expected a .ckpt written by rnnserve train"
        )
    try:
        return decode(path, json.loads(header), tensors)
    except TrainError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise TrainError(f"{path}: corrupt checkpoint metadata ({exc!r})") from exc


def check_complete(path: Path) -> None:
    """Compare the size with what the safetensors header promises: a cut copy gets its own message."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        raw = f.read(header_len) if 0 < header_len <= size else b""
    try:
        header = json.loads(raw)
        data_end = max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise TrainError(
            f"{path}: corrupt or truncated checkpoint ({size} bytes, no readable safetensors header); "
            "expected a .ckpt written by rnnserve train"
        ) from None
    expected = 8 + header_len + int(data_end)
    if size < expected:
        raise TrainError(
            f"{path}: truncated checkpoint: {size} bytes, but its header describes {expected} bytes "
            "(an interrupted copy?)"
        )


def decode(path: Path, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Checkpoint:
    if header["format"] > FORMAT:
        raise TrainError(f"{path}: checkpoint format {header['format']} is newer than this rnnserve's {FORMAT}")
    saved = header["optimizer"]
    names = [name for group in saved["param_groups"] for name in group["params"]]
    state = {i: optimizer_entries(tensors, name, saved["keys"], saved["steps"]) for i, name in enumerate(names)}
    groups, start = [], 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append(
            {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
            | {"params": list(range(start, start + count))}
        )
        start += count
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(sum(k.startswith("rng.cuda.") for k in tensors))]
    return Checkpoint(
        config=parse_config(path, json.dumps(header["config"])),
        model=decode_weights(path, tensors),
        optimizer={"state": {i: s for i, s in state.items() if s}, "param_groups": groups},
        param_names=names,
        progress=Progress(**header["progress"]),
        rng=RngStates(tensors["rng.data"], tensors["rng.torch"], cuda or None),
        run=RunSettings.from_header(header["run"]),
        precision=header["precision"],
        average={k.removeprefix("average."): v for k, v in tensors.items() if k.startswith("average.")} or None,
    )


def model_of(path: Path, device: torch.device) -> tuple[Transformer, dict[str, Any]]:
    """The model a run's checkpoint would save now (its weight average if it keeps one), float32, and what it is."""
    ckpt = read_checkpoint(path)
    model = build_model(ckpt.config)
    if ckpt.run is not None and ckpt.run.lora_rank:
        add_lora(model, ckpt.run.lora_rank, ckpt.run.lora_alpha)
    try:
        model.load_state_dict(ckpt.model)
    except (RuntimeError, KeyError) as exc:
        raise TrainError(f"{path}: checkpoint does not fit its own config: {exc}") from exc
    if ckpt.average is not None:  # the resume's check: the average must cover every parameter
        WeightAverage.start(model, 0.0, ckpt.average).swap_into(model)
    merge_lora(model)
    weights = "moving average of the weights" if ckpt.average is not None else "last step's weights"
    return model.to(device).eval(), {
        "step": ckpt.progress.step,
        "examples_seen": ckpt.progress.examples,
        "weights": weights,
    }


def optimizer_entries(
    tensors: dict[str, torch.Tensor], name: str, keys: list[str], steps: dict[str, float]
) -> dict[str, Any]:
    """One parameter's optimiser state: its step and moments (empty if it never had a gradient)."""
    entries: dict[str, Any] = {key: tensors[f"optim.{key}.{name}"] for key in keys if f"optim.{key}.{name}" in tensors}
    if name in steps:
        entries["step"] = torch.tensor(steps[name], dtype=torch.float32)
    return entries


def read_legacy(path: Path) -> Checkpoint:
    """The torch.save dict rnnserve wrote before format 2."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError or UnpicklingError on a damaged archive
        raise TrainError(f"{path}: corrupt or truncated checkpoint (older torch.save format: {exc})") from exc
    missing = [k for k in LEGACY_KEYS if k not in blob] if isinstance(blob, dict) else list(LEGACY_KEYS)
    if missing:
        raise TrainError(f"{path}: not an rnnserve checkpoint: missing {', '.join(missing)}")
    return Checkpoint(
        config=parse_config(path, blob["config"]),
        model=blob["model"],
        optimizer=blob["optimizer"],
        param_names=None,
        progress=Progress(**blob["progress"]),
        rng=RngStates(blob["data_rng"], blob["torch_rng"], blob["cuda_rng"]),
        run=None,
        precision="float32",
    )


def parse_config(path: Path, text: str) -> ModelConfig:
    try:
        return ModelConfig.from_json(text)
    except (ConfigError, TypeError, ValueError) as exc:
        raise TrainError(f"{path}: bad model config in checkpoint: {exc}") from exc


# ---------------------------------------------------------------- resuming


def restore(
    path: Path, ckpt: Checkpoint, model: Transformer, opt: torch.optim.Optimizer, generator: torch.Generator
) -> Progress:
    """Load weights, optimiser state and RNG states into this run; returns the progress to continue from."""
    check_config(path, ckpt.config, model.config)
    if ckpt.param_names is not None and ckpt.param_names != optimizer_param_names(model, opt):
        raise TrainError(f"{path}: the optimiser's parameter groups differ from this run's")
    try:
        model.load_state_dict(ckpt.model)
        opt.load_state_dict(ckpt.optimizer)  # casts bfloat16 moments back to the parameters' float32
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainError(f"{path}: checkpoint does not fit this model: {exc}") from exc
    ckpt.rng.restore(generator)
    return ckpt.progress


def config_differences(saved: ModelConfig, built: ModelConfig, ignored: frozenset[str] = frozenset()) -> str | None:
    """'attention=linear; this run builds attention=softmax' for the fields that differ (bar `ignored`), or None."""
    was, now = saved.as_dict(), built.as_dict()
    fields = [name for name in was if was[name] != now[name] and name not in ignored]
    if not fields:
        return None
    had = ", ".join(f"{name}={was[name]}" for name in fields)
    return f"{had}; this run builds " + ", ".join(f"{name}={now[name]}" for name in fields)


def check_config(path: Path, saved: ModelConfig, built: ModelConfig) -> None:
    """Name every architecture field that differs, e.g. 'attention=linear; this run builds attention=softmax'."""
    differences = config_differences(saved, built)
    if differences:
        raise TrainError(
            f"{path}: checkpoint has {differences}; use the same architecture flags as the run that wrote it"
        )


def run_changes(saved: RunSettings, now: RunSettings) -> dict[str, tuple[Any, Any]]:
    """Settings that differ: name -> (checkpoint's value, this run's)."""
    return {
        f.name: (getattr(saved, f.name), getattr(now, f.name))
        for f in dataclasses.fields(saved)
        if getattr(saved, f.name) != getattr(now, f.name)
    }


# ---------------------------------------------------------------- stopping


@dataclass
class StopRequest:
    """Set by SIGTERM or SIGINT: the loop ends after the current step and writes a checkpoint."""

    signum: int | None = None


class TrainingStopped(Exception):
    """The run ended early on a signal, its checkpoint written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        saved = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint (--checkpoint-every 0)"
        super().__init__(
            f"stopped by {name} after step {step}; {saved}; run the same command with --resume to continue"
        )
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """While inside: SIGTERM/SIGINT only set the request; a second signal acts as usual (e.g. to quit a stuck save)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be set from the main thread
        return
    signums = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in signums}

    def put_back() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def on_signal(signum: int, _frame) -> None:
        request.signum = signum
        put_back()

    for s in signums:
        signal.signal(s, on_signal)
    try:
        yield request
    finally:
        put_back()
