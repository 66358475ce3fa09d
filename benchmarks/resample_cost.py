"""What a particle resampling costs each attention kind, beside a decode step, measured in one run.

    python -m benchmarks.resample_cost --threads 1 --repeats 20

Resampling (model/decode/particles.py chooses the copies, server/engine/runner.py makes them) copies rows of the
engine's slots: the decode state (a fixed-size S, Z per layer for linear attention; a key/value
cache for softmax; Linformer's projected sums; Reformer's bucketed cache)
and the row's slot tensors (logits, history, sampling parameters). For each
kind this builds the MNIST model of the preset in an engine runner of
--rows slots, prefills every row with half an image (392 pixels, where a
right-half mask has its particles), and times, kinds taking turns in every
repeat: one decode step of all rows, and one resampling of a 16-particle
sample in which half the particles die (8 row copies, the usual case just
under the ESS threshold). It prints the state bytes per row and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.decode_models import preset_config
from model import build_model
from model.attention.kinds import attention_kinds
from model.decode.sampling import SamplingParams
from model.decode.particles import RowCopy
from server.engine.runner import ModelRunner
from server.engine.types import GenerationRequest

PROMPT = 392  # half an image: the rows hold this much history when a right-half mask starts weighing
COPIES = 8  # half of a 16-particle sample replaced


@dataclass
class Contender:
    kind: str
    runner: ModelRunner
    tokens: torch.Tensor  # (rows,) fed to each decode step
    decode_s: list[float] = field(default_factory=list)
    resample_s: list[float] = field(default_factory=list)

    def state_bytes_per_row(self) -> int:
        return self.runner.slots.state.nbytes() // self.runner.rows


def build(kind: str, preset: str, rows: int) -> Contender:
    torch.manual_seed(0)
    runner = ModelRunner(build_model(preset_config(preset, kind)).eval(), rows, cuda_graphs=False)
    runner.allocate()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (PROMPT,), generator=gen).tolist()
    request = GenerationRequest("bench", prompt, 784 - PROMPT, SamplingParams(seed=0))
    runner.prefill([request] * rows, 0)
    return Contender(kind, runner, torch.randint(0, 256, (rows,), generator=gen))


def time_once(c: Contender) -> None:
    start = time.perf_counter()
    c.runner.decode(c.tokens)
    c.decode_s.append(time.perf_counter() - start)
    copies = [RowCopy(src=i, dst=COPIES + i, seed=i) for i in range(COPIES)]
    start = time.perf_counter()
    c.runner.copy_particles(copies, c.tokens.clone())
    c.resample_s.append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(attention_kinds()))
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--rows", type=int, default=64, help="decode slots (>= 16)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        contenders = [build(kind, args.preset, args.rows) for kind in args.kinds.split(",")]
        for c in contenders:
            time_once(c)  # warm-up
            c.decode_s.clear(), c.resample_s.clear()
        for _ in range(args.repeats):
            for c in contenders:
                time_once(c)
    rows = [summary(c) for c in contenders]
    print(json.dumps(rows, indent=2) if args.json else table(rows, args))
    return 0


def summary(c: Contender) -> dict:
    decode, resample = statistics.median(c.decode_s), statistics.median(c.resample_s)
    return {
        "kind": c.kind,
        "state_bytes_per_row": c.state_bytes_per_row(),
        "decode_step_ms": round(decode * 1e3, 3),
        "resample_8_of_16_ms": round(resample * 1e3, 3),
        "row_copy_us": round(resample / COPIES * 1e6, 1),
        "resample_over_decode_step": round(resample / decode, 4),
    }


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"preset {args.preset}, {args.rows} rows of {PROMPT} pixels, {args.threads} thread(s), "
        f"medians of {args.repeats} interleaved repeats",
        "| kind | state per row | decode step, all rows | resampling (8 row copies) | per row copy | "
        "resampling / decode step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['state_bytes_per_row'] / 1024:,.0f} KiB | {r['decode_step_ms']:.2f} ms | "
            f"{r['resample_8_of_16_ms']:.3f} ms | {r['row_copy_us']:.0f} us | "
            f"{r['resample_over_decode_step']:.1%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
