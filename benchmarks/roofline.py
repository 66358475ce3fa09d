"""The physical limit of one decoding step: FLOPs and bytes per generated token.

Per generated token, one sequence, at position t (L layers, model width d,
feed-forward width F, V output classes):
  dense layers   2 * (L * (P d^2 + 2 d F) + d V) FLOPs, with P the kind's
                 `projections` (4; Reformer 3: shared QK)
  attention      L times the kind's own `token_cost(cfg, t)` (model/attention/base.py):
                 FLOPs and state bytes read + written by one layer; the
                 formulas of the four shipped kinds are tabled in
                 benchmarks/results/NOTES.md, "Physical limit".
Weights (4 bytes per parameter in float32, 2 in bfloat16) are read once per batched
step, so per token they cost weight_bytes / batch. On this machine the FLOP rate is
a matrix product measured in the bench's own dtype: bfloat16 products run faster
than float32 ones on CPUs with AVX512-BF16 or AMX, so they set a higher bound.
Of two library routes (torch's matmul, oneDNN on packed weights), the faster
sets it: on CPUs where MKL runs AVX2 code only oneDNN shows the AVX-512 rate,
which the compiled steps' packed linear kernel runs at.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Callable

import torch

from model.attention.base import STATE_NUMBER_BYTES
from model.config import ModelConfig
from model.attention.classes import attention_class

from . import fma_peak

FP32 = STATE_NUMBER_BYTES  # the copy probe moves float32
# Datasheet peaks for one H100 SXM5 (NVIDIA): HBM3 bandwidth, dense BF16 tensor-core and FP32 rates.
H100 = {"name": "H100 SXM (datasheet)", "bytes_per_s": 3.35e12, "bf16_flops": 989e12, "fp32_flops": 67e12}


def _matrix_params(cfg: ModelConfig) -> int:
    """Weights of the per-token matrix products: attention projections, feed-forward, output head."""
    d = cfg.d_model
    projections = attention_class(cfg.attention).projections  # Reformer shares Q and K: 3
    return cfg.n_layers * (projections * d * d + 2 * d * cfg.d_ff) + d * cfg.vocab_out


def dense_flops(cfg: ModelConfig) -> int:
    return 2 * _matrix_params(cfg)


def attention_cost(cfg: ModelConfig, t: float, bytes_per_cached: int = FP32) -> tuple[float, float]:
    """(FLOPs, state bytes read + written) of all layers' attention for one token at position t,
    from the kind's own `token_cost` (model/attention/base.py); `bytes_per_cached`: a number of the
    cached keys and values of kinds that keep them in the cache dtype (softmax's cache, the hybrid's ring)."""
    kind = attention_class(cfg.attention)
    cost = kind.token_cost(cfg, t)
    state = cost.state_bytes
    if kind.kv_cache:
        cached = cost.state_bytes if cost.cached_bytes is None else cost.cached_bytes
        state -= cached * (1 - bytes_per_cached / FP32)
    return cfg.n_layers * cost.flops, cfg.n_layers * state


def weight_bytes(cfg: ModelConfig, bytes_per_weight: int = FP32) -> int:
    return _matrix_params(cfg) * bytes_per_weight


def token_cost(
    cfg: ModelConfig, t: float, batch: int, bytes_per_weight: int = FP32, bytes_per_cached: int = FP32
) -> dict:
    """Per generated token at position t in a batch of `batch` sequences; `bytes_per_cached`: a number of
    the KV cache (kinds' costs count float32 states)."""
    attn_flops, state_moved = attention_cost(cfg, t, bytes_per_cached)
    return {
        "position": t,
        "batch": batch,
        "flops": dense_flops(cfg) + attn_flops,
        "attention_flops": attn_flops,
        "state_bytes_moved": state_moved,
        "weight_bytes_per_token": weight_bytes(cfg, bytes_per_weight) / batch,
    }


def bound_tokens_per_s(cost: dict, bytes_per_s: float, flops_per_s: float) -> float:
    """Roofline: the slower of moving the bytes and doing the FLOPs."""
    moved = cost["state_bytes_moved"] + cost["weight_bytes_per_token"]
    return 1.0 / max(moved / bytes_per_s, cost["flops"] / flops_per_s)


ONEDNN = "oneDNN, packed weights"


def probe_machine(dtype: torch.dtype = torch.float32) -> dict:
    """Measured copy bandwidth (256 MiB, past any cache but L3) and the matmul rate in `dtype`, best of 3,
    current threads: the faster of the two routes a product can take here (see `product_routes`)."""
    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    copy_s = min(_time(lambda: dst.copy_(src)) for _ in range(3))
    a = torch.randn(1024, 1024, dtype=dtype)
    rates, skipped = {}, {}
    for route, product in product_routes(a, skipped).items():
        try:
            product()  # a first product pays for one-off setup
        except RuntimeError as exc:  # e.g. oneDNN's bfloat16 products on a CPU without AVX-512
            skipped[route] = _first_line(exc)
            continue
        rates[route] = 2 * 1024**3 / min(_time(product) for _ in range(3))
    best = max(rates, key=rates.get)
    return {
        "copy_bytes_per_s": 2 * src.numel() * FP32 / copy_s,
        "matmul_flops": rates[best],
        "matmul_route": best,
        "matmul_flops_by_route": rates,
        "matmul_routes_skipped": skipped,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "bytes_per_weight": a.element_size(),
        "threads": torch.get_num_threads(),
        **fma_peak_or_why(),
    }


@functools.cache
def _fma_peak_or_why() -> dict:
    try:
        return {"fma_peak": fma_peak.measure()}
    except fma_peak.ProbeUnavailable as exc:
        return {"fma_peak_skipped": _first_line(exc)}


def fma_peak_or_why() -> dict:
    """The core's FMA peak per vector width (benchmarks/fma_peak.py: CPUs of one class differ in the width of their
    units), measured once per process; or why it could not be (no compiler, not x86)."""
    return copy.deepcopy(_fma_peak_or_why())


def product_routes(a: torch.Tensor, skipped: dict[str, str] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """a @ a.T two ways: torch's matmul (MKL's BLAS on x86, which runs AVX2 code on AMD CPUs), and oneDNN on
    weights packed once (AVX-512 wherever the CPU has it). A route this CPU cannot take in a's dtype is left
    out, and why is put in `skipped`."""
    routes = {"torch.mm": lambda: a @ a.T}
    if torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(a, a.shape[0])
        except RuntimeError as exc:  # oneDNN packs bfloat16 weights only where the CPU has AVX-512
            if skipped is not None:
                skipped[ONEDNN] = _first_line(exc)
            return routes
        routes[ONEDNN] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    return routes


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def roofline(cfg: ModelConfig, image_tokens: int, batch: int, machine: dict, bytes_per_cached: int = FP32) -> dict:
    """Per-token cost at the mean position of a generation and the bounds it implies."""
    cost = token_cost(cfg, image_tokens / 2, batch, machine.get("bytes_per_weight", FP32), bytes_per_cached)
    h100 = bound_tokens_per_s(cost, H100["bytes_per_s"], H100["bf16_flops"])
    here = None  # only for a machine whose rates were measured (the CPU)
    if machine:
        here = bound_tokens_per_s(cost, machine["copy_bytes_per_s"], machine["matmul_flops"])
    return cost | {
        "bound_tokens_per_s_here": here,
        "bound_images_per_s_here": None if here is None else here / image_tokens,
        "bound_tokens_per_s_h100": h100,
        "bound_images_per_s_h100": h100 / image_tokens,
    }
