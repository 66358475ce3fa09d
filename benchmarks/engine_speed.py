"""In-process engine throughput against `model.generate` on the same model, one run.

    python -m benchmarks.engine_speed [--kind linear] [--batch 64] [--tokens 784] [--rounds 3]

Submits `batch` empty-prompt requests (whole images) to a real `Engine` thread,
non-streamed, and times until every result is in; then times `generate` on the
same batch. Rounds alternate engine and generate, and the ratio of their medians
is printed: how much the engine's bookkeeping costs over the bare decode loop.
No HTTP; random weights of the CPU preset; 1 thread unless --threads.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from model.generate import generate
from model.sampling import BatchSampling, SamplingParams
from model.transformer import build_model
from server.engine import Engine, EngineLimits
from server.metrics import Metrics
from server.types import GenerationRequest

from .decode import preset_config


def engine_seconds(engine: Engine, batch: int, tokens: int) -> float:
    requests = [GenerationRequest(f"r{i}", [], tokens, SamplingParams(seed=i)) for i in range(batch)]

    async def run() -> float:
        start = time.perf_counter()
        streams = [engine.submit(r, each_event=False) for r in requests]
        results = [[r async for r in s] for s in streams]
        assert sum(len(r.tokens) for rs in results for r in rs) == batch * tokens
        return time.perf_counter() - start

    return asyncio.run(run())


def generate_seconds(model, batch: int, tokens: int) -> float:
    sampling = BatchSampling.from_params([SamplingParams(seed=i) for i in range(batch)])
    start = time.perf_counter()
    out = generate(model, torch.zeros(batch, 0, dtype=torch.long), tokens, sampling)
    assert out.shape == (batch, tokens)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="linear")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=784)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", args.kind)).eval()
    limits = EngineLimits(max_batch=args.batch, max_waiting=args.batch, compile_decode=True)  # as the server
    engine = Engine("bench", model, {}, limits, Metrics())
    engine.start()
    engine.runner.decoder.wait_compiled()  # the server compiles in the background; time the compiled steps
    timings: dict[str, list[float]] = {"engine": [], "generate": []}
    try:
        for _ in range(args.rounds):
            timings["engine"].append(engine_seconds(engine, args.batch, args.tokens))
            timings["generate"].append(generate_seconds(model, args.batch, args.tokens))
    finally:
        engine.stop()
    tokens = args.batch * args.tokens
    for name, seconds in timings.items():
        print(f"{name:9s} tokens/s per round: {', '.join(f'{tokens / s:,.0f}' for s in seconds)}")
    ratio = statistics.median(timings["generate"]) / statistics.median(timings["engine"])
    print(f"engine / generate throughput (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
