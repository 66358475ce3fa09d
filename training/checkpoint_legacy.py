"""The checkpoint format rnnserve wrote before format 2: a torch.save dict (config, model, optimizer, progress,
data_rng, torch_rng, cuda_rng), still loaded, read with weights_only=True (tensors and plain values only)."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import TrainError
from .run_state import Checkpoint, Progress, RngStates, parse_config

LEGACY_KEYS = ("config", "model", "optimizer", "progress", "data_rng", "torch_rng", "cuda_rng")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


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
