"""What a bfloat16 KV cache costs in quality: bits/dim of MNIST test images read through the cache.

    python -m benchmarks.kv_cache_quality --weights weights/mnist-softmax.safetensors \
        --data ../shared/data/mnist [--images 2000] [--json-out FILE]

`rnnserve eval` scores images in one parallel pass, which keeps no cache; here every image is fed through a
decode state in chunks (as a prefill is), so each position attends to keys and values as the cache stores them:
once with the cache in the model's dtype, once in bfloat16 (`--kv-cache-dtype bfloat16`). The same images, the
same model: the difference is the cache's rounding alone.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from model.transformer import Transformer, with_bos
from model.io.weights import load_model
from training.data import load_mnist

CHUNK = 112  # positions a call: bounds the (T, L) attention masks of a chunk


@torch.inference_mode()
def bits_per_dim_through_cache(model: Transformer, images: torch.Tensor, batch: int = 100) -> float:
    """Mean -log2 p(pixel) over `images` (N, 784), each image fed through a fresh decode state chunk by chunk."""
    nats = 0.0
    for start in range(0, images.shape[0], batch):
        pixels = images[start : start + batch]
        inputs, state = with_bos(pixels, model.config.bos), model.new_state(pixels.shape[0])  # (B, 784) from BOS
        logits = torch.cat([model(inputs[:, c : c + CHUNK], state)[0] for c in range(0, inputs.shape[1], CHUNK)], 1)
        nats -= float(logits.float().log_softmax(-1).gather(-1, pixels[..., None]).double().sum())
    return nats / images.numel() / math.log(2)


def measure(weights: Path, data: Path, count: int) -> dict:
    model, _ = load_model(weights, "cpu")
    if model.config.task != "mnist" or model.cache_dtype() is None:
        raise SystemExit(f"{weights}: expected an MNIST softmax model (the kind whose cache takes --kv-cache-dtype)")
    images = load_mnist(data, "test").images[:count].long()
    result = {"weights": str(weights), "attention": model.config.attention, "images": int(images.shape[0])}
    for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        model.kv_cache_dtype = dtype
        result[f"bits_per_dim_{name}_cache"] = bits_per_dim_through_cache(model.eval(), images)
    result["difference"] = result["bits_per_dim_bfloat16_cache"] - result["bits_per_dim_float32_cache"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache_quality", description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, required=True, help="an MNIST softmax model's .safetensors")
    parser.add_argument("--data", type=Path, required=True, help="the MNIST folder (its t10k images)")
    parser.add_argument("--images", type=int, default=2000, help="test images scored (the first N)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.weights, args.data, args.images)
    print(
        f"{result['attention']}, {result['images']} test images: {result['bits_per_dim_float32_cache']:.5f} bits/dim "
        f"with a float32 cache, {result['bits_per_dim_bfloat16_cache']:.5f} with a bfloat16 one "
        f"({result['difference']:+.5f})"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
