"""`python -m benchmarks.llama_small`: a SmolLM-135M-shaped Llama imported and timed against Hugging Face.

A `LlamaForCausalLM` of SmolLM-135M's shape (30 layers, 576 dims, 9 query and 3 key/value heads, a 1,536-wide
SwiGLU, 49,152 tokens, tied embeddings, 2,048 positions; random weights: none can be downloaded here) is written
with `save_pretrained` in float32 and in bfloat16 beside a small byte-level BPE, and imported by
`rnnserve import hf`'s own function (the bfloat16 folder gives a bfloat16 file). In one run, for each dtype:
tokens/s at batch 1 and 16 of the imported model through the decode step the server runs (compiled) and of
Hugging Face `generate` with its static KV cache on the same folder, the contestants taking turns round by round.
Beside them, the imported model linearized: its linear-attention twin (hedgehog feature map, rotary positions and
grouped-query attention kept: sums per key head) holding every one of its weights, the feature map as drawn (what
`rnnserve linearize` starts from; training changes no shape, so not the speed). In the same turns, llama.cpp on the
same folder written as GGUF (f32 for float32, bf16 for bfloat16), 1 and 2 threads, batch 16 as its parallel
sequences (benchmarks/llamacpp_peer.py; `--no-llamacpp` leaves it out). Then, for each dtype, the single-step time
at positions 128 to 2,000 at batch 1 and 16 of the imported model (its KV cache grows), its linearized twin (its
state does not) and llama.cpp at each thread count (its KV cache grows), in the same turns. Results go to a JSON
file (--out); docs/benchmarks.md has the tables (`python -m benchmarks.docs_tables`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from model.io.hf_import import import_folder
from model.transformer import Transformer, build_model
from model.io.weights import load_model

from . import llamacpp_peer
from .decode_environment import environment, machine_load
from .decode_settings import DecodeSettings
from .gpt2_small import (
    CORPUS,
    Gpt2Settings,
    add_llamacpp_flag,
    llamacpp_wanted,
    measure_step_times,
    measure_throughput,
    write_report,
)

SMOLLM_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
TINY = {**SMOLLM_135M, "num_hidden_layers": 2, "hidden_size": 72, "intermediate_size": 96, "vocab_size": 1000}
START, END = "<s>", "</s>"
POSITIONS = (128, 512, 1024, 2000)  # where the step is timed: up to the shape's 2,048 positions, less the steps
TINY_POSITIONS = (20, 60, 120)
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPES = tuple(DTYPE_NAMES.values())
LINEARIZED_MAP = "hedgehog"  # the map linearizing with attention transfer learns (LoLCATs)


def write_llama_folder(folder: Path, sizes: dict, dtype: torch.dtype, seed: int) -> None:
    """SmolLM's shape with random weights and a small byte-level BPE, as Hugging Face saves a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[START, END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=START, eos_token=END)
    torch.manual_seed(seed)
    config = LlamaConfig(**sizes, bos_token_id=bpe.token_to_id(START), eos_token_id=bpe.token_to_id(END))
    LlamaForCausalLM(config).eval().to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def linearized_twin(model: Transformer) -> Transformer:
    """The linear twin of an imported softmax model, with every one of its weights (the same names and shapes)."""
    twin = build_model(model.config.replace(attention="linear", linear_feature_map=LINEARIZED_MAP))
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".feature_map." in name for name in missing), (missing, unexpected)
    return twin.to(model.dtype).eval()


def run(sizes: dict, s: Gpt2Settings, progress=print, dtypes=DTYPES, on_part=lambda report: None) -> dict:
    """Every dtype in turn; `on_part` gets the report after each, so a run stopped part way keeps what it measured."""
    report = {"environment": environment(DecodeSettings()) | machine_load(), "sizes": sizes, "throughput": []}
    report["settings"] = {k: v for k, v in s.__dict__.items() if k != "sizes"}
    report["step_time_by_position"], report["step_time_growth"] = {}, {}  # per dtype, then as gpt2_small's
    with tempfile.TemporaryDirectory(prefix="llama-small-") as tmp:
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            folder, file = Path(tmp) / name, Path(tmp) / f"smollm-shape-{name}.safetensors"
            progress(f"writing a random Llama of SmolLM-135M's shape in {name} with save_pretrained")
            write_llama_folder(folder, sizes, dtype, s.seed)
            import_folder(folder, file)
            model, _ = load_model(file, dtype=dtype)
            report["parameters"] = model.num_parameters()
            models = {
                f"rnnserve softmax (imported, {name})": model,
                f"rnnserve linear (linearized, {name})": linearized_twin(model),
            }
            peers, gguf = None, {}
            if s.llamacpp:  # the same weights, in the same dtype (bfloat16 stays bfloat16 in GGUF)
                gguf = llamacpp_peer.gguf_files(folder, Path(tmp), ("f32" if dtype == torch.float32 else "bf16",))
                peers = llamacpp_peer.peer_contestants(gguf, [llamacpp_peer.start_token(folder)], s.llamacpp_threads)
            report["throughput"] += measure_throughput(models, folder, s, progress, dtype, peers=peers)
            kinds = dict(zip(("softmax", "linear"), models.values(), strict=True))
            by_position, growth = measure_step_times(kinds, s, progress, gguf)
            report["step_time_by_position"][name], report["step_time_growth"][name] = by_position, growth
            report["load_after"] = machine_load()
            on_part(report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_small", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="a two-layer model: checks the run, measures nothing")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row in the timed runs")
    parser.add_argument("--rounds", type=int, default=3, help="turns each contestant takes at each batch size")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated model dtypes to run, in this order"
    )
    add_llamacpp_flag(parser)
    args = parser.parse_args(argv)
    dtypes = parse_dtypes(parser, args.dtypes)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Gpt2Settings(
        sizes={},
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        positions=TINY_POSITIONS if args.tiny else POSITIONS,
        steps_per_position=4 if args.tiny else Gpt2Settings.steps_per_position,
        llamacpp=llamacpp_wanted(args),
    )
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    on_part = (lambda report: write_report(report, args.out)) if args.out else (lambda report: None)
    report = run(TINY if args.tiny else SMOLLM_135M, settings, progress, dtypes, on_part)
    write_report(report, args.out)
    return 0


def parse_dtypes(parser: argparse.ArgumentParser, text: str) -> tuple[torch.dtype, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DTYPE_NAMES]
    if unknown or not names:
        parser.error(f"--dtypes {text!r}: expected a comma-separated list of {', '.join(DTYPE_NAMES)}")
    return tuple(DTYPE_NAMES[name] for name in names)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
