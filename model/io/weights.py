"""Save and load models as single safetensors files, config in the metadata.

A file holds every tensor of the model plus two metadata entries:
`rnnserve.config` (the ModelConfig as JSON) and `rnnserve.info` (free JSON:
training data, examples seen, wall time, device, evaluation results); an
imported model adds its tokenizer (`rnnserve.tokenizer`) and, when it has
one, its chat template (`rnnserve.chat_template`, model/io/chat_template.py).
Loading checks everything before building the model, so a bad file gives
one `WeightsError` naming the file and the problem, never half a model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ConfigError, ModelConfig
from .atomic_write import write_atomically
from ..transformer import Transformer, build_model

CONFIG_KEY = "rnnserve.config"
TOKENIZER_KEY = "rnnserve.tokenizer"
CHAT_TEMPLATE_KEY = "rnnserve.chat_template"  # JSON: {template, bos_token, eos_token}
INFO_KEY = "rnnserve.info"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class WeightsError(ValueError):
    """A weights file cannot be loaded; the message names the file and why."""

    def __init__(self, path: str | os.PathLike[str], problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def save_model(
    model: Transformer,
    path: str | os.PathLike[str],
    info: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
) -> None:
    """Write `model` and its config, its parameters optionally cast to `dtype` (e.g. bfloat16), its
    tokenizer (the `tokenizers` library's JSON) when it has one rather than bytes, and its chat template
    (ChatTemplate.to_json()) when it has one.

    Buffers are written in the dtype the model holds them in: Reformer's rotations
    stay float32, so a 16-bit file hashes exactly like the model that wrote it.
    """
    parameters = {name for name, _ in model.named_parameters()}
    tensors = {
        name: t.detach().to(dtype if dtype is not None and name in parameters else t.dtype).contiguous().cpu()
        for name, t in model.state_dict().items()
    }
    metadata = {CONFIG_KEY: model.config.to_json(), INFO_KEY: json.dumps(info or {}, sort_keys=True)}
    if tokenizer is not None:
        metadata[TOKENIZER_KEY] = tokenizer
    if chat_template is not None:
        metadata[CHAT_TEMPLATE_KEY] = chat_template
    _write(tensors, metadata, path)


def read_tokenizer(path: str | os.PathLike[str]) -> str | None:
    """The tokenizer stored with a model (the `tokenizers` library's JSON), or None for a byte model."""
    with _open(path) as f:
        return (f.metadata() or {}).get(TOKENIZER_KEY)


def read_chat_template(path: str | os.PathLike[str]) -> str | None:
    """The chat template stored with a model (ChatTemplate's JSON), or None when it has none."""
    with _open(path) as f:
        return (f.metadata() or {}).get(CHAT_TEMPLATE_KEY)


def update_info(path: str | os.PathLike[str], changes: dict[str, Any]) -> None:
    """Merge `changes` into a file's info (e.g. new evaluation results); its tensors are written back as stored."""
    with _open(path) as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    _, info = _parse_metadata(path, metadata)  # only a valid rnnserve file
    _write(tensors, metadata | {INFO_KEY: json.dumps(info | changes, sort_keys=True)}, path)


def _write(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as `rnnserve import` does for --out
    write_atomically(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def read_metadata(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and info of a weights file, without loading tensors."""
    with _open(path) as f:
        return _parse_metadata(path, f.metadata())


def load_model(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Transformer, dict[str, Any]]:
    """Build the model a file describes and fill it; returns (model, info). `dtype` casts the
    parameters; Reformer keeps its rotations float32 (see ReformerAttention._apply)."""
    with _open(path) as f:
        cfg, info = _parse_metadata(path, f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    model = build_model(cfg)
    _check_tensors(path, model, tensors)
    model.load_state_dict(tensors, strict=True)
    return model.to(device=device, dtype=dtype).eval(), info


def _open(path: str | os.PathLike[str]) -> safe_open:
    if not Path(path).is_file():
        raise WeightsError(path, "no such file")
    _check_not_truncated(path)
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(
            path, f"not a valid safetensors file ({exc}); expected a .safetensors file written by rnnserve"
        ) from exc


def _check_not_truncated(path: str | os.PathLike[str]) -> None:
    """Compare the file's size with what its header promises, for a clear message on a cut download."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsError(path, f"truncated: {size} bytes, too short for a safetensors header")
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            return  # not a safetensors header at all: safe_open says so
        try:
            header = json.loads(f.read(header_len))
            data_end = max(
                (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return  # malformed header: safe_open gives the precise error
    expected = 8 + header_len + int(data_end)
    if size < expected:
        raise WeightsError(
            path,
            f"truncated: {size} bytes, but its header describes {expected} bytes "
            "(an interrupted copy or download?); expected a complete .safetensors file",
        )


def _parse_metadata(
    path: str | os.PathLike[str], metadata: dict[str, str] | None
) -> tuple[ModelConfig, dict[str, Any]]:
    metadata = metadata or {}
    if CONFIG_KEY not in metadata:
        raise WeightsError(path, f"metadata has no '{CONFIG_KEY}' entry; this is not an rnnserve model file")
    try:
        cfg = ModelConfig.from_json(metadata[CONFIG_KEY])
    except (ConfigError, TypeError) as exc:
        raise WeightsError(path, f"bad model config: {exc}") from exc
    try:
        info = json.loads(metadata.get(INFO_KEY, "{}"))
    except json.JSONDecodeError as exc:
        raise WeightsError(path, f"metadata '{INFO_KEY}' is not valid JSON: {exc}") from exc
    return cfg, info


def _check_tensors(path: str | os.PathLike[str], model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise WeightsError(path, f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise WeightsError(path, f"unexpected tensors: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise WeightsError(path, f"tensor {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype not in FLOAT_DTYPES:
            raise WeightsError(
                path, f"tensor {name} has dtype {got.dtype}, expected a float type (float32, float16, bfloat16)"
            )
        if not torch.isfinite(got).all():
            raise WeightsError(path, f"tensor {name} has non-finite values (NaN or inf)")
