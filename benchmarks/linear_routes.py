"""The packed linear kernel on each CPU route against PyTorch's own product, at a decode step's shapes.

    python -m benchmarks.linear_routes [--routes avx512,avx2,generic] [--rows 64,32,1] [--json-out FILE]

Each route runs in a process of its own (RNNSERVE_CPU_ROUTE=ROUTE: a process loads one build of the kernels),
one intra-op thread as the server's engines run, and times, best of several rounds, a 64-row and a 1-row
product (or --rows: 32 is a batch of 64 shared by two engine workers) for each linear layer shape of the `cpu` preset (d = 128: the attention's 384- and 128-wide outputs,
the feed-forward's 512 and 128) with the kernel and with `torch.nn.functional.linear` (MKL's sgemm on x86).
What it prints decides which routes the decode twin uses the kernel on (model/kernels/loader.py,
PACKED_LINEAR_ROUTES). A route the CPU cannot run is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(128, 384), (128, 128), (128, 512), (512, 128)]  # (in, out) of the cpu preset's linear layers
ROWS = (64, 1)
ROUNDS = 7


def time_one(fn, repeats: int) -> float:
    """Seconds a call, best of ROUNDS rounds of `repeats` calls."""
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def measure_here(row_counts: tuple[int, ...] = ROWS) -> dict:
    """(In the route's process.) Kernel and PyTorch seconds per product for every shape and row count."""
    import torch

    from model.kernels.cpu_features import read_cpu_features
    from model.kernels.loader import cpu_route, load_kernels

    torch.set_num_threads(1)
    build = load_kernels(build=True)
    if not build.ok:
        return {"route": cpu_route(), "error": build.error}
    rows = []
    for k, n in SHAPES:
        weight, bias = torch.randn(n, k), torch.randn(n)
        packed = torch.ops.rnnserve.pack_linear_weight(weight)
        for m in row_counts:
            x = torch.randn(m, k)
            repeats = max(20, 200_000 // (m * k * n // 64 + 1))
            kernel = time_one(lambda: torch.ops.rnnserve.packed_linear(x, packed, bias, n), repeats)
            torch_s = time_one(lambda: torch.nn.functional.linear(x, weight, bias), repeats)
            rows.append(
                {
                    "in": k,
                    "out": n,
                    "rows": m,
                    "kernel_us": 1e6 * kernel,
                    "torch_us": 1e6 * torch_s,
                    "kernel_over_torch": torch_s / kernel,
                }
            )
    cpu = read_cpu_features()
    return {"route": cpu_route(), "cpu_class": cpu.cpu_class, "vector_features": cpu.vector_features, "rows": rows}


def measure(route: str, row_counts: tuple[int, ...] = ROWS) -> dict:
    env = {**os.environ, "RNNSERVE_CPU_ROUTE": route, "OMP_NUM_THREADS": "1"}
    rows = ",".join(map(str, row_counts))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.linear_routes", "--here", "--rows", rows],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=Path(__file__).resolve().parents[1],
    )
    if done.returncode != 0:
        return {"route": route, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| route | in x out | rows | kernel us | PyTorch us | kernel speed-up |", "|---|---|---:|---:|---:|---:|"]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['route']} | - | - | - | - | {result['error']} |")
            continue
        for r in result["rows"]:
            lines.append(
                f"| {result['route']} | {r['in']} x {r['out']} | {r['rows']} | {r['kernel_us']:.2f} | "
                f"{r['torch_us']:.2f} | {r['kernel_over_torch']:.2f}x |"
            )
    return "\n".join(lines)


def _row_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive row counts such as 64,32,1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_routes", description=__doc__.splitlines()[0])
    parser.add_argument("--routes", default="avx512,avx2,generic", help="comma-separated routes to time")
    parser.add_argument("--rows", type=_row_counts, default=ROWS, help="rows of each product, e.g. 64,32,1")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # one route, in this process
    args = parser.parse_args(argv)
    if args.here:
        print(json.dumps(measure_here(args.rows)))
        return 0
    results = [measure(route, args.rows) for route in args.routes.split(",")]
    if args.json_out:
        args.json_out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
