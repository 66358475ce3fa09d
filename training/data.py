"""Training data: MNIST in IDX files (gzip or plain) and raw UTF-8 text as bytes (or, for a model with a
tokenizer, as its token ids).

Nothing here is global: each loader takes a path and returns uint8 tensors.
MNIST image sets are found by glob so that both the standard names
(`train-images-idx3-ubyte.gz`, `t10k-images-idx3-ubyte.gz`) and renamed
subsets (`train10k-images-idx3-ubyte.gz`) work from any folder.
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
MNIST_SIDE = 28
MNIST_PIXELS = MNIST_SIDE * MNIST_SIDE
TEXT_TRAIN_FRACTION = 0.9


class DataError(ValueError):
    """A data file or folder is missing or malformed; the message says what was expected."""


@dataclass(frozen=True)
class MnistSplit:
    images: torch.Tensor  # (N, 784) uint8 grey levels, raster order
    path: str  # the images file it came from


@dataclass(frozen=True)
class LabeledMnist:
    images: torch.Tensor  # (N, 784) uint8 grey levels, raster order
    labels: torch.Tensor  # (N,) uint8 digits 0-9
    path: str  # the images file they came from


@dataclass(frozen=True)
class TextSplits:
    train: torch.Tensor  # (N_train,) uint8 bytes, or int32 token ids of a model's tokenizer
    valid: torch.Tensor  # (N_valid,) the same
    path: str


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"{path}: corrupt gzip data ({exc})") from exc
    return raw


def read_idx_images(path: str | Path) -> torch.Tensor:
    """One IDX3 images file -> (N, rows*cols) uint8. Checks magic and sizes."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; expected an IDX images file such as train-images-idx3-ubyte.gz")
    raw = _read_bytes(path)
    if len(raw) < 16:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX images header (16 bytes)")
    magic, count, rows, cols = struct.unpack(">iiii", raw[:16])
    if magic != IMAGES_MAGIC:
        raise DataError(f"{path}: magic number {magic}, expected {IMAGES_MAGIC} (IDX3 unsigned-byte images)")
    if (rows, cols) != (MNIST_SIDE, MNIST_SIDE):
        raise DataError(f"{path}: images are {rows}x{cols}, expected {MNIST_SIDE}x{MNIST_SIDE}")
    expected = 16 + count * rows * cols
    if len(raw) != expected:
        raise DataError(f"{path}: {len(raw)} bytes, expected {expected} for {count} images of {rows}x{cols}")
    pixels = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows * cols)
    return torch.from_numpy(pixels.copy())


