"""`rnnserve import hf DIR --out FILE.safetensors`: a Hugging Face GPT-2-family folder as an rnnserve model file.

Reads, with no network: `config.json`, the weights (`model.safetensors` or `pytorch_model.bin`) and the
tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`). GPT-2 is a softmax transformer of rnnserve's
shape with a vocabulary of its own, an output layer tied to the input embedding, GELU's tanh form and learned
positions, so its weights map one to one (GPT-2's Conv1D layers store their matrices transposed). The start
token is GPT-2's <|endoftext|>. The tokenizer is stored in the file's metadata: one file is the whole model.
Anything else (another architecture, a missing file, a tensor of the wrong shape) is one line and exit
status 2. torch is imported only when the command runs, so `--help` stays quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class HFImportError(ValueError):
    """The folder cannot be imported; the message says what is wrong and what is expected."""


GPT2_END_OF_TEXT = "<|endoftext|>"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=("hf",), help="hf: a Hugging Face model folder (GPT-2 family)")
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


def import_folder(folder: Path, out: Path):
    from .weights_io import save_model
    from .transformer import build_model

    hf = read_json(folder / "config.json")
    config = gpt2_config(hf)
    model = build_model(config)
    state = mapped_state(read_weights(folder), config.n_layers)
    check_shapes(state, model)
    model.load_state_dict(state, strict=True)
    info = {"imported_from": {"format": "hf", "folder": str(folder), "model_type": hf.get("model_type")}}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HFImportError(f"--out {out}: cannot create its folder ({exc.strerror})") from exc
    chat = hf_chat_template(folder)
    save_model(model.eval(), out, info, tokenizer=read_tokenizer(folder), chat_template=chat and chat.to_json())
    return config


def hf_chat_template(folder: Path):
    """The folder's chat template and special tokens' text (model/chat_template.py), None if it has none."""
    from .chat_template import ChatTemplateError, read_hf_chat_template

    try:
        return read_hf_chat_template(folder)
    except ChatTemplateError as exc:
        raise HFImportError(str(exc)) from exc


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


def gpt2_config(hf: dict[str, Any]):
    from .config import ConfigError, ModelConfig

    if hf.get("model_type") != "gpt2":
        raise HFImportError(
            f"unsupported architecture {hf.get('model_type')!r} "
            f"({', '.join(hf.get('architectures') or []) or 'no architectures listed'}); "
            "expected a GPT-2-family model (model_type gpt2)"
        )
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise HFImportError(
            f"unsupported activation_function {activation!r}; expected one of {', '.join(GPT2_ACTIVATIONS)}"
        )
    if not hf.get("tie_word_embeddings", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise HFImportError("unsupported GPT-2 variant: an untied output layer or attention scaled by layer index")
    d = hf.get("n_embd", 768)
    try:
        return ModelConfig(
            attention="softmax",
            task="text",
            d_model=d,
            n_layers=hf.get("n_layer", 12),
            n_heads=hf.get("n_head", 12),
            d_ff=hf.get("n_inner") or 4 * d,
            max_len=hf.get("n_positions", 1024),
            vocab_size=hf.get("vocab_size", 50257),
            bos_token=hf.get("bos_token_id", 50256),
            eos_token=hf.get("eos_token_id", 50256),
            tied_head=True,
            gelu=GPT2_ACTIVATIONS[activation],
            ln_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    except ConfigError as exc:
        raise HFImportError(f"config.json: {exc}") from exc


def read_weights(folder: Path) -> dict[str, Any]:
    import torch

    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise HFImportError(f"{folder}: no weights; expected model.safetensors or pytorch_model.bin")


def mapped_state(weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """GPT-2's tensor names (with or without the `transformer.` prefix) -> rnnserve's, Conv1D matrices
    transposed to nn.Linear's (out, in); the tied lm_head and the causal-mask buffers are dropped."""
    names = {
        "wte.weight": "tok_emb.weight",
        "wpe.weight": "pos_emb.weight",
        "ln_f.weight": "ln_f.weight",
        "ln_f.bias": "ln_f.bias",
    }
    parts = {
        "ln_1": "ln_attn",
        "attn.c_attn": "attn.qkv",
        "attn.c_proj": "attn.proj",
        "ln_2": "ln_ff",
        "mlp.c_fc": "ff.up",
        "mlp.c_proj": "ff.down",
    }
    for i in range(layers):
        for theirs, ours in parts.items():
            for kind in ("weight", "bias"):
                names[f"h.{i}.{theirs}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
    state = {}
    for name, tensor in weights.items():
        key = name.removeprefix("transformer.")
        if key in names:
            state[names[key]] = tensor.t().contiguous() if key.endswith(TRANSPOSED) else tensor
    return state


def check_shapes(state: dict[str, Any], model) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise HFImportError(
            f"the weights have no tensor for {missing[0]} ({len(missing)} missing); expected every "
            "GPT-2 tensor of config.json's n_layer layers"
        )
    for name, want in expected.items():
        if tuple(state[name].shape) != tuple(want.shape):
            raise HFImportError(
                f"tensor {name} has shape {tuple(state[name].shape)}; config.json implies {tuple(want.shape)}"
            )


def read_tokenizer(folder: Path) -> str:
    """The tokenizer as `tokenizers` JSON: tokenizer.json as it is, or GPT-2's byte-level BPE built from
    vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from .vocabulary import is_byte_level

    if (folder / "tokenizer.json").is_file():
        try:
            stored = Tokenizer.from_file(str(folder / "tokenizer.json")).to_str()
        except Exception as exc:  # the library's own parse error, whatever its type
            raise HFImportError(
                f"{folder / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({exc})"
            ) from exc
        if not is_byte_level(json.loads(stored)):
            raise HFImportError(
                f"{folder / 'tokenizer.json'}: not a byte-level BPE (its decoder is not ByteLevel); "
                "expected GPT-2's kind of tokenizer"
            )
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
