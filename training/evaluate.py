"""`rnnserve eval`: MNIST bits/dim on the test set, or text validation loss.

bits/dim is the mean of -log2 p(pixel) over every pixel of the test images,
read exactly off the model's 256-way logits. Text loss is the mean -ln p(byte)
over the validation split (last 10% of the file), cut into non-overlapping
windows of the model's max_len, each starting from BOS. With --completions
it evaluates completions of occluded test digits instead (training/completions.py); with --attention-share, a
hybrid model's linear share of its attention, per layer and head (training/attention_share.py).
With --store a result is merged into the file's info["eval"], keeping the others.
A training checkpoint (.ckpt) is scored as the model its run would save now (training/loading.py).
The flags are defined in training/arguments.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model import Transformer
from model.io.vocabulary import Vocabulary, vocabulary_for
from model.io.weights import WeightsError, read_metadata, update_info

from .attention_share import attention_share, check_hybrid, format_share
from .completions import DEFAULT_BATCH, CompletionRun, EvalParts, choose_occlusion, evaluate_completions
from .completions import print_table as print_completions
from .completions import store_result
from .data import DataError, load_mnist, load_text
from .loading import is_checkpoint, load_evaluated, stored_tokenizer

TASK_DATA = {"mnist": "a folder with t10k-images-idx3-ubyte[.gz] (or that file)", "text": "a UTF-8 text file"}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise DataError("--device cuda: no CUDA GPU is visible to torch; use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def sum_nll(model: Transformer, tokens: torch.Tensor) -> float:
    """Sum of -ln p(tokens) over a (B, T) batch, each row predicted from BOS."""
    return float(-model.token_log_probs(tokens).double().sum())


def _batches(rows: torch.Tensor, batch_size: int, show_progress: bool, what: str):
    starts = range(0, rows.shape[0], batch_size)
    for start in tqdm(starts, desc=what, disable=not show_progress, mininterval=2.0):
        yield rows[start : start + batch_size]


@torch.inference_mode()
def evaluate_mnist(
    model: Transformer, images: torch.Tensor, batch_size: int = 32, show_progress: bool = False
) -> dict[str, Any]:
    """images (N, 784) uint8 -> bits/dim and nats/dim over all N*784 pixels."""
    total = 0.0
    for batch in _batches(images, batch_size, show_progress, "eval images"):
        total += sum_nll(model, batch.long().to(model.device))
    nats = total / images.numel()
    return {
        "metric": "bits/dim",
        "bits_per_dim": nats / math.log(2),
        "nats_per_dim": nats,
        "images": int(images.shape[0]),
    }


def text_windows(data: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) bytes -> full windows (W, length) and the leftover tail (R,)."""
    full = data.shape[0] // length
    return data[: full * length].view(full, length), data[full * length :]


@torch.inference_mode()
def evaluate_text(
    model: Transformer,
    valid: torch.Tensor,
    batch_size: int = 32,
    limit: int | None = None,
    show_progress: bool = False,
    vocabulary: Vocabulary | None = None,
) -> dict[str, Any]:
    """Mean -ln p over the validation text (or the first `limit` windows) per byte of text: for a model with a
    tokenizer (`vocabulary`), its tokens' loss spread over the bytes they stand for, so models compare."""
    windows, tail = text_windows(valid, model.config.max_len)
    if limit is not None:
        windows, tail = windows[:limit], tail[:0]
    total = 0.0
    for batch in _batches(windows, batch_size, show_progress, "eval windows"):
        total += sum_nll(model, batch.long().to(model.device))
    if tail.numel():
        total += sum_nll(model, tail[None].long().to(model.device))
    tokens = windows.numel() + tail.numel()
    if vocabulary is None or vocabulary.is_bytes:
        nats = total / tokens
        return {"metric": "val loss", "loss_nats_per_byte": nats, "bits_per_byte": nats / math.log(2), "bytes": tokens}
    lengths = [len(piece) for piece in vocabulary.pieces]
    count = sum(lengths[t] for t in torch.cat([windows.flatten(), tail]).tolist())
    nats = total / count
    return {
        "metric": "val loss",
        "loss_nats_per_byte": nats,
        "bits_per_byte": nats / math.log(2),
        "bytes": count,
        "loss_nats_per_token": total / tokens,
        "perplexity": math.exp(total / tokens),  # per token, as Hugging Face's and lm-eval's reports give it
        "tokens": tokens,
        "tokenizer": vocabulary.name,
    }


