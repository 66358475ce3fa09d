"""The softmax decode kernel against the memory it has to read: GB/s of cached keys and values.

    python -m benchmarks.softmax_kernel [--position 417] [--layers 4] [--json-out FILE]

A 64-row decode step's attention reads every visible cached key and value once, so it is bound by how fast one
core streams memory. This times `torch.ops.rnnserve.softmax_decode_attention` on the `cpu` preset's shapes (64
rows, 4 heads, head size 32, a 785-position cache) over `--layers` caches called in turn, as a step calls one
per layer, so that together they do not fit in the last-level cache, and `torch.sum` over the same visible
bytes: the rate one core reads memory at here; and the kernel over the same caches in bfloat16 (`--kv-cache-dtype
bfloat16`: half the bytes). One thread, best of several rounds taking turns. The kernel's output is checked against
PyTorch's attention first (a bfloat16 cache against PyTorch's on its float32 widening), so a fast wrong kernel
cannot pass for a fast one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model.kernels.loader import cpu_route, load_kernels
from model.kernels.cpu_features import read_cpu_features
from model.attention.softmax import attend_one_query

from .decode_environment import measured_class, vector_caps

ROWS, HEADS, HEAD_SIZE, CACHE = 64, 4, 32, 785
ROUNDS = 5


def best_seconds(*fns, repeats: int = 5) -> list[float]:
    """Seconds a call of each, best of ROUNDS rounds in which they take turns (this machine's memory speed drifts)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(ROUNDS):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / repeats)
    return best


def reference_attention(q, k, v, last) -> torch.Tensor:
    """(B, H, 1, D) softmax attention of each row over its positions [0, last], as the eager decode path does."""
    visible = (torch.arange(k.shape[2]) <= last[:, None])[:, None, None]  # (B, 1, 1, L)
    return attend_one_query(q, k, v, visible)


def kernel_error(attention, q, k, v, last) -> float:
    return (attention(q, k, v, last) - reference_attention(q, k.float(), v.float(), last)).abs().max().item()


def measure(position: int, layers: int) -> dict:
    build = load_kernels()
    if not build.ok:
        raise SystemExit(f"the CPU kernels did not build here: {build.error}")
    torch.manual_seed(0)
    caches = [tuple(torch.randn(ROWS, HEADS, n, HEAD_SIZE) for n in (1, CACHE, CACHE)) for _ in range(layers)]
    last = torch.full((ROWS,), position)
    attention = torch.ops.rnnserve.softmax_decode_attention
    halves = [(q, k.bfloat16(), v.bfloat16()) for q, k, v in caches]
    error = max(kernel_error(attention, *layer[0], last) for layer in (caches, halves))
    if error > 1e-4:
        raise SystemExit(f"the kernel's attention is {error:.2e} from PyTorch's: not timing a wrong result")
    visible = [(k[:, :, : position + 1].contiguous(), v[:, :, : position + 1].contiguous()) for _, k, v in caches]
    nbytes = sum(k.numel() + v.numel() for k, v in visible) * 4
    kernel, stream, half = best_seconds(
        lambda: [attention(q, k, v, last) for q, k, v in caches],
        lambda: [(k.sum(), v.sum()) for k, v in visible],
        lambda: [attention(q, k, v, last) for q, k, v in halves],
    )
    route = cpu_route()
    return {
        "cpu_class": measured_class(read_cpu_features().cpu_class, route),
        "vector_caps": vector_caps(),
        "cpu_route": route,
        "position": position,
        "layers": layers,
        "bytes_per_step": nbytes,
        "kernel_ms_per_layer": kernel / layers * 1e3,
        "kernel_gb_per_s": nbytes / kernel / 1e9,
        "stream_gb_per_s": nbytes / stream / 1e9,
        "kernel_of_stream": stream / kernel,
        "bfloat16_kernel_ms_per_layer": half / layers * 1e3,
        "bfloat16_speedup": kernel / half,
        "max_error": error,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.softmax_kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--position", type=int, default=417, help="each row's last visible position (< 785)")
    parser.add_argument("--layers", type=int, default=4, help="caches called in turn, one per layer")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if not 0 <= args.position < CACHE or args.layers < 1:
        parser.error(f"--position must be in [0, {CACHE}) and --layers at least 1")
    torch.set_num_threads(1)
    with torch.inference_mode():
        result = measure(args.position, args.layers)
    print(
        f"{result['cpu_class']} ({result['cpu_route']} route), position {args.position}, {args.layers} layers: "
        f"kernel {result['kernel_ms_per_layer']:.3f} ms a layer, {result['kernel_gb_per_s']:.1f} GB/s; torch.sum "
        f"over the same bytes {result['stream_gb_per_s']:.1f} GB/s; the kernel at {result['kernel_of_stream']:.0%}; "
        f"over a bfloat16 cache {result['bfloat16_kernel_ms_per_layer']:.3f} ms a layer, "
        f"{result['bfloat16_speedup']:.2f}x the float32 cache's speed"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
