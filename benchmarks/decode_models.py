"""The decoding benchmark's models: a training preset's shapes with random weights, or trained MNIST files, and the
long-context text copy the step-time sweep runs on."""

from __future__ import annotations

from pathlib import Path

import torch

from model.attention.kinds import kind_options
from model.config import ModelConfig
from model.io.weights import load_model, read_metadata
from model.transformer import Transformer, build_model
from training.presets import PRESETS

from .decode_settings import DTYPES, IMAGE_TOKENS, DecodeSettings
from .errors import BenchError
from .roofline import FP32


def preset_config(preset: str, kind: str, task: str = "mnist", max_len: int = IMAGE_TOKENS) -> ModelConfig:
    if preset not in PRESETS:
        raise BenchError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    # The training presets' shapes for every kind ("cpu": the CPU-trained MNIST models, "paper": the MNIST
    # model of "Transformers are RNNs"); Reformer as `rnnserve train` builds it, so timings match trained models.
    return ModelConfig(
        attention=kind,
        task=task,
        max_len=max_len,
        reformer_local_window=kind_options()["reformer_local_window"].train_default,
        **PRESETS[preset].architecture(),
    )


def image_models(settings: DecodeSettings) -> dict[str, tuple[Transformer, str]]:
    """kind -> (model, source): trained MNIST weights when --weights is given, else a random preset."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    if settings.weights is None:
        out = {}
        for kind in settings.kinds:
            torch.manual_seed(settings.seed)
            model = build_model(preset_config(settings.preset, kind)).to(device=device, dtype=dtype).eval()
            out[kind] = (with_cache_dtype(model, settings), f"preset {settings.preset} (random weights)")
        return out
    files = _mnist_weight_files(Path(settings.weights), settings.kinds)
    return {
        kind: (with_cache_dtype(load_model(path, device, dtype)[0].eval(), settings), str(path))
        for kind, path in files.items()
    }


def cached_number_bytes(model: Transformer) -> int:
    dtype = model.cache_dtype()
    return dtype.itemsize if dtype is not None else FP32


def with_cache_dtype(model: Transformer, settings: DecodeSettings) -> Transformer:
    model.kv_cache_dtype = DTYPES[settings.kv_cache_dtype] if settings.kv_cache_dtype else None
    return model


def _mnist_weight_files(folder: Path, kinds: tuple[str, ...]) -> dict[str, Path]:
    if not folder.is_dir():
        raise BenchError(f"--weights {folder}: not a directory; expected a folder of .safetensors files")
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        cfg, _ = read_metadata(path)
        if cfg.task == "mnist" and cfg.attention in kinds and cfg.attention not in found:
            found[cfg.attention] = path
    if not found:
        raise BenchError(f"--weights {folder}: no MNIST model of kind {', '.join(kinds)} in any .safetensors file")
    return found


def position_model(image_model: Transformer, max_len: int, seed: int) -> Transformer:
    """Same architecture as `image_model`, text task, sinusoidal positions, long max_len, random weights.

    Random weights are fine here: step time and state size depend on shapes
    only (Reformer's bucket occupancy depends on hashing, see README).
    """
    cfg = image_model.config.replace(task="text", max_len=max_len, pos_encoding="sinusoidal", dropout=0.0)
    torch.manual_seed(seed)
    model = build_model(cfg).to(device=image_model.device, dtype=image_model.dtype).eval()
    model.kv_cache_dtype = image_model.kv_cache_dtype
    return model
