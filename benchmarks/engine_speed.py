"""In-process engine throughput against `model.decode.generate` on the same model, one run.

    python -m benchmarks.engine_speed [--kind linear] [--batch 64] [--tokens 784] [--rounds 3] [--penalties]

Submits `batch` empty-prompt requests (whole images) to a real `Engine` thread,
non-streamed, and times until every result is in; then times `generate` on the
same batch. Rounds alternate engine and generate, and the ratio of their medians
is printed: how much the engine's bookkeeping costs over the bare decode loop.
No HTTP; random weights of the CPU preset; 1 thread unless --threads.

--penalties times the engine alone, in turns, with no row adjusting its logits, with one row
using frequency and presence penalties and a logit bias, and with every row using them: what
the per-row adjustment costs, and that rows without it pay nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import build_model
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.metrics import Metrics
from server.engine.types import GenerationRequest

from .decode_models import preset_config


ADJUSTING = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {0: -2.0, 255: 1.5}}
PENALTY_CASES = {"no row": 0, "one row": 1, "every row": None}  # rows that adjust their logits (None: all)


def sampling(i: int, adjusts: bool) -> SamplingParams:
    return SamplingParams(seed=i, **(ADJUSTING if adjusts else {}))


def engine_seconds(engine: Engine, batch: int, tokens: int, adjusting_rows: int = 0) -> float:
    # As the image route sends a whole image: an empty prompt and one particle, with nothing to weigh.
    requests = [
        GenerationRequest(f"r{i}", [], tokens, sampling(i, i < adjusting_rows), particles=1) for i in range(batch)
    ]

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


def penalty_rounds(engine: Engine, batch: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {name: [] for name in PENALTY_CASES}
    for _ in range(rounds):
        for name, rows in PENALTY_CASES.items():
            timings[name].append(engine_seconds(engine, batch, tokens, batch if rows is None else rows))
    return timings


def compare_rounds(engine: Engine, model, batch: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"engine": [], "generate": []}
    for _ in range(rounds):
        timings["engine"].append(engine_seconds(engine, batch, tokens))
        timings["generate"].append(generate_seconds(model, batch, tokens))
    return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="linear")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=784)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--penalties", action="store_true", help="time rows with penalties and logit bias instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", args.kind)).eval()
    limits = EngineLimits(max_batch=args.batch, max_waiting=args.batch, compile_decode=True)  # as the server
    engine = Engine("bench", model, {}, limits, LocalOutput.recording(Metrics(), "bench", model))
    engine.start()
    engine.runner.decoder.wait_compiled()  # the server compiles in the background; time the compiled steps
    engine_seconds(engine, args.batch, min(args.tokens, 32))  # warm-up, not timed: first calls of every path
    try:
        if args.penalties:
            timings = penalty_rounds(engine, args.batch, args.tokens, args.rounds)
        else:
            timings = compare_rounds(engine, model, args.batch, args.tokens, args.rounds)
    finally:
        engine.stop()
    tokens = args.batch * args.tokens
    for name, seconds in timings.items():
        print(f"{name:9s} tokens/s per round: {', '.join(f'{tokens / s:,.0f}' for s in seconds)}")
    base, *others = timings
    for other in others:
        ratio = statistics.median(timings[other]) / statistics.median(timings[base])
        print(f"{base} / {other} throughput (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
