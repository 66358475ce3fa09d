"""Compiled steps of many rows on a graph traced for many rows, against the 2-row graph: ms per step and draw.

    python -m benchmarks.row_classes [--kinds linear] [--rows 32,48,64] [--threads 2] [--json-out FILE]

Inductor splits a fused loop over threads only where the work it sees when tracing pays for it, and a graph
traced on 2 rows shows it little work: most loops stay on one thread (model/decode/compiled/decoder.py). This builds two
compiled decoders of 64 rows on the `cpu` preset's model in one process: one with the default row classes (a
third graph for `MANY_ROWS.fewest` rows or more, traced with that count as the size's hint), one with the 2-row
graph for every count of 2 or more. Each step of `--rows` live rows plus its unfiltered draw is timed, the two
decoders taking turns in every round (this machine's speed drifts). Both cores by default, as the server runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.decode.compiled.routing import FEW_ROWS, MANY_ROWS, ONE_ROW, ROW_CLASSES
from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import cpu_route
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import build_model

from .decode_environment import measured_class, vector_caps
from .decode_models import preset_config

STATE_ROWS = 64
STEPS, WARMUP_STEPS, ROUNDS = 200, 20, 12
VARIANTS = {"with the many-rows graph": ROW_CLASSES, "2-row graph only": (FEW_ROWS, ONE_ROW)}


def compiled_decoders(kind: str) -> dict[str, CompiledDecoder]:
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", kind)).eval()
    decoders = {}
    for name, classes in VARIANTS.items():
        decoders[name] = CompiledDecoder(model, model.new_state(STATE_ROWS), classes)
        log = decoders[name].compile_now()
        if log.error is not None:
            raise SystemExit(f"compiling the {kind} steps failed: {log.error}")
    return decoders


def step_and_draw(decoder: CompiledDecoder, rows: int) -> Callable[[], None]:
    """One step of the first `rows` rows and their unfiltered draw, starting the rows again at the cache's end."""
    max_len = decoder.model.config.max_len
    tokens = torch.zeros(rows, dtype=torch.long)
    logits = torch.randn(rows, decoder.model.config.vocab_out)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(rows)])
    position = torch.full((rows,), 100)

    def run() -> None:
        if int(decoder.state.lengths[0]) >= max_len - 1:
            decoder.state.reset_rows(range(STATE_ROWS))
        decoder(tokens)
        decoder.sample(logits, sampling, position)

    return run


def time_in_turns(runs: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """ms per call of each, one figure per round; the runs take turns in every round, the first of one
    round the last of the next (whichever runs first in a round was seen to run a few percent slower)."""
    times = {name: [] for name in runs}
    for round_ in range(ROUNDS):
        for name, run in list(runs.items())[:: 1 if round_ % 2 == 0 else -1]:
            for _ in range(WARMUP_STEPS):
                run()
            start = time.perf_counter()
            for _ in range(STEPS):
                run()
            times[name].append((time.perf_counter() - start) / STEPS * 1e3)
    return times


def measure(kind: str, rows_list: list[int]) -> list[dict]:
    decoders = compiled_decoders(kind)
    results = []
    for rows in rows_list:
        runs = {name: step_and_draw(decoder, rows) for name, decoder in decoders.items()}
        times = time_in_turns(runs)
        classes = {name: decoder.class_for(rows) for name, decoder in decoders.items()}
        results.append(
            {
                "kind": kind,
                "rows": rows,
                "graph_rows": classes,
                "ms_per_step_and_draw": times,
                "median_ms": {name: statistics.median(t) for name, t in times.items()},
            }
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.row_classes", description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="linear", help="comma-separated compilable kinds")
    parser.add_argument("--rows", default="32,48,64", help=f"comma-separated live rows, each 2 to {STATE_ROWS}")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's, all cores)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(not 2 <= r <= STATE_ROWS for r in rows_list):
        parser.error(f"--rows must each be 2 to {STATE_ROWS}, got {args.rows}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if torch.get_num_threads() < 2:
        parser.error("with one thread inductor splits no loop: there is no many-rows graph to compare")
    results = []
    with torch.inference_mode():
        for kind in args.kinds.split(","):
            results += measure(kind, rows_list)
    for r in results:
        mine, other = (r["median_ms"][name] for name in VARIANTS)
        print(
            f"{r['kind']} {r['rows']} rows: {mine:.3f} ms a step and draw on the graph for {r['graph_rows'][next(iter(VARIANTS))]}"
            f" or more rows, {other:.3f} on the 2-row graph ({other / mine:.2f}x), median of {ROUNDS} rounds"
        )
    route = cpu_route()
    environment = {
        "cpu_class": measured_class(read_cpu_features().cpu_class, route),
        "vector_caps": vector_caps(),
        "cpu_route": route,
        "threads": torch.get_num_threads(),
        "many_rows": MANY_ROWS.fewest,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps({"environment": environment, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
