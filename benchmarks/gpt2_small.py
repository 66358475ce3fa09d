"""`python -m benchmarks.gpt2_small`: GPT-2 small's shape imported, linearized, served, and timed against Hugging Face.

A `GPT2LMHeadModel` of GPT-2 small's shape (12 layers, 768 dims, 12 heads, 1,024 positions, 50,257 tokens, 124M
parameters; random weights: none can be downloaded here) is written with `save_pretrained` beside a byte-level BPE
trained on a few lines (a tokenizer is part of an importable folder; its size does not change the model's cost),
imported by `rnnserve import hf`'s own function, and linearized: the same weights in a linear-attention model with
Hedgehog's feature map, not fine-tuned (speed does not depend on what the weights are). llama.cpp runs on the same
weights written as GGUF (f32 and f16), at 1 and 2 threads (benchmarks/llamacpp_peer.py; `--no-llamacpp` leaves it
out). In one run:

1. tokens/s at batch 1 and 16, generating from <|endoftext|> as `generate` does: the imported model and its
   linearized twin through the decode step the server runs (compiled), and Hugging Face `generate` with its static
   KV cache, the contestants taking turns round by round;
2. the single-step time at positions 100 to 1,000 at batch 1 and 16, softmax (its KV cache grows) beside linear
   (constant) and llama.cpp (its KV cache grows) in the same turns: at batch 1 the step reads GPT-2's 124M weights
   and little else, so the cache's growth shows at 16;
3. with --served: `rnnserve serve` on both files, streamed text requests over HTTP at concurrency 1 and 16.

Results go to a JSON file (--out); docs/benchmarks.md has the tables of the newest `gpt2-small-DATE.json`
(`python -m benchmarks.docs_tables`), benchmarks/results/NOTES.md ("GPT-2 small imported") the earlier runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model.io.hf_import import import_folder
from model.decode.sampling import BatchSampling, SamplingParams
from model.transformer import Transformer, build_model
from model.io.weights import load_model, read_tokenizer, save_model

from . import llamacpp_peer
from .peers import hf_generate
from .decode_environment import environment, machine_load
from .decode_images import with_decoder
from .decode_positions import measure_positions, step_decoder
from .decode_settings import DecodeSettings
from .decode_timing import timed

GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 256, "vocab_size": 1000}  # --tiny: a smoke run
CORPUS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question."] * 50
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class Gpt2Settings:
    sizes: dict
    batches: tuple[int, ...] = (1, 16)
    new_tokens: int = 128
    rounds: int = 3
    positions: tuple[int, ...] = (100, 250, 500, 750, 1000)
    steps_per_position: int = 16
    position_batches: tuple[int, ...] = (1, 16)
    served: bool = False
    served_requests: int = 32
    seed: int = 0
    llamacpp: bool = False  # llama.cpp on the same weights as GGUF (benchmarks/llamacpp_peer.py)
    llamacpp_threads: tuple[int, ...] = (1, 2)


# ---------------------------------------------------------------- the models


def write_gpt2_folder(folder: Path, sizes: dict, seed: int) -> None:
    """GPT-2's shape with random weights and a small byte-level BPE, as Hugging Face saves a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT)
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    torch.manual_seed(seed)
    config = GPT2Config(**sizes, bos_token_id=end, eos_token_id=end)
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def linearized(source: Transformer) -> Transformer:
    """The softmax model's weights in a linear-attention model with Hedgehog's feature map (not fine-tuned)."""
    config = source.config.replace(attention="linear", linear_feature_map="hedgehog")
    model = build_model(config)
    missing = model.load_state_dict(source.state_dict(), strict=False).missing_keys
    assert all("feature_map" in name for name in missing), missing  # only the map's own parameters are new
    return model.eval()


# ---------------------------------------------------------------- tokens/s


def hf_contestant(folder: Path, batch: int, tokens: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return lambda: hf_generate(model, batch, tokens, cache_implementation="static")


def rnnserve_contestant(model: Transformer, batch: int, tokens: int):
    decoder = step_decoder(model, DecodeSettings(compiled=True), batch)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(batch)])
    return lambda: with_decoder(decoder, sampling, tokens), decoder.compiled


