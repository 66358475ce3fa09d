"""`rnnserve build-kernels`: everything the CPU decode path compiles, built ahead of serving.

A server compiles nothing beside its requests: it loads the C++ kernels built here (model/kernels/loader.py) and
compiles its decode steps in the background, which finds what is compiled here in inductor's cache, so no C++
compiler runs once it serves. `make install` and the container build run this; without it a server still
serves, with PyTorch's operators in place of the kernels (logged once).

With `--weights DIR` (default: weights/, when there) each compilable model's decode steps and sampling are
compiled as a server with default settings compiles them: the same rows (--max-batch) and the same intra-op
threads (an equal share of this machine's CPUs among the models, as the server gives), so a server started
with other --max-batch, --threads or --kv-cache-dtype compiles those graphs itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEFAULT_WEIGHTS = Path("weights")
DEFAULT_ROWS = 64  # the server's --max-batch default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        type=Path,
        metavar="DIR",
        help="also compile the decode steps of every .safetensors model in DIR (default: weights/ when it exists)",
    )
    parser.add_argument("--no-models", action="store_true", help="build the C++ kernels only")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_ROWS,
        help=f"rows the server will decode together, as its --max-batch (default {DEFAULT_ROWS})",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the numbers softmax models will cache keys and values in, as the server's flag (default auto)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from model.kernels.loader import load_kernels

    kernels = load_kernels(build=True)
    if not kernels.ok:
        print(
            f"rnnserve build-kernels: the C++ kernels did not build ({kernels.error}); a server will decode with "
            "PyTorch's operators. Install a C++ compiler (Debian: g++) and run this again.",
            file=sys.stderr,
        )
        return 1
    paths = [] if args.no_models else model_files(args.weights)
    if paths is None:
        print(f"rnnserve build-kernels: --weights {args.weights} is not a directory", file=sys.stderr)
        return 2
    failed = [path for path in compile_models(paths, args.max_batch, args.kv_cache_dtype) if path is not None]
    for path in failed:
        print(
            f"rnnserve build-kernels: compiling {path}'s decode steps failed (see above); a server will compile "
            "them in the background, or decode it eagerly",
            file=sys.stderr,
        )
    return 1 if failed else 0


def model_files(weights: Path | None) -> list[Path] | None:
    if weights is None:
        return sorted(DEFAULT_WEIGHTS.glob("*.safetensors")) if DEFAULT_WEIGHTS.is_dir() else []
    return sorted(weights.glob("*.safetensors")) if weights.is_dir() else None


def compile_models(paths: list[Path], rows: int, kv_cache_dtype: str = "auto") -> list[Path | None]:
    """Compile each compilable model's decode steps with the thread count a server of these models gives it;
    the paths whose compile failed (None for the others)."""
    import torch

    from model.io.weights import load_model

    from server.engine.cpu_budget import usable_cpus  # the server's budget, so the graphs match the server's threads
    from server.engine.pool import model_bytes, worker_layout

    from server.settings import kv_cache_torch_dtype

    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype)  # as the server reads its flag
    [share, *_] = usable_cpus().engine_threads(len(paths)) or [1]
    outcomes = []
    for path in paths:
        # Each model as a fresh process compiles it, as a server's engine process does: dynamo would otherwise
        # trace the second model's steps as a recompile of the first's (more of their sizes symbolic), and
        # cache graphs that no server asks for.
        torch._dynamo.reset()
        model, _ = load_model(path)
        torch.set_num_threads(worker_layout(model_bytes(model), share, None, cpu_processes=True).threads)  # a worker's
        model.kv_cache_dtype = cache_dtype
        outcomes.append(None if compile_decode_steps(model, rows, path.stem) else path)
    return outcomes


def compile_decode_steps(model, rows: int, name: str) -> bool:
    """Compile as a server's engine does (model/decode/compiled/decoder.py), here and now; False if it failed."""
    from model.decode.compiled.decoder import compile_fresh

    if not model.capabilities.compilable:
        return True
    started = time.perf_counter()
    compiled = compile_fresh(model, rows)  # kernels were built above, so build=False finds them
    print(
        f"rnnserve build-kernels: {name} ({model.config.attention}) decode steps compiled in "
        f"{time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return compiled.error is None
