"""Server settings: one pydantic-settings object, built once at start-up.

Values come from `rnnserve serve` flags first, then `RNNSERVE_*` environment
variables, then the defaults below. Nothing here runs at import time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    import torch

MIB = 1024 * 1024


class SettingsError(ValueError):
    """A setting is invalid; the message says which and what is expected."""


BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}
BYTE_UNITS.update({"t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4})


def parse_bytes(value: Any) -> Any:
    """A size as a number of bytes or with a unit (500MB, 2GiB, 1.5G: decimal units, and binary ones with `i`);
    anything else is passed on for the field's own check to refuse."""
    if not isinstance(value, str):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in BYTE_UNITS:
        raise ValueError(f"a size in bytes, e.g. 2GiB, 500MB or 1048576, got {value!r}")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2).lower()])


Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RNNSERVE_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port
    weights: Path = Path("weights")  # every *.safetensors in it is served
    models: list[Path] = Field(default_factory=list)  # explicit files; when given, `weights` is ignored
    chat_template: Path | None = None  # a Jinja2 chat template every text model uses, in place of its own
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # softmax's cached keys, values; auto: as dtype
    cuda_graphs: bool = True  # on CUDA, replay linear/Linformer decode steps as captured graphs
    compile_decode: bool = True  # on CPU, softmax/linear/Linformer decode steps through torch.compile
    threads: int | None = Field(
        None, ge=1, le=1024
    )  # intra-op CPU threads per engine; None: a share of the budget (cpu_budget.py)
    # Engine processes per model, its threads shared among them; None: one a thread for a small model on the CPU
    # (server/engine/pool.py), else one.
    workers: int | None = Field(None, ge=1, le=256)
    max_batch: int = Field(64, ge=1, le=65536)  # sequences decoded together, per model
    max_waiting: int = Field(256, ge=0)  # sequences queued per model before 429
    # vLLM's: the names requests use (a file stem's by default; STEM=NAME for one of several models)
    served_model_name: list[str] = Field(default_factory=list)
    max_model_len: int | None = Field(None, ge=1)  # caps every text model's context; None: each model's own
    # A budget for all models' decode slots (state and per-row buffers), from which each model's slots follow
    kv_cache_memory: Bytes | None = Field(None, ge=1)
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=1)  # of the RAM, or of the GPU's memory on CUDA
    # Bytes of decode states each engine keeps by prefix (server/engine/prefix_cache.py); 0: no prefix cache
    prefix_cache_memory: Bytes = Field(256 * MIB, ge=0)
    # Tokens read between two decode states a long prompt's prefill keeps, for constant-size states
    # (server/engine/prefix_plan.py); 0: only at prompt ends, finished sequences and branch points
    prefix_cache_every: int = Field(64, ge=0, le=1 << 20)
    scheduler_steps: int = Field(8, ge=1, le=1024)  # decode steps per scheduling pass when no client watches each
    engine_process: bool = True  # run each model's engine in a process of its own, apart from request handling
    max_body_bytes: int = Field(4 * MIB, ge=1024)
    api_key: SecretStr | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    drain_seconds: float = Field(30.0, ge=0)  # after SIGTERM, in-flight requests get this long to finish
    body_timeout: float = Field(30.0, gt=0)  # a request body must arrive within this many seconds (408)
    header_timeout: float = Field(10.0, gt=0)  # a request's line and headers must arrive within this many seconds (408)
    # An engine with work that shows no progress this long is hung: its requests fail, it restarts; 0: never.
    # Far above a step of any model served here; adopting a background compile pauses the watch.
    watchdog_seconds: float = Field(60.0, ge=0)
    # Ray Serve (`--ray`, or the import path `server.rayserve.app:build`); ignored by a plain server.
    replicas: int = Field(1, ge=1)  # fixed replica count, when not autoscaling
    min_replicas: int | None = Field(None, ge=0)  # autoscaling: set max_replicas (min defaults to 1)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(32.0, gt=0)  # autoscaling aims at this many requests per replica
    downscale_delay: float = Field(60.0, ge=0)  # autoscaling: seconds of low load before a replica is removed
    upscale_delay: float = Field(5.0, ge=0)  # autoscaling: seconds of high load before a replica is added
    cpus_per_replica: float = Field(1.0, ge=0)
    gpus_per_replica: float = Field(0.0, ge=0)
    ray_metrics_port: int = Field(8080, ge=0, le=65535)  # `--ray`: where Ray exports every replica's metrics
    # `--ray`: requests whose prompts start with the same this many characters go to the same replica, whose
    # prefix cache holds them; 0: Serve's default router (any replica).
    ray_prefix_chars: int = Field(256, ge=0)

    @model_validator(mode="after")
    def _check_autoscaling(self) -> "Settings":
        if self.max_replicas is None:
            if self.min_replicas is not None:
                raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
            return self
        if "replicas" in self.model_fields_set:
            raise ValueError(
                "give either --replicas (a fixed count) or --min-replicas/--max-replicas (autoscaling), not both"
            )
        if (self.min_replicas or 0) > self.max_replicas:
            raise ValueError(f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}")
        return self

    @model_validator(mode="after")
    def _check_memory_budget(self) -> "Settings":
        if self.kv_cache_memory is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError("give either --kv-cache-memory (bytes) or --kv-cache-memory-fraction, not both")
        return self

    def decode_memory_budget(self, device: str) -> int | None:
        """Bytes all models' decode slots may take (--kv-cache-memory, or the fraction of the device's memory);
        None: no budget, every model takes --max-batch slots."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.kv_cache_memory_fraction is None:
            return None
        return int(self.kv_cache_memory_fraction * device_memory(device))

    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def torch_device(self) -> str:
        """The device to load models on; 'auto' picks CUDA when present."""
        import torch  # imported here so reading settings stays cheap

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SettingsError("--device cuda was asked for but no CUDA GPU is available; use --device cpu or auto")
        return self.device

    def torch_dtype(self, device: str):
        """The weights' dtype on `device`; recurrent sums (linear S, Z; Linformer K~, V~) stay float32."""
        import torch

        name = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        return getattr(torch, name)

    def torch_kv_cache_dtype(self) -> torch.dtype | None:
        """The dtype softmax models store cached keys and values in; None: the model's dtype."""
        return kv_cache_torch_dtype(self.kv_cache_dtype)

    def model_paths(self) -> list[Path]:
        """The weights files to serve, checked to exist; sorted for a stable order."""
        if self.models:
            missing = [str(p) for p in self.models if not p.is_file()]
            if missing:
                raise SettingsError(f"--model file not found: {', '.join(missing)}")
            return list(self.models)
        if not self.weights.is_dir():
            raise SettingsError(
                f"weights directory '{self.weights}' does not exist; pass --weights DIR or --model PATH"
            )
        paths = sorted(self.weights.glob("*.safetensors"))
        if not paths:
            raise SettingsError(
                f"weights directory '{self.weights}' has no .safetensors files; "
                "train one with `rnnserve train` or pass --model PATH"
            )
        return paths

    def chat_template_text(self) -> str | None:
        """The --chat-template file's text, None when not given; SettingsError if it cannot be read."""
        from model.io.chat_template import ChatTemplateError, read_template_file

        if self.chat_template is None:
            return None
        try:
            return read_template_file(self.chat_template)
        except ChatTemplateError as exc:
            raise SettingsError(f"--chat-template {exc}") from None

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None


def device_memory(device: str) -> int:
    """Bytes of memory on `device`: the GPU's total on CUDA, else the machine's RAM."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[1]
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_cache_torch_dtype(name: str) -> torch.dtype | None:
    """--kv-cache-dtype's value as a torch dtype; None for auto (the model's dtype)."""
    import torch  # imported here so reading settings stays cheap

    return None if name == "auto" else getattr(torch, name)


def build_settings(**overrides: Any) -> Settings:
    """Settings from flags (`overrides`, None = not given) over env over defaults."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad setting, named as the flag a user would type."""
    lines = []
    for err in exc.errors():
        if not err["loc"]:  # a check across settings: its message names the flags
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        name = str(err["loc"][0])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting '{name}'; known: {', '.join(Settings.model_fields)}")
            continue
        flag = "--" + name.replace("_", "-")
        value = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{flag} / RNNSERVE_{name.upper()}: {err['msg']}{value}")
    return "invalid settings: " + "; ".join(lines)