@torch.inference_mode()
def measure_throughput(
    models: dict[str, Transformer],
    folder: Path,
    s: Gpt2Settings,
    progress,
    dtype: torch.dtype = torch.float32,
    peers=None,
) -> list[dict]:
    """Tokens/s of each model and of Hugging Face `generate` on the folder's weights in `dtype`, taking turns.

    `peers` (batch, new_tokens -> {name: (run, row fields, close)}), when given, adds other engines' contestants
    to the same turns (benchmarks/llamacpp_peer.py); their rows carry their own dtype and threads."""
    rows = []
    for batch in s.batches:
        runs, compiled, fields, closers = {}, {}, {}, []
        for name, model in models.items():
            runs[name], compiled[name] = rnnserve_contestant(model, batch, s.new_tokens)
        runs["Hugging Face generate, static cache"] = hf_contestant(folder, batch, s.new_tokens, dtype)
        for name, (run, extra, close) in (peers(batch, s.new_tokens) if peers else {}).items():
            runs[name], fields[name] = run, extra
            closers.append(close)
        for run in runs.values():  # warm-up: first calls allocate and pick kernels
            run()
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(s.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                out: list[torch.Tensor] = []
                seconds[name].append(timed(lambda: out.append(runs[name]()), torch.device("cpu")))
                assert tuple(out[0].shape) == (batch, s.new_tokens), (name, out[0].shape)
        for name, times in seconds.items():
            best = min(times)
            rows.append(
                {
                    "contestant": name,
                    "batch": batch,
                    "new_tokens": s.new_tokens,
                    "seconds": times,
                    "tokens_per_s": batch * s.new_tokens / best,
                    "tokens_per_s_median": batch * s.new_tokens / statistics.median(times),
                    "compiled": compiled.get(name, False),
                    "dtype": str(dtype).removeprefix("torch."),
                    "model_dtype": str(dtype).removeprefix("torch."),  # the folder's: a peer's dtype is its own
                    "threads": torch.get_num_threads(),
                    **fields.get(name, {}),
                }
            )
            progress(f"batch {batch:3d} {name:40s} {rows[-1]['tokens_per_s']:9.1f} tokens/s")
        for close in closers:
            close()
    hf = {r["batch"]: r["tokens_per_s"] for r in rows if r["contestant"].startswith("Hugging Face")}
    for row in rows:
        row["vs_hf_static"] = row["tokens_per_s"] / hf[row["batch"]]
    return rows


def measure_step_times(
    models: dict[str, Transformer], s: Gpt2Settings, progress, gguf: dict[str, Path] | None = None
) -> tuple[dict, dict]:
    """At each of `s.position_batches`: the single-step time of each model (compiled, as the server runs it) at
    `s.positions`, and of llama.cpp on each GGUF file in `gguf` at each of `s.llamacpp_threads`, all in the same
    turns (benchmarks/decode_positions.py). Returns ({batch: {name: [point, ...]}}, {batch: {name: growth}}), the
    growth being the last position's median step over the first's."""
    by_position, growth = {}, {}
    for batch in s.position_batches:
        settings = DecodeSettings(compiled=True, steps_per_position=s.steps_per_position, position_batch=batch)
        progress(f"step time by position, batch {batch}")
        peers = {}
        try:
            if gguf:
                peers = llamacpp_peer.position_peers(
                    gguf, batch, list(s.positions), s.steps_per_position, s.llamacpp_threads
                )
            points = measure_positions(models, list(s.positions), settings, progress, peers)
        finally:
            for peer in peers.values():
                peer.close()
        by_position[batch] = {name: [p.__dict__ for p in rows] for name, rows in points.items()}
        growth[batch] = {
            name: rows[-1].step_seconds_median / rows[0].step_seconds_median for name, rows in points.items()
        }
    return by_position, growth


# ---------------------------------------------------------------- served over HTTP


def measure_served(files: list[Path], s: Gpt2Settings, progress) -> list[dict]:
    from .load import LoadSettings, run_load

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--device", "cpu", "--max-batch", str(max(s.batches)), "--log-level", "warning"]
    models = [arg for f in files for arg in ("--model", str(f))]
    script = Path(sys.executable).parent / "rnnserve"
    server = subprocess.Popen([str(script), "serve", *models, *flags], stdout=sys.stderr, stderr=sys.stderr)
    try:
        _wait_compiled(url, [f.stem for f in files], server)
        rows = []
        for batch in s.batches:
            for path in files:
                settings = LoadSettings(
                    url=url,
                    kind="text",
                    concurrency=batch,
                    duration=600.0,
                    max_requests=max(batch * 2, s.served_requests if batch > 1 else 4),
                    timeout=600.0,
                    model=path.stem,
                    max_tokens=s.new_tokens,
                    prompt="The quick brown fox",
                )
                result = run_load(settings)
                rows.append({"model": path.stem, "concurrency": batch, **_served_figures(result)})
                progress(f"served {path.stem:24s} concurrency {batch:3d}: {rows[-1]['tokens_per_s']:9.1f} tokens/s")
        return rows
    finally:
        server.terminate()
        server.wait(timeout=120)


def _served_figures(result: dict) -> dict:
    keys = ("completed", "sent", "elapsed_s", "tokens", "tokens_per_s", "outcomes", "inter_token_s", "ttft_s")
    return {key: result[key] for key in keys}


def _wait_compiled(url: str, names: list[str], server: subprocess.Popen, seconds: float = 1800) -> None:
    """Until every model is ready and its decode steps are compiled (a server compiles in the background)."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"rnnserve serve exited with {server.returncode}")
        try:
            cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]}
            if all(cards.get(n, {}).get("ready") and cards[n].get("compiled_decode") for n in names):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(2)
    raise RuntimeError(f"models {names} were not compiled within {seconds:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the run


def run(s: Gpt2Settings, progress=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpt2-small-") as tmp:
        folder, files = Path(tmp) / "hf", Path(tmp) / "models"
        files.mkdir()
        progress(f"writing a random GPT-2 of {s.sizes} with save_pretrained")
        write_gpt2_folder(folder, s.sizes, s.seed)
        imported = files / "gpt2-small.safetensors"
        import_folder(folder, imported)
        softmax, _ = load_model(imported)
        linear = linearized(softmax)
        save_model(
            linear,
            files / "gpt2-small-hedgehog.safetensors",
            {"linearized_from": imported.name},
            tokenizer=read_tokenizer(imported),
        )
        models = {"rnnserve softmax (imported)": softmax, "rnnserve linear (linearized)": linear}
        peers, gguf = None, {}
        if s.llamacpp:
            progress("writing the same folder as GGUF (f32, f16) for llama.cpp")
            gguf = llamacpp_peer.gguf_files(folder, Path(tmp), ("f32", "f16"))
            peers = llamacpp_peer.peer_contestants(gguf, [llamacpp_peer.start_token(folder)], s.llamacpp_threads)
        report = {
            "environment": environment(DecodeSettings()) | machine_load(),
            "settings": {k: v for k, v in s.__dict__.items()},
            "parameters": {"softmax": softmax.num_parameters(), "linear": linear.num_parameters()},
            "throughput": measure_throughput(models, folder, s, progress, peers=peers),
        }
        positions = measure_step_times({"softmax": softmax, "linear": linear}, s, progress, gguf)
        report["step_time_by_position"], report["step_time_growth"] = positions
        if s.served:
            report["served"] = measure_served(sorted(files.glob("*.safetensors")), s, progress)
        report["load_after"] = machine_load()
        return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_small", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model: checks the run, measures nothing")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row in the timed runs")
    parser.add_argument("--rounds", type=int, default=3, help="turns each contestant takes at each batch size")
    parser.add_argument("--served", action="store_true", help="also serve both files and time them over HTTP")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    add_llamacpp_flag(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tiny = args.tiny
    settings = Gpt2Settings(
        sizes=TINY if tiny else GPT2_SMALL,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        positions=(20, 60, 120) if tiny else Gpt2Settings.positions,
        steps_per_position=4 if tiny else Gpt2Settings.steps_per_position,
        served=args.served,
        served_requests=4 if tiny else Gpt2Settings.served_requests,
        llamacpp=llamacpp_wanted(args),
    )
    report = run(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    write_report(report, args.out)
    return 0


def add_llamacpp_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="leave llama.cpp out (by default it runs on the same weights as GGUF; benchmarks/install_peers.sh)",
    )


def llamacpp_wanted(args: argparse.Namespace) -> bool:
    """Whether llama.cpp runs: by default it does, and a missing install is an error saying how to install it."""
    if args.no_llamacpp:
        return False
    missing = llamacpp_peer.available()
    if missing:
        raise SystemExit(f"error: {missing} (or pass --no-llamacpp)")
    return True


def write_report(report: dict, out: Path | None) -> None:
    """The results as JSON, into `out` or onto standard output."""
    text = json.dumps(report, indent=1, default=str)
    if out:
        out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