def evaluate_file(
    path: str | Path,
    data: str | Path,
    device: torch.device,
    limit: int | None = None,
    batch_size: int = 32,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Load a weights file or checkpoint (float32 compute) and evaluate it on its task's held-out data."""
    model, checkpoint = load_evaluated(path, device)
    try:
        result = _evaluate_on_task(model, data, limit, batch_size, show_progress, stored_tokenizer(path))
    except DataError as exc:  # say which kind of data this model needed
        raise DataError(
            f"{path} is a {model.config.task} model, so --data must be {TASK_DATA[model.config.task]}: {exc}"
        ) from exc
    result.update(attention=model.config.attention, task=model.config.task, parameters=model.num_parameters())
    if checkpoint is not None:
        result["checkpoint"] = checkpoint
    return result


def _evaluate_on_task(
    model: Transformer,
    data: str | Path,
    limit: int | None,
    batch_size: int,
    show_progress: bool,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    if model.config.task == "mnist":
        split = load_mnist(data, "test")
        result = evaluate_mnist(model, split.images[:limit] if limit else split.images, batch_size, show_progress)
        result["data"] = split.path + (f" (first {limit} images)" if limit else "")
    else:
        vocabulary = vocabulary_for(model.config, tokenizer)
        splits = load_text(data, None if vocabulary.is_bytes else vocabulary.encode)
        result = evaluate_text(model, splits.valid, batch_size, limit, show_progress, vocabulary)
        result["data"] = f"{data} (last 10%)" + (f", first {limit} windows" if limit else "")
    return result


def format_metric(result: dict[str, Any]) -> str:
    if result["metric"] == "bits/dim":
        text = f"{result['bits_per_dim']:.4f} bits/dim over {result['images']} images"
    else:
        text = (
            f"{result['loss_nats_per_byte']:.4f} nats/byte ({result['bits_per_byte']:.4f} bits/byte) "
            f"over {result['bytes']} bytes"
        )
        if "loss_nats_per_token" in result:  # a tokenizer's model: per token too, the figure its peers report
            text += f"; {result['loss_nats_per_token']:.4f} nats/token, perplexity {result['perplexity']:.2f}"
    checkpoint = result.get("checkpoint")
    return text + (f" (step {checkpoint['step']:,}, {checkpoint['weights']})" if checkpoint else "")


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    width = max(len(str(name)) for name, _ in rows)
    print(f"{'model':<{width}}  {'attention':<9}  {'params':>9}  result")
    for name, result in rows:
        print(f"{str(name):<{width}}  {result['attention']:<9}  {result['parameters']:>9,}  {format_metric(result)}")


def run(args: argparse.Namespace, parts: EvalParts = EvalParts()) -> int:
    try:
        check_args(args)
        device = resolve_device(args.device)
        if args.completions:
            return run_completions(args, device, parts)
        if args.attention_share:
            return run_attention_share(args, device)
        rows = [
            (
                m,
                evaluate_file(
                    m,
                    args.data,
                    device,
                    args.limit,
                    args.batch_size or 32,
                    show_progress=not args.no_progress and not args.json,
                ),
            )
            for m in args.models
        ]
        if args.store:
            for path, result in rows:
                store_eval(path, result)
    except (DataError, WeightsError) as exc:
        print(f"rnnserve eval: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({name: result for name, result in rows}, indent=2))
    else:
        print_table(rows)
    return 0


def check_args(args: argparse.Namespace) -> None:
    """Flag values and combinations, before any file is read; sets the thread count."""
    for flag in ("limit", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise DataError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.threads is not None:
        if args.threads < 1:
            raise DataError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.attention_share and args.completions:
        raise DataError("--attention-share measures the models' attention on the test data; drop --completions")
    if not args.completions:
        given = [flag for flag in ("occlusion", "mask", "particles") if getattr(args, flag) is not None]
        if given:
            raise DataError(f"--{given[0]} only applies with --completions")
    elif args.occlusion is not None and args.mask is not None:
        raise DataError("give either --occlusion or --mask, not both")
    elif args.temperature < 0:
        raise DataError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    elif args.particles is not None and not 1 <= args.particles <= 256:
        raise DataError(f"--particles must be in 1..256, got {args.particles}")
    checkpoints = [m for m in args.models if is_checkpoint(m)]
    if args.store and checkpoints:
        raise DataError(
            f"--store writes into a .safetensors file's metadata; {checkpoints[0]} is a training "
            "checkpoint (evaluate it without --store)"
        )


def store_eval(path: str | Path, result: dict[str, Any]) -> None:
    """Merge a bits/dim or loss result into info["eval"], keeping stored completion results."""
    _, info = read_metadata(path)
    update_info(path, {"eval": {**(info.get("eval") or {}), **result}})


def run_completions(args: argparse.Namespace, device: torch.device, parts: EvalParts) -> int:
    """`eval --completions`: every model on the same digits, occlusion and seed."""
    run = CompletionRun(
        args.data,
        args.classifier,
        choose_occlusion(args.occlusion, args.mask, parts.read_mask),
        args.limit,
        args.seed,
        args.temperature,
        args.batch_size or DEFAULT_BATCH,
        show_progress=not args.no_progress and not args.json,
        particles=args.particles,
        complete_with_particles=parts.complete_with_particles,
    )
    rows = [(m, evaluate_completions(m, run, device)) for m in args.models]
    if args.store:
        for path, result in rows:
            store_result(path, result)
    if args.json:
        print(json.dumps({name: result.as_dict() for name, result in rows}, indent=2))
    else:
        print_completions(rows)
    return 0


def task_rows(model: Transformer, data: str | Path, tokenizer: str | None) -> torch.Tensor:
    """The held-out rows a model is scored on: MNIST test images (N, 784), or validation windows (N, max_len)."""
    if model.config.task == "mnist":
        return load_mnist(data, "test").images
    vocabulary = vocabulary_for(model.config, tokenizer)
    valid = load_text(data, None if vocabulary.is_bytes else vocabulary.encode).valid
    return text_windows(valid, model.config.max_len)[0]


def run_attention_share(args: argparse.Namespace, device: torch.device) -> int:
    """`eval --attention-share`: each hybrid model's linear share, per layer and head, on its task's held-out rows."""
    results = {}
    for path in args.models:
        model, _ = load_evaluated(path, device)
        try:
            check_hybrid(model, str(path))
        except ValueError as exc:
            raise DataError(str(exc)) from exc
        rows = task_rows(model, args.data, stored_tokenizer(path))[: args.limit]
        batches = _batches(rows, args.batch_size or 8, not args.no_progress and not args.json, "attention share")
        results[str(path)] = attention_share(model, batches)
        if args.store:
            store_eval(path, {"attention_share": results[str(path)]})
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for path, result in results.items():
        print("\n".join([path, *format_share(result), ""]))
    return 0
