"""What a text model's token ids stand for: bytes (rnnserve's own models) or a tokenizer's tokens.

Every token is seen as the bytes it adds to the text (its *piece*): one byte
for byte models; for a byte-level BPE (GPT-2) the bytes its symbols map back
to, so a token may end in the middle of a UTF-8 character. Stop sequences,
incremental decoding and text offsets all work on those bytes, the same way
for both. Special tokens (GPT-2's <|endoftext|>) add no bytes.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import BYTE_VOCAB, ModelConfig

if TYPE_CHECKING:  # the library is loaded for models with a tokenizer only
    from tokenizers import Tokenizer

BYTES_NAME = "bytes"


@dataclass(frozen=True, eq=False)
class Vocabulary:
    name: str  # what /v1/models reports: "bytes", or the tokenizer's model type and size
    pieces: tuple[bytes, ...]  # (vocab_size,) the bytes each token adds to the text
    shown: tuple[str, ...]  # (vocab_size,) how logprobs name each token
    eos: int | None = None  # a generated end-of-text token ends the sample
    tokenizer_json: str | None = field(default=None, repr=False)  # None: a byte model
    special: frozenset[int] = frozenset()  # special tokens (<|endoftext|>): no bytes in `pieces`, their name shown

    @property
    def size(self) -> int:
        return len(self.pieces)

    @property
    def is_bytes(self) -> bool:
        """A byte model's: token id = byte, no tokenizer."""
        return self.tokenizer_json is None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The model's tokens for `text` as its tokenizer makes them by default, as Hugging Face's tokenizers do:
        the tokenizer's post-processor adds the special tokens the model expects (Llama's <s>; none for GPT-2)
        unless `add_special_tokens` is False (text that writes them itself, e.g. a rendered chat template).
        Special tokens written out in the text (e.g. <|endoftext|>) are recognised."""
        if self.is_bytes:
            return list(text.encode("utf-8"))
        return _tokenizer(self.tokenizer_json).encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def with_special_text(self) -> "Vocabulary":
        """The same tokens with each special token's name as its text (vLLM's skip_special_tokens false)."""
        if not self.special:
            return self
        pieces = tuple(self.shown[t].encode("utf-8") if t in self.special else p for t, p in enumerate(self.pieces))
        return Vocabulary(self.name, pieces, self.shown, self.eos, self.tokenizer_json, self.special)

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", errors="replace")


def shown_bytes(piece: bytes) -> str:
    """A token as logprobs show it: its text when that is whole UTF-8, else OpenAI's `bytes:\\xNN...` form."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


@functools.cache
def byte_vocabulary() -> Vocabulary:
    pieces = tuple(bytes((b,)) for b in range(BYTE_VOCAB))
    return Vocabulary(BYTES_NAME, pieces, tuple(map(shown_bytes, pieces)))


def vocabulary_for(config: ModelConfig, tokenizer_json: str | None) -> Vocabulary:
    """The vocabulary of a model: its stored tokenizer's, else bytes."""
    if tokenizer_json is None:
        return byte_vocabulary()
    return _tokenizer_vocabulary(tokenizer_json, config.vocab_size, config.eos_token if config.eos_token >= 0 else None)


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer_json: str) -> Tokenizer:
    from tokenizers import Tokenizer  # only models with a tokenizer need the library loaded

    return Tokenizer.from_str(tokenizer_json)


@functools.lru_cache(maxsize=8)
def _tokenizer_vocabulary(tokenizer_json: str, size: int, eos: int | None) -> Vocabulary:
    tokenizer = _tokenizer(tokenizer_json)
    spec = json.loads(tokenizer_json)
    special = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
    if eos is not None:
        special.add(eos)
    scheme = piece_scheme(spec)
    if scheme is None:
        raise ValueError(f"the stored tokenizer's pieces are not bytes rnnserve can read: {TOKENIZERS_TAKEN}")
    piece_of = _byte_level_piece if scheme == "byte_level" else _metaspace_piece
    pieces, shown = [], []
    for token in range(size):
        symbol = tokenizer.id_to_token(token)
        if symbol is None:  # a model's vocabulary may be padded past its tokenizer's
            pieces.append(b"")
            shown.append(f"<unused {token}>")
        elif token in special:
            pieces.append(b"")
            shown.append(symbol)
        else:
            piece = piece_of(symbol)
            pieces.append(piece)
            shown.append(shown_bytes(piece))
    kind = (spec.get("model") or {}).get("type") or "tokenizer"
    special_in_range = frozenset(t for t in special if t < size)
    return Vocabulary(f"{kind} ({size} tokens)", tuple(pieces), tuple(shown), eos, tokenizer_json, special_in_range)


TOKENIZERS_TAKEN = (
    "expected a byte-level BPE (GPT-2's, Llama 3's, Qwen2's: decoder ByteLevel) or a SentencePiece BPE with byte "
    "fallback (Llama 2's, Mistral's: decoders Replace '▁' and ByteFallback)"
)
METASPACE = "▁"  # SentencePiece's mark for a space
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token: one byte of a character not in the vocabulary


def piece_scheme(spec: dict[str, Any]) -> str | None:
    """How a tokenizer's symbols stand for the bytes of the text: "byte_level" (GPT-2's scheme: each byte written as
    one printable symbol), "metaspace" (SentencePiece BPE: text with spaces as '▁', and <0xNN> tokens for bytes the
    vocabulary lacks), or None (a tokenizer whose pieces rnnserve cannot tell)."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {part.get("type") for part in parts}
    if "ByteLevel" in kinds:
        return "byte_level"
    spaces = "Metaspace" in kinds or any(
        part.get("type") == "Replace" and (part.get("pattern") or {}).get("String") == METASPACE for part in parts
    )
    return "metaspace" if spaces and "ByteFallback" in kinds else None


def _metaspace_piece(symbol: str) -> bytes:
    """A SentencePiece symbol's bytes: '▁' is a space, <0xNN> the byte NN. (SentencePiece's decoder also drops the
    space a text begins with; a piece keeps it, as a continuation after a prompt does.)"""
    byte = BYTE_TOKEN.fullmatch(symbol)
    return bytes((int(byte.group(1), 16),)) if byte else symbol.replace(METASPACE, " ").encode("utf-8")


@functools.cache
def _symbol_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the others for 256 + n, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    symbols.update({chr(256 + n): b for n, b in enumerate(others)})
    return symbols


def _byte_level_piece(symbol: str) -> bytes:
    table = _symbol_bytes()
    if any(ch not in table for ch in symbol):  # an added, non-special token written as plain text
        return symbol.encode("utf-8")
    return bytes(table[ch] for ch in symbol)
