"""Several models busy at once, as users run the server: `python -m benchmarks.models_at_once`.

Starts `rnnserve serve` on the given models once per configuration (flags), in interleaved rounds, waits
until /health is ready and every compilable model's decode steps are compiled, then sends every model its
completions all at once (bottom halves of a synthetic digit, `keep_rows` 14) and times each model from the
first request to its last answer. Optionally runs busy-loop processes beside the server (`--busy N`), as a
machine shared with other work. Talks only to 127.0.0.1; every wait is bounded.

    python -m benchmarks.models_at_once --config defaults= --config threads1=--threads=1 --rounds 2 \\
        --busy 2 --json-out benchmarks/results/models-at-once.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import aiohttp

from model.attention.classes import kinds_where

from .load import synthetic_digit

MNIST_MODELS = ("mnist-linear", "mnist-linformer", "mnist-softmax", "mnist-reformer")
START_SECONDS = 300.0
COMPILE_SECONDS = 1200.0
REQUEST_SECONDS = 1800.0


def cpu_class() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else platform.machine()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes that spin on the CPU until the block ends: other work on the machine."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextmanager
def server(weights: list[Path], flags: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    models = [arg for path in weights for arg in ("--model", str(path))]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", *models, "--port", str(port), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str, log: Path, compiled: bool) -> dict:
    """Wait for /health, then (if `compiled`) for every compilable model's compile; the model cards."""
    deadline = time.monotonic() + START_SECONDS + (COMPILE_SECONDS if compiled else 0)
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/health") as answer:
                healthy = answer.status == 200
            async with session.get(f"{url}/v1/models") as answer:
                cards = {c["id"]: c for c in (await answer.json())["data"]} if answer.status == 200 else {}
        except aiohttp.ClientError:
            cards, healthy = {}, False
        if (
            healthy
            and cards
            and (not compiled or all(c["compiled_decode"] or c["attention"] in _eager_kinds() for c in cards.values()))
        ):
            return cards
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the server was not ready in time; its log:\n{log.read_text()[-4000:]}")


def _eager_kinds() -> tuple[str, ...]:
    """Kinds whose decode steps are never compiled: their cards never say compiled_decode."""
    return kinds_where(lambda c: not c.compilable)


async def complete_all(session: aiohttp.ClientSession, url: str, models: list[str], images: int) -> dict[str, float]:
    """Every model's `images` completions sent at once; seconds from the start to each model's last answer."""
    started = time.monotonic()

    async def one(model: str, seed: int) -> None:
        body = {"model": model, "pixels": synthetic_digit(), "keep_rows": 14, "seed": seed}
        async with session.post(
            f"{url}/v1/images/completions", json=body, headers={"Accept": "application/json"}
        ) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{model}: {answer.status} {await answer.text()}")
            await answer.read()

    async def model_done(model: str) -> tuple[str, float]:
        await asyncio.gather(*(one(model, seed) for seed in range(images)))
        return model, time.monotonic() - started

    return dict(await asyncio.gather(*(model_done(m) for m in models)))


async def run_config(weights: list[Path], flags: list[str], images: int, compiled: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
        with server(weights, flags, log) as url:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                cards = await wait_ready(session, url, log, compiled)
                seconds = await complete_all(session, url, list(cards), images)
    return {
        "threads": {m: c["threads"] for m, c in cards.items()},
        "workers": {m: c.get("workers", 1) for m, c in cards.items()},
        "compiled": {m: c["compiled_decode"] for m, c in cards.items()},
        "seconds": seconds,
        "images_per_second": {m: images / s for m, s in seconds.items()},
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summary_table(summary: dict, reference: str = "threads1") -> str:
    """A Markdown table: each configuration's median images/s per model over its rounds, each as a share of
    `reference`'s in the same run, and linear's images/s over softmax's."""
    rates = {
        name: {model: median([r["images_per_second"][model] for r in rounds]) for model in rounds[0]["seconds"]}
        for name, rounds in summary["rounds"].items()
    }
    models = list(next(iter(rates.values())))
    lines = [
        f"| configuration (flags) | workers x threads | {' | '.join(models)} | linear / softmax |",
        "|---|---|" + "---|" * len(models) + "---|",
    ]
    for name, per_model in rates.items():
        first = summary["rounds"][name][0]
        layouts = {f"{first.get('workers', {}).get(m, 1)} x {first['threads'][m]}" for m in models}
        cells = []
        for model in models:
            share = (
                f" ({per_model[model] / rates[reference][model]:.0%})"
                if reference in rates and name != reference
                else ""
            )
            cells.append(f"{per_model[model]:.2f}{share}")
        linear, softmax = per_model.get("mnist-linear"), per_model.get("mnist-softmax")
        ratio = f"{linear / softmax:.2f}x" if linear and softmax else "-"
        flags = " ".join(summary["configs"][name]) or "none"
        lines.append(f"| {name} (`{flags}`) | {', '.join(sorted(layouts))} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def parse_config(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    return name, [flag for flag in flags.split(",") if flag]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, default=Path("weights"))
    parser.add_argument("--models", default=",".join(MNIST_MODELS), help="comma-separated model names in --weights")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAG,FLAG",
        help="a server configuration: its name and its flags (comma-separated; none for defaults)",
    )
    parser.add_argument("--images", type=int, default=16, help="completions per model, all sent at once")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every configuration")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the server")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--table", type=Path, metavar="JSON", help="print the table of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(summary_table(json.loads(args.table.read_text())))
        return 0
    if not args.config:
        parser.error("give at least one --config NAME=FLAGS (or --table JSON)")
    weights = [args.weights / f"{name}.safetensors" for name in args.models.split(",")]
    configs = [parse_config(text) for text in args.config]
    results: dict[str, list[dict]] = {name: [] for name, _ in configs}
    with busy_loops(args.busy):
        for round_ in range(args.rounds):
            for name, flags in configs:
                compiled = "--no-compile-decode" not in flags
                result = asyncio.run(run_config(weights, flags, args.images, compiled))
                results[name].append(result)
                rates = ", ".join(f"{m} {r:.2f}" for m, r in result["images_per_second"].items())
                print(
                    f"round {round_ + 1} {name} ({' '.join(flags) or 'defaults'}): images/s {rates}; "
                    f"threads {result['threads']}",
                    flush=True,
                )
    summary = {
        "cpu": cpu_class(),
        "cpus": len(os.sched_getaffinity(0)),
        "busy_loops": args.busy,
        "images_per_model": args.images,
        "configs": {n: f for n, f in configs},
        "rounds": results,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1) + "\n")
    print(summary_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
