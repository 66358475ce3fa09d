"""`python -m benchmarks.prefix_cache`: what the prefix cache saves, through the real server over HTTP.

Four measurements, each through `rnnserve serve` processes started here:

1. `ttft`: time to first token of a 900-token prompt whose first 896 tokens are cached (sent just before) against
   a fresh 900-token prompt, per model: a GPT-2-shaped model with a 1,024-token context (random weights, made with
   `transformers` as benchmarks/gpt2_small.py does) and its linearized twin, and the shipped text models of
   weights/ (prompts cut to their context). Streamed; the rounds alternate cached and fresh; medians.
2. `conversation`: a 10-turn conversation through the `openai` client (each turn 50 new tokens in, 50 out), the
   GPT-2-shaped pair side by side, with the cache on and off (`--prefix-cache-memory 0`): tokens the server
   prefilled per turn (`prompt_tokens - cached_tokens`) and the conversation's total time.
3. `playground`: the playground's workload: one occluded digit asked 8 times with different seeds, of four MNIST
   models at once, cache on and off: the share of known pixels not prefilled again, and images/s.
4. `capacity`: prefixes cached per GiB of budget at 256 and 1,024 tokens, linear against softmax, from the state
   bytes `/v1/models` reports (arithmetic, no timing).

`--quick` runs each on tiny random models in seconds (the test suite runs it); it measures nothing. Results go to
`--out` (JSON), `benchmarks/results/prefix-cache-DATE.json` for a run docs/benchmarks.md's tables are generated
from (`python -m benchmarks.docs_tables`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from .decode_environment import environment, machine_load
from .decode_settings import DecodeSettings
from .gpt2_small import CORPUS, GPT2_SMALL, TINY, _free_port, linearized, write_gpt2_folder
from .report_cli import progress, report_parser, write_report

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("ttft", "conversation", "playground", "capacity")
GIB = 2**30
MNIST_SIDE = 28
# Lower-case words: after a space each is one token of the benchmark's tokenizer, so a turn's words are its tokens.
CORPUS_WORDS = sorted({w for w in " ".join(CORPUS).replace(",", "").replace(".", "").split() if w.islower()})
COMPILED_KINDS = {"softmax", "linear", "linformer"}  # the kinds whose decode steps a server compiles on the CPU


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is: the issue's sizes, or --quick's."""

    gpt2: dict
    prompt: int = 900
    cached: int = 896
    rounds: int = 5
    turns: int = 10
    turn_tokens: int = 50
    asks: int = 8
    mnist_models: tuple[str, ...] = ("mnist-softmax", "mnist-linear", "mnist-linformer", "mnist-reformer")
    keep_rows: int = 14
    capacity_lengths: tuple[int, ...] = (256, 1024)
    shipped: bool = True  # the shipped weights/ models too


FULL = Sizes(gpt2=GPT2_SMALL)
QUICK = Sizes(gpt2=TINY, prompt=60, cached=56, rounds=1, turns=2, turn_tokens=8, asks=2, shipped=False)


# ---------------------------------------------------------------- servers


@contextlib.contextmanager
def serving(models: list[Path], *flags: str, quick: bool) -> Iterator[httpx.Client]:
    """`rnnserve serve` on `models`, ready (and, for a real run, compiled): a client of it."""
    port = _free_port()
    command = [str(Path(sys.executable).parent / "rnnserve"), "serve", "--port", str(port), "--device", "cpu"]
    command += [arg for path in models for arg in ("--model", str(path))]
    command += ["--log-level", "warning", *(["--no-compile-decode"] if quick else []), *flags]
    server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            wait_ready(client, server, [p.stem for p in models], compiled=not quick)
            yield client
    finally:
        server.terminate()
        server.wait(timeout=120)


def wait_ready(client: httpx.Client, server: subprocess.Popen, names: list[str], compiled: bool) -> None:
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"rnnserve serve exited with {server.returncode}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            if all(cards.get(n, {}).get("ready") for n in names) and all(
                cards[n]["compiled_decode"] or not compiled or cards[n]["attention"] not in COMPILED_KINDS
                for n in names
            ):
                return
        time.sleep(0.5)
    raise RuntimeError(f"models {names} were not ready in time")


def gpt2_pair(folder: Path, sizes: dict) -> list[Path]:
    """A GPT-2-shaped model (random weights, saved by transformers, imported) and its linearized twin."""
    from model.io.hf_import import import_folder
    from model.io.weights import load_model, read_tokenizer, save_model

    write_gpt2_folder(folder / "hf", sizes, seed=0)
    softmax_file, linear_file = folder / "gpt2-softmax.safetensors", folder / "gpt2-linear.safetensors"
    import_folder(folder / "hf", softmax_file)
    softmax, _ = load_model(softmax_file)
    save_model(
        linearized(softmax), linear_file, {"linearized_from": softmax_file.name}, tokenizer=read_tokenizer(softmax_file)
    )
    return [softmax_file, linear_file]


