"""The physical limit of one decoding step: FLOPs and bytes per generated token.

Formulas (per generated token, one sequence, at position t; L layers, model
width d, H heads of D = d/H, feed-forward width F, V output classes, fp32
state of 4 bytes per number, Linformer length k, Reformer R rounds over n
buckets):
  dense layers   2 * (L * (4 d^2 + 2 d F) + d V)         FLOPs (Reformer: 3 d^2, shared QK)
  softmax        4 t d per layer; reads K, V: 2 t d * 4 bytes, writes 2 d * 4
  linear         4 H D^2 per layer (S += phi(k) v^T, phi(q)^T S) plus O(H D);
                 reads and writes S, Z: 2 * H (D^2 + D) * 4 bytes
  linformer      8 H k D per layer; reads and writes K~, V~: 2 * 2 H k D * 4
  reformer       4 (R t / n + W) d per layer over the expected bucket occupancy
                 and the local window W; reads as many keys and values:
                 2 (R t / n + W) d * 4 bytes
Weights (4 bytes per parameter in fp32) are read once per batched step, so
per token they cost weight_bytes / batch.
"""

from __future__ import annotations

import time

import torch

from model.config import ModelConfig

FP32 = 4
# Datasheet peaks for one H100 SXM5 (NVIDIA): HBM3 bandwidth, dense BF16 tensor-core and FP32 rates.
H100 = {"name": "H100 SXM (datasheet)", "bytes_per_s": 3.35e12, "bf16_flops": 989e12, "fp32_flops": 67e12}


def _matrix_params(cfg: ModelConfig) -> int:
    """Weights of the per-token matrix products: attention projections, feed-forward, output head."""
    d = cfg.d_model
    projections = 3 if cfg.attention == "reformer" else 4  # Reformer shares Q and K
    return cfg.n_layers * (projections * d * d + 2 * d * cfg.d_ff) + d * cfg.vocab_out


def dense_flops(cfg: ModelConfig) -> int:
    return 2 * _matrix_params(cfg)


def attention_cost(cfg: ModelConfig, t: float) -> tuple[float, float]:
    """(FLOPs, state bytes read + written) of all layers' attention for one token at position t."""
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    if cfg.attention == "softmax":
        flops, moved = 4 * t * d, (2 * t * d + 2 * d) * FP32
    elif cfg.attention == "linear":
        flops, moved = 4 * h * dh * dh + 6 * h * dh, 2 * h * (dh * dh + dh) * FP32
    elif cfg.attention == "linformer":
        flops, moved = 8 * h * cfg.linformer_k * dh, 2 * 2 * h * cfg.linformer_k * dh * FP32
    else:  # reformer: the query's bucket in each round, and its local window
        occupancy = cfg.reformer_rounds * t / cfg.reformer_buckets + min(cfg.reformer_local_window, t)
        flops, moved = 4 * occupancy * d, (2 * occupancy * d + 2 * d) * FP32
    return cfg.n_layers * flops, cfg.n_layers * moved


def weight_bytes(cfg: ModelConfig) -> int:
    return _matrix_params(cfg) * FP32


def token_cost(cfg: ModelConfig, t: float, batch: int) -> dict:
    """Per generated token at position t in a batch of `batch` sequences."""
    attn_flops, state_moved = attention_cost(cfg, t)
    return {"position": t, "batch": batch, "flops": dense_flops(cfg) + attn_flops, "attention_flops": attn_flops,
            "state_bytes_moved": state_moved, "weight_bytes_per_token": weight_bytes(cfg) / batch}


def bound_tokens_per_s(cost: dict, bytes_per_s: float, flops_per_s: float) -> float:
    """Roofline: the slower of moving the bytes and doing the FLOPs."""
    moved = cost["state_bytes_moved"] + cost["weight_bytes_per_token"]
    return 1.0 / max(moved / bytes_per_s, cost["flops"] / flops_per_s)


def probe_machine() -> dict:
    """Measured copy bandwidth (256 MiB, past any cache but L3) and fp32 matmul rate, best of 3, current threads."""
    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    copy_s = min(_time(lambda: dst.copy_(src)) for _ in range(3))
    a = torch.randn(1024, 1024)
    mm_s = min(_time(lambda: a @ a) for _ in range(3))
    return {"copy_bytes_per_s": 2 * src.numel() * FP32 / copy_s, "fp32_matmul_flops": 2 * 1024**3 / mm_s,
            "threads": torch.get_num_threads()}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def roofline(cfg: ModelConfig, image_tokens: int, batch: int, machine: dict) -> dict:
    """Per-token cost at the mean position of a generation and the bounds it implies."""
    cost = token_cost(cfg, image_tokens / 2, batch)
    h100 = bound_tokens_per_s(cost, H100["bytes_per_s"], H100["bf16_flops"])
    here = None  # only for a machine whose rates were measured (the CPU)
    if machine:
        here = bound_tokens_per_s(cost, machine["copy_bytes_per_s"], machine["fp32_matmul_flops"])
    return cost | {"bound_tokens_per_s_here": here, "bound_images_per_s_here": None if here is None else here / image_tokens,
                   "bound_tokens_per_s_h100": h100, "bound_images_per_s_h100": h100 / image_tokens}
