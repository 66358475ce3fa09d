"""A linear model's prefill with and without the CPU prefill kernel: `python -m benchmarks.prefill`.

Prompts of `--tokens` tokens for batches of rows, into an empty state, on the CPU preset's linear model (random
weights): the chunked parallel form (the kernels off) and the recurrence of model/kernels/linear_prefill.cpp (on)
taking turns, best of `--repeats` each per round. No HTTP, one process; run it under benchmarks/as_avx2.sh for
the AVX2 route.

    python -m benchmarks.prefill --threads 2 --json-out benchmarks/results/prefill-DATE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model.kernels.loader import load_kernels, turn_off_cpu_kernels, use_cpu_kernels
from model.transformer import Transformer, build_model

from .decode_models import preset_config
from .errors import BenchError


def prefill_seconds(model: Transformer, tokens: torch.Tensor, repeats: int) -> float:
    """Best of `repeats` prefills of `tokens` (B, T) into a new state."""
    best = float("inf")
    for _ in range(repeats):
        state = model.new_state(tokens.shape[0])
        started = time.perf_counter()
        model(tokens, state)
        best = min(best, time.perf_counter() - started)
    return best


@torch.inference_mode()
def measure(rows: list[int], tokens: int, repeats: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    model = build_model(preset_config("cpu", "linear")).eval()
    if not load_kernels().ok:
        raise BenchError("the CPU kernels did not build here; nothing to compare")
    out = []
    for batch in rows:
        prompt = torch.randint(0, 256, (batch, tokens))
        times: dict[str, list[float]] = {"chunked": [], "kernel": []}
        for _ in range(rounds):
            for name, switch in (("chunked", turn_off_cpu_kernels), ("kernel", use_cpu_kernels)):
                switch(model)
                model(prompt, model.new_state(batch))  # warm
                times[name].append(prefill_seconds(model, prompt, repeats))
        chunked, kernel = min(times["chunked"]), min(times["kernel"])
        out.append({"rows": batch, "tokens": tokens, "chunked_s": chunked, "kernel_s": kernel})
        print(
            f"{batch:4d} rows x {tokens} tokens: chunked {chunked * 1e3:8.1f} ms, kernel {kernel * 1e3:8.1f} ms "
            f"({chunked / kernel:.2f}x)"
        )
    return out


def row_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive row counts, e.g. 1,8,64")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=row_counts, default=[1, 8, 64], help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=393, help="prompt length (BOS and 14 rows of pixels: 393)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.rows, args.tokens, args.repeats, args.rounds)
    if args.json_out:
        args.json_out.write_text(json.dumps({"threads": args.threads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
