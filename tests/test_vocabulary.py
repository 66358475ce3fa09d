"""What a token stands for: each token of an imported GPT-2's byte-level BPE adds the bytes Hugging Face's tokenizer
decodes it to, so text joined from the pieces is the text, and a token may end inside a character."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)

from hf_support import CORPUS, UNICODE, gpt2_folder, imported  # noqa: E402  (fixtures; after the skip)

from model.io.vocabulary import Vocabulary, byte_vocabulary, vocabulary_for  # noqa: E402
from model.io.weights import read_metadata, read_tokenizer  # noqa: E402

__all__ = ["gpt2_folder", "imported"]


@pytest.fixture(scope="module")
def vocabulary(imported) -> Vocabulary:
    config, _ = read_metadata(imported)
    return vocabulary_for(config, read_tokenizer(imported))


@pytest.fixture(scope="module")
def hf_tokenizer(gpt2_folder):
    return transformers.AutoTokenizer.from_pretrained(gpt2_folder)


def test_every_token_s_piece_decodes_as_hugging_face_decodes_it(vocabulary, hf_tokenizer):
    end = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert vocabulary.size == len(hf_tokenizer) and vocabulary.eos == end
    for token in range(vocabulary.size):
        if token != end:
            assert vocabulary.pieces[token].decode("utf-8", errors="replace") == hf_tokenizer.decode([token])
    assert (vocabulary.pieces[end], vocabulary.shown[end]) == (b"", "<|endoftext|>")


def test_pieces_join_to_the_text_and_some_end_inside_a_character(vocabulary, hf_tokenizer):
    for text in (UNICODE, *CORPUS[:3]):
        ids = hf_tokenizer.encode(text)
        assert vocabulary.encode(text) == ids
        assert b"".join(vocabulary.pieces[t] for t in ids) == text.encode("utf-8")
    partial = [s for s in vocabulary.shown if s.startswith("bytes:")]
    assert partial and all(s.startswith("bytes:\\x") for s in partial)


def test_a_byte_model_s_tokens_are_its_bytes():
    vocabulary = byte_vocabulary()
    assert vocabulary.encode("é") == [0xC3, 0xA9] and vocabulary.decode([0xC3, 0xA9]) == "é"
    assert vocabulary.tokenizer_json is None and vocabulary.eos is None
