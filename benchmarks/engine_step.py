"""An engine's throughput on shipped models, in process: what a change to the step's host work costs.

    python -m benchmarks.engine_step [--weights weights] [--rounds 3] [--threads 1]

Runs a real `Engine` thread (eager decode steps: no compile, so the step's host work is not hidden behind a
compile's timing) on weights/shakespeare-linear.safetensors and weights/mnist-linear.safetensors, one fixed
workload each round:
- text, streamed: 8 requests of a 16-byte prompt, 2 samples each, 48 tokens, every token an event (one step a pass);
- text, whole: the same requests answered whole (multi-step passes of up to --scheduler-steps);
- image: 16 whole images (784 pixels each, one particle, as the image route sends them).
Prints one JSON line per round: each workload's tokens a second of wall time, and of this process's CPU time
(`_cpu`: what the engine's work costs, less moved by other processes on a busy machine than the wall time). For an
A/B, run it from two checkouts in turns: the figures move with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from model.decode.sampling import SamplingParams
from model.io.weights import load_model
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.types import GenerationRequest

PROMPT = list(b"To be, or not to")  # 16 bytes


def text_requests(count: int, tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"t{i}", PROMPT, tokens, SamplingParams(seed=i), n=2) for i in range(count)]


def image_requests(count: int, pixels: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"i{i}", [], pixels, SamplingParams(seed=i), particles=1) for i in range(count)]


def tokens_per_second(engine: Engine, requests: list[GenerationRequest], each_event: bool) -> tuple[float, float]:
    """Submit every request at once, wait for every answer: tokens drawn over wall seconds, and over CPU seconds."""

    async def run() -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        streams = [engine.submit(r, each_event=each_event) for r in requests]
        events = [[e async for e in s] for s in streams]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        drawn = sum(len(getattr(e, "tokens", [None])) for es in events for e in es)
        assert drawn == sum(r.max_new_tokens * r.n for r in requests), drawn  # no stop sequences: every token
        return drawn / seconds, drawn / cpu_seconds

    return asyncio.run(run())


def started_engine(path: Path, threads: int, max_batch: int) -> Engine:
    model, info = load_model(path)
    limits = EngineLimits(max_batch=max_batch, max_waiting=64, cuda_graphs=False, compile_decode=False)
    engine = Engine(path.stem, model, info, limits, LocalOutput(), threads=threads)
    engine.start()
    return engine


def one_round(weights: Path, threads: int) -> dict[str, float]:
    figures: dict[str, tuple[float, float]] = {}
    text = started_engine(weights / "shakespeare-linear.safetensors", threads, max_batch=16)
    try:
        figures["text_streamed"] = tokens_per_second(text, text_requests(8, 48), each_event=True)
        figures["text_whole"] = tokens_per_second(text, text_requests(8, 48), each_event=False)
    finally:
        text.stop()
    images = started_engine(weights / "mnist-linear.safetensors", threads, max_batch=16)
    try:
        figures["image"] = tokens_per_second(images, image_requests(16, 784), each_event=False)
    finally:
        images.stop()
    wall = {name: round(value[0], 1) for name, value in figures.items()}
    return wall | {f"{name}_cpu": round(value[1], 1) for name, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="", help="a name for this checkout in the output")
    args = parser.parse_args()
    for _ in range(args.rounds):
        print(json.dumps({"label": args.label, **one_round(args.weights, args.threads)}), flush=True)


if __name__ == "__main__":
    main()
