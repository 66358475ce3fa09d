"""What a run of the decoding benchmark (benchmarks/decode.py) measures: its settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.attention.kinds import attention_kinds

IMAGE_TOKENS = 784  # 28 x 28 grey levels in raster order
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DecodeSettings:
    kinds: tuple[str, ...] = field(default_factory=attention_kinds)
    preset: str = "cpu"
    weights: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    image_tokens: int = IMAGE_TOKENS
    repeats: int = 1
    max_position: int = 16_384
    positions: tuple[int, ...] = ()  # empty: chosen from max_position
    steps_per_position: int = 16
    position_batch: int = 1
    nocache_pixels: int = 64
    nocache_samples: int = 4
    device: str = "cpu"
    dtype: str = "float32"  # model weights; linear and Linformer states stay float32
    kv_cache_dtype: str | None = None  # softmax's cached keys and values, the hybrid's ring; None: as dtype
    cuda_graphs: bool = True  # on CUDA, decode steps of graphable kinds replay captured graphs
    compiled: bool = True  # on the CPU, decode steps of compilable kinds run through torch.compile
    eager_too: bool = True  # with compiled: also time each compiled kind's eager path, "KIND (eager)"
    peers: bool = False  # also time other implementations (benchmarks/peers.py)
    peer_batch_sizes: tuple[int, ...] = ()  # batch sizes for the peers; empty: the largest only
    seed: int = 0
    workers: int = 1  # rnnserve's contestants as this many processes, as the server's engine workers
    peer_workers: tuple[int, ...] = ()  # the peers' layouts (processes), each timed; empty: as workers
