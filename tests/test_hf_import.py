"""`rnnserve import hf`: a GPT-2 folder written by Hugging Face's own `save_pretrained` (a small random model, made
here: nothing is downloaded) becomes an rnnserve file whose logits, greedy tokens and tokenizer are Hugging Face's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.io.weights import load_model, read_tokenizer
from rnnserve_cli import main

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)
tokenizers = pytest.importorskip("tokenizers")

from hf_support import UNICODE, gpt2_folder, imported  # noqa: E402  (fixtures; after the skip)

__all__ = ["gpt2_folder", "imported"]


def hf_model(folder: Path):
    return transformers.GPT2LMHeadModel.from_pretrained(folder).eval()


def test_the_logits_are_hugging_face_s(gpt2_folder, imported):
    model, _ = load_model(imported)
    ids = torch.randint(0, model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf_model(gpt2_folder)(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-4


def test_64_greedy_tokens_are_hugging_face_s(gpt2_folder, imported):
    model, _ = load_model(imported)
    prompt = torch.tensor([[5, 17, 42, 99, 7]])
    greedy = BatchSampling.from_params([SamplingParams(temperature=0.0)])
    ours = generate(model, prompt, prompt.shape[1] + 64, greedy, compiled=False)
    hf = hf_model(gpt2_folder)
    hf.generation_config.eos_token_id = None  # 64 tokens whatever they are, as `generate` here draws
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    assert ours[0].tolist() == theirs[0].tolist()  # the prompt as given: no start token before it


def test_the_stored_tokenizer_encodes_and_decodes_as_hugging_face_s(gpt2_folder, imported):
    ours = tokenizers.Tokenizer.from_str(read_tokenizer(imported))
    theirs = transformers.AutoTokenizer.from_pretrained(gpt2_folder)
    ids = ours.encode(UNICODE).ids
    assert ids == theirs.encode(UNICODE) and len(ids) > 5
    assert ours.decode(ids) == theirs.decode(ids) == UNICODE


def test_the_imported_file_describes_a_tied_gpt2(imported):
    model, info = load_model(imported)
    config = model.config
    assert (config.attention, config.tied_head, config.gelu, config.max_len) == ("softmax", True, "tanh", 128)
    end = tokenizers.Tokenizer.from_str(read_tokenizer(imported)).token_to_id("<|endoftext|>")
    assert config.bos == end and config.vocab_in == config.vocab_size and info["imported_from"]["format"] == "hf"
    assert "head.weight" not in model.state_dict()  # the embedding is stored once


def test_a_folder_built_from_vocab_and_merges_tokenizes_the_same(gpt2_folder, imported, tmp_path):
    folder = tmp_path / "no-tokenizer-json"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((gpt2_folder / name).read_bytes())
    # GPT-2's original tokenizer files, as older folders have them instead of tokenizer.json
    written = tokenizers.Tokenizer.from_file(str(gpt2_folder / "tokenizer.json")).model.save(str(folder))
    assert sorted(Path(p).name for p in written) == ["merges.txt", "vocab.json"]
    out = tmp_path / "from-merges.safetensors"
    assert main(["import", "hf", str(folder), "--out", str(out)]) == 0
    a, b = (tokenizers.Tokenizer.from_str(read_tokenizer(p)) for p in (imported, out))
    text = "To be, or not to be: Grüße"
    assert a.encode(text).ids == b.encode(text).ids


def word_level_tokenizer():
    """A tokenizer whose tokens are words, not bytes: what a token stands for in the text is not known."""
    return tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
            ),
            "unsupported architecture 'falcon' (FalconForCausalLM); expected one of model_type gpt2, llama",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "vocab_size": 349})
            ),
            "the tokenizer has 350 tokens but config.json's vocab_size is 349",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "scale_attn_weights": False})
            ),
            "unsupported scale_attn_weights False; expected true",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "scale_attn_by_inverse_layer_idx": True})
            ),
            "unsupported scale_attn_by_inverse_layer_idx True",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "tie_word_embeddings": False})
            ),
            "unsupported tie_word_embeddings False",
        ),
        (
            lambda f: (f / "model.safetensors").unlink(),
            "no weights; expected model.safetensors, model.safetensors.index",
        ),
        (
            lambda f: (f / "tokenizer.json").unlink(),
            "no tokenizer; expected tokenizer.json, or vocab.json and merges.txt",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "n_embd": 32})
            ),
            "tensor tok_emb.weight has shape",
        ),
        (
            lambda f: word_level_tokenizer().save(str(f / "tokenizer.json")),
            "its tokens' bytes cannot be told; expected a byte-level BPE",
        ),
    ],
)
def test_a_folder_that_cannot_be_imported_is_one_line_and_exit_2(gpt2_folder, tmp_path, capsys, damage, message):
    folder = tmp_path / "damaged"
    folder.mkdir()
    for path in gpt2_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    damage(folder)
    assert main(["import", "hf", str(folder), "--out", str(tmp_path / "x.safetensors")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rnnserve import: error: ") and message in line
    assert not (tmp_path / "x.safetensors").exists()
