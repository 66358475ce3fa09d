"""A small GPT-2 folder written by Hugging Face's own `save_pretrained` (random weights, a byte-level BPE trained
here: nothing is downloaded), and the rnnserve file `rnnserve import hf` makes of it. Test modules that use these
fixtures import them after `pytest.importorskip("transformers")`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rnnserve_cli import main

UNICODE = "Grüße, 世界! naïve café: ∑ x² — 🙂 ok"
CORPUS = [
    "To be, or not to be, that is the question.",
    "Grüße aus Köln, naïve café, 世界 and 🙂 again.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows.",
] * 20
END_OF_TEXT = "<|endoftext|>"


def byte_level_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def save_gpt2_folder(folder: Path, seed: int = 0, start_token: bool = False) -> Path:
    """start_token: the tokenizer's post-processor puts <|endoftext|> before every text it encodes (as Llama's
    puts <s>), so that encoding with and without the special tokens differ."""
    import transformers
    from tokenizers.processors import TemplateProcessing

    trained = byte_level_tokenizer(400)
    if start_token:
        special = (END_OF_TEXT, trained.token_to_id(END_OF_TEXT))
        trained.post_processor = TemplateProcessing(single=f"{END_OF_TEXT} $A", special_tokens=[special])
    tokenizer = transformers.GPT2TokenizerFast(
        tokenizer_object=trained, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT, unk_token=END_OF_TEXT
    )
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=end,
        eos_token_id=end,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # weights at a scale where every layer matters to the logits
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    return save_gpt2_folder(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def imported(gpt2_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "gpt2-tiny.safetensors"
    assert main(["import", "hf", str(gpt2_folder), "--out", str(out)]) == 0
    return out