def tiny_mnist_models(folder: Path, names: tuple[str, ...]) -> list[Path]:
    """--quick's stand-ins for the shipped MNIST models: the same kinds, tiny, random."""
    from model import ModelConfig, build_model
    from model.io.weights import save_model

    files = []
    for name in names:
        kind = name.split("-")[1]
        config = ModelConfig(attention=kind, task="mnist", d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=784,
                             linformer_k=8, reformer_rounds=1, reformer_buckets=4)  # fmt: skip
        torch.manual_seed(0)
        save_model(build_model(config).eval(), folder / f"{name}.safetensors", {})
        files.append(folder / f"{name}.safetensors")
    return files


def cards(client: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


# ---------------------------------------------------------------- 1. time to first token


def first_token_seconds(client: httpx.Client, model: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token of one greedy token, and the prompt tokens the cache gave."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started, first, cached = time.perf_counter(), None, 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return (first if first is not None else time.perf_counter() - started), cached


def measure_ttft(client: httpx.Client, model: str, card: dict, s: Sizes, seed: int) -> dict:
    length = min(s.prompt, card["max_len"] - 2)
    cached_part = length - (s.prompt - s.cached)
    generator = torch.Generator().manual_seed(seed)
    vocab = 256  # ids every text model here has
    cached_times, fresh_times, cached_tokens = [], [], []
    for _ in range(s.rounds):
        prompt = torch.randint(1, vocab, (length,), generator=generator).tolist()
        first_token_seconds(client, model, prompt[:cached_part])  # the shared part, now cached
        seconds, cached = first_token_seconds(client, model, prompt)
        cached_times.append(seconds)
        cached_tokens.append(cached)
        fresh = torch.randint(1, vocab, (length,), generator=generator).tolist()
        fresh_times.append(first_token_seconds(client, model, fresh)[0])
    cached_s, fresh_s = statistics.median(cached_times), statistics.median(fresh_times)
    return {
        "model": model,
        "attention": card["attention"],
        "prompt_tokens": length,
        "cached_part": cached_part,
        "cached_tokens_reported": cached_tokens,
        "ttft_cached_s": cached_s,
        "ttft_uncached_s": fresh_s,
        "cached_over_uncached": cached_s / fresh_s,
    }


def run_ttft(client: httpx.Client, s: Sizes, progress) -> list[dict]:
    rows = []
    for i, (name, card) in enumerate(cards(client).items()):
        if card["task"] != "text" or not card.get("prefix_cache_memory"):
            continue
        rows.append(measure_ttft(client, name, card, s, seed=i))
        progress(f"ttft {name}: cached {rows[-1]['ttft_cached_s']:.4f} s, fresh {rows[-1]['ttft_uncached_s']:.4f} s")
    return rows


# ---------------------------------------------------------------- 2. a conversation


def conversation(base_url: str, model: str, s: Sizes, seed: int) -> dict:
    """`turns` turns through the openai client: each sends the whole conversation so far (its earlier answers
    included) and about `turn_tokens` new tokens (words the tokenizer has one token for), and takes `turn_tokens`
    out. What the server prefilled is what its usage says: prompt tokens less the cached ones."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    words = " ".join(CORPUS_WORDS).split()
    generator = torch.Generator().manual_seed(seed)
    history, turns, started = "", [], time.perf_counter()
    for _ in range(s.turns):
        picks = torch.randint(0, len(words), (s.turn_tokens,), generator=generator).tolist()
        history += " " + " ".join(words[i] for i in picks)
        answer = client.completions.create(model=model, prompt=history, max_tokens=s.turn_tokens, temperature=0)
        usage = answer.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        turns.append({"prompt_tokens": usage.prompt_tokens, "cached_tokens": cached or 0})
        history += answer.choices[0].text
    return {
        "model": model,
        "prefilled_per_turn": [t["prompt_tokens"] - t["cached_tokens"] for t in turns],
        "prompt_tokens_per_turn": [t["prompt_tokens"] for t in turns],
        "total_s": time.perf_counter() - started,
    }


def run_conversation(client: httpx.Client, gpt2: list[Path], cache: bool, s: Sizes, progress) -> list[dict]:
    rows = []
    for i, path in enumerate(gpt2):
        rows.append({"cache": cache, **conversation(str(client.base_url).rstrip("/"), path.stem, s, seed=i)})
        progress(f"conversation {path.stem} cache {'on' if cache else 'off'}: {rows[-1]['total_s']:.2f} s")
    return rows


# ---------------------------------------------------------------- 3. the playground


def occluded_digit(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (MNIST_SIDE, MNIST_SIDE), generator=generator).tolist()


def playground_round(client: httpx.Client, models: list[str], s: Sizes) -> dict:
    """Every model asked for the same digit `asks` times with different seeds, the models at once."""
    from concurrent.futures import ThreadPoolExecutor

    digit = occluded_digit(7)

    def ask(model: str) -> tuple[int, int]:
        known = cached = 0
        for seed in range(s.asks):
            body = {"model": model, "pixels": digit, "keep_rows": s.keep_rows, "seed": seed}
            usage = client.post("/v1/images/completions", json=body).raise_for_status().json()["usage"]
            known += s.keep_rows * MNIST_SIDE
            cached += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return known, cached

    started = time.perf_counter()
    with ThreadPoolExecutor(len(models)) as pool:
        counts = list(pool.map(ask, models))
    seconds = time.perf_counter() - started
    known, cached = (sum(c[i] for c in counts) for i in (0, 1))
    return {"images": len(models) * s.asks, "seconds": seconds, "images_per_s": len(models) * s.asks / seconds,
            "known_pixels": known, "cached_pixels": cached, "prefill_saved": cached / known}  # fmt: skip


def run_playground(folder: Path, s: Sizes, quick: bool, progress) -> list[dict]:
    files = (
        tiny_mnist_models(folder, s.mnist_models)
        if quick
        else [ROOT / "weights" / f"{n}.safetensors" for n in s.mnist_models]
    )
    rows = []
    for cache in (True, False):
        flags = () if cache else ("--prefix-cache-memory", "0")
        with serving(files, *flags, quick=quick) as client:
            rows.append(
                {
                    "cache": cache,
                    "models": [f.stem for f in files],
                    **playground_round(client, [f.stem for f in files], s),
                }
            )
            progress(f"playground cache {'on' if cache else 'off'}: {rows[-1]['images_per_s']:.2f} images/s")
    return rows


# ---------------------------------------------------------------- 4. capacity


def prefix_bytes(card: dict, length: int) -> int:
    """One cached prefix of `length` tokens: the state (a softmax cache grows with the length) and its logits."""
    per_prefix, state = card["prefix_cache_bytes_per_prefix"], card["state_bytes_per_sequence"]
    if card["attention"] != "softmax":
        return per_prefix
    return per_prefix - state + state * length // card["max_len"]


def run_capacity(client: httpx.Client, gpt2: list[Path], s: Sizes, progress) -> list[dict]:
    rows = []
    for name, card in cards(client).items():
        if name not in {path.stem for path in gpt2}:
            continue
        for length in s.capacity_lengths:
            size = prefix_bytes(card, length)
            rows.append({"model": name, "attention": card["attention"], "length": length,
                         "bytes_per_prefix": size, "prefixes_per_gib": GIB // size})  # fmt: skip
            progress(f"capacity {name} at {length}: {rows[-1]['prefixes_per_gib']:,} prefixes per GiB")
    return rows


# ---------------------------------------------------------------- the run


def run(jobs: list[str], s: Sizes, quick: bool, progress=print) -> dict:
    """One server with the cache on for the text jobs, one with it off for the conversation's other half, and the
    same two for the playground: server starts are most of a quick run."""
    report: dict = {"environment": environment(DecodeSettings()) | machine_load(), "settings": s.__dict__}
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        folder = Path(tmp)
        if set(jobs) & {"ttft", "conversation", "capacity"}:
            gpt2 = gpt2_pair(folder, s.gpt2)
            shipped = sorted((ROOT / "weights").glob("shakespeare-*.safetensors")) if s.shipped else []
            with serving(gpt2 + shipped, quick=quick) as client:
                if "ttft" in jobs:
                    report["ttft"] = run_ttft(client, s, progress)
                if "conversation" in jobs:
                    report["conversation"] = run_conversation(client, gpt2, True, s, progress)
                if "capacity" in jobs:
                    report["capacity"] = run_capacity(client, gpt2, s, progress)
            if "conversation" in jobs:
                with serving(gpt2, "--prefix-cache-memory", "0", quick=quick) as client:
                    report["conversation"] += run_conversation(client, gpt2, False, s, progress)
        if "playground" in jobs:
            report["playground"] = run_playground(folder, s, quick, progress)
    report["load_after"] = machine_load()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("benchmarks.prefix_cache", __doc__, "tiny models, seconds: checks the run, measures nothing")
    parser.add_argument("jobs", nargs="*", choices=[*JOBS, []], help=f"what to measure (default: all of {JOBS})")
    args = parser.parse_args(argv)
    report = run(args.jobs or list(JOBS), QUICK if args.quick else FULL, args.quick, progress)
    write_report(report, "benchmarks.prefix_cache", argv, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
