"""What a run of the decoding benchmark reports: its models and every measurement, as one JSON-ready record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .decode_images import ImageResult
from .decode_no_cache import NoCacheResult
from .decode_positions import FlatnessResult, PositionPoint


@dataclass
class ModelInfo:
    kind: str
    source: str  # "preset NAME (random weights)" or a file path
    config: dict
    parameters: int
    state_bytes_per_sequence: int  # at image_tokens


@dataclass
class DecodeReport:
    settings: dict
    environment: dict
    models: dict[str, ModelInfo]
    images: list[ImageResult]
    no_cache: list[NoCacheResult]
    positions: dict[str, list[PositionPoint]]
    flatness: list[FlatnessResult] = field(default_factory=list)
    machine: dict = field(default_factory=dict)  # measured copy bandwidth and matmul rate
    roofline: dict[str, dict] = field(default_factory=dict)  # kind -> per-token cost and bounds
    targets: list[dict] = field(default_factory=list)
    compile_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # "KIND batch N" -> class -> s
    comparisons: list[dict] = field(default_factory=list)  # rnnserve against its eager path and its peers
    peers: list[dict] = field(default_factory=list)  # what each peer is: cache, sampling
    load: dict = field(default_factory=dict)  # /proc/loadavg before and after the run

    def to_dict(self) -> dict:
        return asdict(self)
