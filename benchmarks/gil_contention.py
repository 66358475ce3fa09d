"""What a busy neighbour thread costs the server's decode loop, split into the GIL and the CPU.

    python -m benchmarks.gil_contention [--kind linear] [--batch 64] [--duty 0.05] [--rounds 5] [--steps 300] [--engine]

The server runs its engine on a worker thread beside the event loop, in one process. This times
compiled decode steps (model/decode/compiled/decoder.py, the server's path) on a worker thread, or with
--engine a real `Engine` generating `--batch` whole images (its scheduling and sampling included,
submitted from asyncio as the image handler does; time per decode step), in turns:
  * alone;
  * beside a thread that is busy `--duty` of the time, in bursts of 1 ms, on work that releases the
    GIL (SHA-256 of a 64 KB buffer): what sharing the machine's cores costs;
  * beside the same duty of pure Python, which holds the GIL while it runs, as the event loop's
    request handling does: what sharing the GIL costs on top.
A compiled step releases the GIL for its C++ part, but takes it back between steps and, inside
the step, to drop its references to input tensors that Python also holds, so each of those waits
for a neighbour that holds the GIL. Medians of the rounds, milliseconds per step, one torch thread.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time
from typing import Callable

import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.kernels.threads import adopt_process_threads
from model.transformer import Transformer, build_model
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput

from .decode_models import preset_config
from .engine_speed import engine_seconds

NEIGHBOURS = ("alone", "CPU work, GIL released", "Python, GIL held")
BURST_S = 0.001
HASHED_BYTES = 1 << 16  # hashlib releases the GIL for buffers over 2 KB


def _burst(holds_gil: bool, buffer: bytes) -> None:
    end = time.perf_counter() + BURST_S
    while time.perf_counter() < end:
        if holds_gil:
            sum(range(200))
        else:
            hashlib.sha256(buffer).digest()


def _neighbour(stop: threading.Event, holds_gil: bool, duty: float) -> None:
    pause, buffer = BURST_S / duty - BURST_S, bytes(HASHED_BYTES)
    while not stop.is_set():
        _burst(holds_gil, buffer)
        time.sleep(pause)


def _time_steps(decoder: CompiledDecoder, tokens: torch.Tensor, steps: int) -> float:
    """Milliseconds per step of `steps` steps from an empty state, on a new thread (as the engine's)."""
    result: list[float] = []

    def run() -> None:
        adopt_process_threads()
        with torch.inference_mode():
            decoder.state.reset_rows(range(tokens.shape[0]))
            start = time.perf_counter()
            for _ in range(steps):
                decoder(tokens)
            result.append((time.perf_counter() - start) / steps * 1e3)

    worker = threading.Thread(target=run, name="decode")
    worker.start()
    worker.join()
    return result[0]


def _one_round(timed: Callable[[], float], duty: float) -> dict[str, float]:
    """`timed()` (milliseconds per step) alone and beside each busy neighbour."""
    times = {}
    for name in NEIGHBOURS:
        stop = threading.Event()
        neighbour = None
        if name != "alone":
            neighbour = threading.Thread(target=_neighbour, args=(stop, name.startswith("Python"), duty), daemon=True)
            neighbour.start()
        times[name] = timed()
        stop.set()
        if neighbour is not None:
            neighbour.join()
    return times


def _decoder_timer(model: Transformer, batch: int, steps: int) -> Callable[[], float]:
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(batch))
        log = decoder.compile_now(batch=batch)
    if log.error is not None:
        raise SystemExit(f"could not compile the {model.config.attention} decode step: {log.error}")
    tokens = torch.randint(0, model.config.vocab_out, (batch,))
    return lambda: _time_steps(decoder, tokens, steps)


def _engine_timer(model: Transformer, batch: int, steps: int) -> tuple[Engine, Callable[[], float]]:
    engine = Engine(
        "bench", model, {}, EngineLimits(max_batch=batch, max_waiting=batch, compile_decode=True), LocalOutput()
    )
    engine.start()
    engine.wait_compiled()
    engine_seconds(engine, batch, 16)  # warm-up: first calls of every path
    return engine, lambda: engine_seconds(engine, batch, steps) / steps * 1e3


def measure(kind: str, batch: int, duty: float, rounds: int, steps: int, engine: bool = False) -> dict[str, float]:
    """Median milliseconds per compiled step beside each neighbour (steps must stay within max_len)."""
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", kind)).eval()
    running = None
    if engine:
        running, timed = _engine_timer(model, batch, steps)
    else:
        timed = _decoder_timer(model, batch, steps)
    try:
        runs = [_one_round(timed, duty) for _ in range(rounds)]
    finally:
        if running is not None:
            running.stop()
    return {name: statistics.median(run[name] for run in runs) for name in NEIGHBOURS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="linear", choices=("softmax", "linear", "linformer"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--duty", type=float, default=0.05, help="share of the time the neighbour is busy, in (0, 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="steps per timing, at most the model's 784 positions")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", action="store_true", help="time a real Engine generating whole images instead")
    args = parser.parse_args(argv)
    if not 0 < args.duty < 1:
        parser.error(f"--duty must be in (0, 1), got {args.duty}")
    if not 0 < args.steps <= 784:
        parser.error(f"--steps must be in [1, 784] (the preset's positions), got {args.steps}")
    torch.set_num_threads(args.threads)
    times = measure(args.kind, args.batch, args.duty, args.rounds, args.steps, args.engine)
    alone = times["alone"]
    what = "the engine" if args.engine else "compiled decode steps"
    print(
        f"{args.kind}, batch {args.batch}, {what}, neighbour busy {args.duty:.0%} of the time in 1 ms bursts; "
        f"median of {args.rounds} rounds of {args.steps} steps"
    )
    for name, ms in times.items():
        print(f"  {name:24s} {ms:.3f} ms/step  ({ms / alone:.2f}x alone)")


if __name__ == "__main__":
    main()
