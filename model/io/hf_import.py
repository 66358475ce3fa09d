"""`rnnserve import hf DIR --out FILE.safetensors`: a Hugging Face model folder as an rnnserve model file.

Reads, with no network: `config.json`, the weights (`model.safetensors`, sharded safetensors with
`model.safetensors.index.json`, or `pytorch_model.bin`) and the tokenizer (`tokenizer.json`, or GPT-2's
`vocab.json` + `merges.txt`). The families and how each maps are in model/io/hf_families.py: GPT-2, Llama, Qwen2,
Mistral. The weights keep the folder's dtype (a bfloat16 folder gives a bfloat16 file). The tokenizer is stored
in the file's metadata: one file is the whole model. Anything else (another architecture, a missing file, a
tensor of the wrong shape, a config value rnnserve would compute differently) is one line and exit status 2.
torch is imported only when the command runs, so `--help` stays quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .hf_families import ARCHITECTURES, FAMILIES, HFImportError

if TYPE_CHECKING:  # imported where used: `--help` loads no torch
    import torch

    from ..config import ModelConfig
    from ..transformer import Transformer
    from .chat_template import ChatTemplate

__all__ = ["HFImportError", "add_arguments", "import_folder", "run"]

GPT2_END_OF_TEXT = "<|endoftext|>"
SHARD_INDEX = "model.safetensors.index.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=("hf",), help=f"hf: a Hugging Face model folder ({ARCHITECTURES})")
    parser.add_argument("folder", type=Path, help="the folder: config.json, the weights and the tokenizer files")
    parser.add_argument("--out", type=Path, required=True, help="the rnnserve file to write (.safetensors)")


def run(args: argparse.Namespace) -> int:
    try:
        config = import_folder(args.folder, args.out)
    except HFImportError as exc:
        print(f"rnnserve import: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"imported {args.folder} as {args.out}: {config.n_layers} layers, {config.d_model} dims, "
        f"{config.vocab_size} tokens, context {config.max_len}"
    )
    return 0


def import_folder(folder: Path, out: Path) -> ModelConfig:
    from ..transformer import build_model
    from .weights import save_model

    hf = read_json(folder / "config.json")
    family = FAMILIES.get(str(hf.get("model_type")))
    if family is None:
        raise HFImportError(
            f"unsupported architecture {hf.get('model_type')!r} "
            f"({', '.join(hf.get('architectures') or []) or 'no architectures listed'}); "
            f"expected one of model_type {', '.join(FAMILIES)} ({ARCHITECTURES})"
        )
    config = model_config(family.config(hf))
    tokenizer = read_tokenizer(folder)
    check_vocabulary(tokenizer, config.vocab_size)
    weights = read_weights(folder)
    model = build_model(config)
    state = fitted(family.tensors(weights, config.n_layers), model)
    model.load_state_dict(state, strict=True)
    info = {"imported_from": {"format": "hf", "folder": str(folder), "model_type": hf.get("model_type")}}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HFImportError(f"--out {out}: cannot create its folder ({exc.strerror})") from exc
    chat = hf_chat_template(folder)
    chat_json = chat.to_json() if chat is not None else None
    save_model(model.eval(), out, info, dtype=stored_dtype(weights), tokenizer=tokenizer, chat_template=chat_json)
    return config


def hf_chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's chat template and special tokens' text (model/io/chat_template.py), None if it has none."""
    from .chat_template import ChatTemplateError, read_hf_chat_template

    try:
        return read_hf_chat_template(folder)
    except ChatTemplateError as exc:
        raise HFImportError(str(exc)) from exc


def model_config(fields: dict[str, Any]) -> ModelConfig:
    from ..config import ConfigError, ModelConfig

    try:
        return ModelConfig(attention="softmax", task="text", **fields)
    except ConfigError as exc:
        raise HFImportError(f"config.json: {exc}") from exc


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFImportError(f"{path}: no such file; expected a Hugging Face model folder with config.json")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFImportError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise HFImportError(f"{path}: expected a JSON object")
    return data


def read_weights(folder: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    if (folder / SHARD_INDEX).is_file():
        return read_shards(folder)
    if (folder / "pytorch_model.bin").is_file():
        weights: dict[str, Any] = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return weights
    raise HFImportError(
        f"{folder}: no weights; expected model.safetensors, {SHARD_INDEX} with its shards, or pytorch_model.bin"
    )


def read_shards(folder: Path) -> dict[str, Any]:
    """Sharded safetensors: the index's weight_map names the file of every tensor."""
    from safetensors.torch import load_file

    weight_map = read_json(folder / SHARD_INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFImportError(f"{folder / SHARD_INDEX}: no weight_map; expected tensor name -> shard file")
    weights: dict[str, Any] = {}
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            raise HFImportError(f"{folder / shard}: no such file; {SHARD_INDEX} names it as a shard")
        weights.update(load_file(str(folder / shard)))
    return weights


def stored_dtype(weights: dict[str, Any]) -> torch.dtype | None:
    """The dtype most of the folder's floating-point tensors have: the file keeps it."""
    counts = Counter(t.dtype for t in weights.values() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else None


def fitted(state: dict[str, Any], model: Transformer) -> dict[str, Any]:
    """The mapped tensors the model has (a tied family's lm_head copy is left out), each of the model's shape."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise HFImportError(
            f"the weights have no tensor for {missing[0]} ({len(missing)} missing); expected every "
            "tensor of config.json's layers"
        )
    for name, want in expected.items():
        if tuple(state[name].shape) != tuple(want.shape):
            raise HFImportError(
                f"tensor {name} has shape {tuple(state[name].shape)}; config.json implies {tuple(want.shape)}"
            )
    return {name: state[name] for name in expected}


def check_vocabulary(tokenizer: str, vocab_size: int) -> None:
    """A tokenizer whose ids run past the model's vocabulary would make tokens the model has no row for."""
    from tokenizers import Tokenizer

    size = Tokenizer.from_str(tokenizer).get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise HFImportError(
            f"the tokenizer has {size} tokens but config.json's vocab_size is {vocab_size}; "
            "expected a tokenizer no larger than the model's vocabulary"
        )


def read_tokenizer(folder: Path) -> str:
    """The tokenizer as `tokenizers` JSON: tokenizer.json as it is, or GPT-2's byte-level BPE built from
    vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from .vocabulary import TOKENIZERS_TAKEN, piece_scheme

    if (folder / "tokenizer.json").is_file():
        try:
            stored = Tokenizer.from_file(str(folder / "tokenizer.json")).to_str()
        except Exception as exc:  # the library's own parse error, whatever its type
            raise HFImportError(
                f"{folder / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({exc})"
            ) from exc
        if piece_scheme(json.loads(stored)) is None:
            raise HFImportError(f"{folder / 'tokenizer.json'}: its tokens' bytes cannot be told; {TOKENIZERS_TAKEN}")
        return stored
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise HFImportError(f"{folder}: no tokenizer; expected tokenizer.json, or vocab.json and merges.txt")
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(GPT2_END_OF_TEXT) is not None:  # special in GPT2Tokenizer: never split, not text
        tokenizer.add_special_tokens([GPT2_END_OF_TEXT])
    return tokenizer.to_str()
