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

The older format, a torch.save dict, still loads (training/checkpoint_legacy.py). What a checkpoint holds is in
training/run_state.py; resuming from one in training/resume.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import Transformer, build_model
from model.io.atomic_write import write_atomically
from model.io.weights import TOKENIZER_KEY

from .averaging import WeightAverage
from .checkpoint_legacy import ZIP_MAGIC, read_legacy
from .errors import TrainError
from .lora import add_lora, merge_lora
from .run_state import Checkpoint, Progress, RngStates, RunSettings, parse_config

FORMAT = 2  # 1: the torch.save dict
METADATA_KEY = "rnnserve.checkpoint"
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "compact": torch.bfloat16}  # moments, average
INT8_STEPS = 127


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