def read_idx_labels(path: str | Path) -> torch.Tensor:
    """One IDX1 labels file -> (N,) uint8 digits 0-9. Checks magic, size and range."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: no such file; expected the IDX labels file that goes with the images "
            "(e.g. t10k-labels-idx1-ubyte.gz beside t10k-images-idx3-ubyte.gz)"
        )
    raw = _read_bytes(path)
    if len(raw) < 8:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX labels header (8 bytes)")
    magic, count = struct.unpack(">ii", raw[:8])
    if magic != LABELS_MAGIC:
        raise DataError(f"{path}: magic number {magic}, expected {LABELS_MAGIC} (IDX1 unsigned-byte labels)")
    if len(raw) != 8 + count:
        raise DataError(f"{path}: {len(raw)} bytes, expected {8 + count} for {count} labels")
    labels = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=8).copy())
    if labels.numel() and int(labels.max()) > 9:
        raise DataError(f"{path}: holds label {int(labels.max())}; expected digits 0-9")
    return labels


def write_idx_labels(path: str | Path, labels: torch.Tensor, compress: bool = True) -> None:
    """Write (N,) digit labels as an IDX1 file (tests and users with their own digits)."""
    payload = struct.pack(">ii", LABELS_MAGIC, labels.numel()) + labels.to(torch.uint8).numpy().tobytes()
    Path(path).write_bytes(gzip.compress(payload) if compress else payload)


def labels_file_for(images_file: str | Path) -> Path:
    """The labels file beside an images file: `X-images-idx3-ubyte[.gz]` -> `X-labels-idx1-ubyte[.gz]`."""
    images_file = Path(images_file)
    if "-images-idx3-ubyte" not in images_file.name:
        raise DataError(
            f"{images_file}: cannot tell its labels file; expected a name like "
            "t10k-images-idx3-ubyte.gz with t10k-labels-idx1-ubyte.gz beside it"
        )
    return images_file.with_name(images_file.name.replace("-images-idx3-ubyte", "-labels-idx1-ubyte"))


def write_idx_images(path: str | Path, images: torch.Tensor, compress: bool = True) -> None:
    """Write (N, 784) uint8 images as an IDX3 file (tests and users with their own digits)."""
    images = images.to(torch.uint8).reshape(-1, MNIST_PIXELS)
    header = struct.pack(">iiii", IMAGES_MAGIC, images.shape[0], MNIST_SIDE, MNIST_SIDE)
    payload = header + images.numpy().tobytes()
    Path(path).write_bytes(gzip.compress(payload) if compress else payload)


def find_images_file(folder: str | Path, split: str) -> Path:
    """The images file of `split` ("train" or "test") in `folder`, by glob.

    train matches train*-images-idx3-ubyte[.gz]; test matches t10k*/test*.
    """
    folder = Path(folder)
    if folder.is_file():
        return folder
    if not folder.is_dir():
        raise DataError(f"{folder}: no such file or folder; expected a folder holding MNIST IDX files")
    prefixes = ("train",) if split == "train" else ("t10k", "test")
    found = sorted(p for pre in prefixes for p in folder.glob(f"{pre}*-images-idx3-ubyte*") if p.suffix in ("", ".gz"))
    if not found:
        names = ", ".join(sorted(p.name for p in folder.iterdir())[:10]) or "nothing"
        raise DataError(
            f"{folder}: no {split} images file; expected e.g. {prefixes[0]}-images-idx3-ubyte.gz (found: {names})"
        )
    if len(found) > 1:
        raise DataError(
            f"{folder}: several {split} images files ({', '.join(p.name for p in found)}); "
            f"pass the one to use as --data"
        )
    return found[0]


def load_mnist(path: str | Path, split: str) -> MnistSplit:
    """MNIST `split` ("train" or "test") from a folder or an images file."""
    if split not in ("train", "test"):
        raise DataError(f"unknown MNIST split {split!r}; expected train or test")
    file = find_images_file(path, split)
    return MnistSplit(read_idx_images(file), str(file))


def load_labeled_mnist(path: str | Path, split: str) -> LabeledMnist:
    """MNIST `split` with its labels, from a folder or an images file (labels file beside it)."""
    images = load_mnist(path, split)
    labels_path = labels_file_for(images.path)
    labels = read_idx_labels(labels_path)
    if labels.shape[0] != images.images.shape[0]:
        raise DataError(
            f"{labels_path}: {labels.shape[0]} labels for {images.images.shape[0]} images in "
            f"{images.path}; expected one label per image"
        )
    return LabeledMnist(images.images, labels, images.path)


def load_text(path: str | Path, encode: Callable[[str], list[int]] | None = None) -> TextSplits:
    """A UTF-8 text file as bytes, or as the tokens `encode` makes of it: first 90% train, last 10% validation
    (cut by bytes, at the start of a character when tokenized)."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "no such file"
        raise DataError(f"{path}: {what}; expected a UTF-8 text file (e.g. tinyshakespeare/input.txt)")
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 at byte {exc.start}; expected a UTF-8 text file") from exc
    if len(raw) < 20:
        raise DataError(f"{path}: only {len(raw)} bytes; need at least 20 to split 90/10 into train and validation")
    cut = int(len(raw) * TEXT_TRAIN_FRACTION)
    if encode is not None:
        while cut < len(raw) and raw[cut] & 0xC0 == 0x80:  # a continuation byte: the character began earlier
            cut += 1
        train, valid = (
            torch.tensor(encode(part.decode("utf-8")), dtype=torch.int32) for part in (raw[:cut], raw[cut:])
        )
        return TextSplits(train, valid, str(path))
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return TextSplits(data[:cut].clone(), data[cut:].clone(), str(path))


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """(B, 784) -> (B, 784), each image moved by up to max_shift pixels along each axis, filled with 0."""
    if max_shift == 0:
        return images
    b = images.shape[0]
    padded = F.pad(images.view(b, MNIST_SIDE, MNIST_SIDE), (max_shift,) * 4)  # (B, 28 + 2s, 28 + 2s)
    offsets = torch.randint(0, 2 * max_shift + 1, (2, b), generator=generator)  # crop corner per image
    span = torch.arange(MNIST_SIDE)
    rows = (offsets[0][:, None] + span)[:, :, None]  # (B, 28, 1)
    cols = (offsets[1][:, None] + span)[:, None, :]  # (B, 1, 28)
    return padded[torch.arange(b)[:, None, None], rows, cols].reshape(b, -1)
