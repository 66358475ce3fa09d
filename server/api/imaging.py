"""Occluded 28x28 digits in, PNGs out.

An occluded image is a grid of grey levels plus a boolean grid of unknown
pixels. Unknown pixels come from the PNG's alpha channel (alpha 0), an
explicit mask (PNG: bright = unknown; lists: 1 = unknown) or `keep_rows`
(rows 0..k-1 known). In raster order the pixels before the first unknown
one are the prompt; known pixels after it are forced, not resampled.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

SIDE = 28
PIXELS = SIDE * SIDE
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MASK_THRESHOLD = 128  # mask PNG grey level at or above which a pixel is unknown
HOW_TO_MARK = {  # per field the digit came in: a PNG has alpha, grey levels have no way to say "unknown"
    "image": "mark unknown pixels with alpha 0 in the PNG, a `mask` (PNG: white = unknown; 28x28 lists: "
    "1 = unknown), or `keep_rows` < 28",
    "pixels": "with `pixels`, mark unknown pixels with a `mask` (28x28 lists: 1 = unknown; PNG: white = unknown) "
    "or `keep_rows` < 28 (rows 0..k-1 known), as grey levels cannot mark them",
}


class ImageError(ValueError):
    """Bad image input; `param` names the request field at fault."""

    def __init__(self, message: str, param: str, code: str = "invalid_image"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class DecodedPNG:
    grey: np.ndarray  # (28, 28) uint8
    transparent: np.ndarray | None  # (28, 28) bool, alpha == 0; None without alpha


@dataclass(frozen=True)
class OccludedImage:
    pixels: np.ndarray  # (28, 28) uint8
    unknown: np.ndarray  # (28, 28) bool, at least one True

    @property
    def first_unknown(self) -> int:
        return int(np.flatnonzero(self.unknown.reshape(-1))[0])

    def prompt(self) -> list[int]:
        """Pixels before the first unknown one, raster order."""
        return self.pixels.reshape(-1)[: self.first_unknown].tolist()

    def forced(self) -> dict[int, int]:
        """{position: grey} for known pixels after the first unknown one."""
        flat, known = self.pixels.reshape(-1), ~self.unknown.reshape(-1)
        positions = np.flatnonzero(known)
        return {int(p): int(flat[p]) for p in positions if p > self.first_unknown}

    @property
    def unknown_count(self) -> int:
        return int(self.unknown.sum())


def decode_base64(text: str, param: str) -> bytes:
    """Base64 (optionally a `data:image/png;base64,` URL) -> bytes."""
    if text.startswith("data:"):
        _, _, text = text.partition(",")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{param} is not valid base64; expected a base64-encoded 28x28 PNG", param) from None


def decode_png(data: bytes, param: str) -> DecodedPNG:
    """PNG bytes -> grey levels and the alpha-0 pixels, checking format and size."""
    if not data.startswith(PNG_SIGNATURE):
        raise ImageError(f"{param} is not a PNG ({_describe_format(data)}); expected a 28x28 PNG image", param)
    img = _load(data, param)
    return DecodedPNG(_grey(img), _transparent(img))


def _load(data: bytes, param: str) -> Image.Image:
    damaged = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)
    try:
        img = Image.open(io.BytesIO(data))
    except damaged as exc:
        raise ImageError(
            f"{param} is a damaged PNG ({_reason(exc)}); expected a valid 28x28 PNG image", param
        ) from None
    if img.size != (SIDE, SIDE):  # from the header, before decoding any pixel
        w, h = img.size
        raise ImageError(f"{param} is {w}x{h} pixels; expected {SIDE}x{SIDE}", param)
    try:
        img.load()
    except damaged as exc:
        raise ImageError(
            f"{param} is a damaged PNG ({_reason(exc)}); expected a valid 28x28 PNG image", param
        ) from None
    return img


def _reason(exc: Exception) -> str:
    """Pillow's reason, without the in-memory file object it names when it cannot identify an image."""
    if isinstance(exc, UnidentifiedImageError):
        return "its header cannot be read: the file is cut short or not an image"
    return str(exc)


def _grey(img: Image.Image) -> np.ndarray:
    if img.mode.startswith("I"):  # 16-bit grey: scale, do not clip, to 0..255
        return (np.asarray(img, dtype=np.float64) / 257.0).round().clip(0, 255).astype(np.uint8)
    return np.asarray(img.convert("L"), dtype=np.uint8)


def _transparent(img: Image.Image) -> np.ndarray | None:
    if img.mode not in ("RGBA", "LA", "PA") and "transparency" not in img.info:
        return None
    alpha = np.asarray(img.convert("RGBA"))[..., 3]
    return alpha == 0


def _describe_format(data: bytes) -> str:
    if not data:
        return "it is empty"
    try:
        with Image.open(io.BytesIO(data)) as img:
            return f"it is {img.format or 'another format'}"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return "it is not an image"


def grid_from_lists(rows: list[list[int]], param: str, low: int = 0, high: int = 255) -> np.ndarray:
    """28 lists of 28 ints in [low, high] -> (28, 28) uint8."""
    if len(rows) != SIDE or any(len(r) != SIDE for r in rows):
        shape = f"{len(rows)} rows" + (f" of lengths {sorted({len(r) for r in rows})}" if rows else "")
        raise ImageError(f"{param} has {shape}; expected {SIDE} rows of {SIDE} values", param)
    try:
        grid = np.asarray(rows, dtype=np.int64)
    except OverflowError:
        raise ImageError(
            f"{param} holds an integer too large for a grey level; expected values in {low}..{high}", param
        ) from None
    bad = (grid < low) | (grid > high)
    if bad.any():
        r, c = map(int, np.argwhere(bad)[0])
        raise ImageError(f"{param}[{r}][{c}] is {int(grid[r, c])}; expected values in {low}..{high}", param)
    return grid.astype(np.uint8)


def mask_from_png(png: DecodedPNG) -> np.ndarray:
    """A mask image: bright pixels (or transparent ones) are unknown."""
    unknown = png.grey >= MASK_THRESHOLD
    return unknown | png.transparent if png.transparent is not None else unknown


def mask_from_keep_rows(keep_rows: int) -> np.ndarray:
    unknown = np.ones((SIDE, SIDE), dtype=bool)
    unknown[:keep_rows] = False
    return unknown


def choose_unknown(
    transparent: np.ndarray | None, mask: np.ndarray | None, keep_rows: int | None, digit: str = "image"
) -> tuple[np.ndarray | None, str]:
    """Which pixels are unknown: an explicit mask or keep_rows wins over the digit's own (a PNG's alpha channel;
    `pixels` have none). Returns them and the field that marked them."""
    if mask is not None and keep_rows is not None:
        raise ImageError(
            "give either `mask` or `keep_rows` to mark the unknown pixels, not both", "keep_rows", "invalid_value"
        )
    if mask is not None:
        return mask, "mask"
    if keep_rows is not None:
        return mask_from_keep_rows(keep_rows), "keep_rows"
    return transparent, digit


def occlude(pixels: np.ndarray, unknown: np.ndarray | None, source: str, digit: str = "image") -> OccludedImage:
    """Pair pixels with their unknown mask, refusing a mask with nothing to complete. `digit` is the field the
    pixels came in (`image` or `pixels`): the hint names only the ways that field's requests can mark pixels."""
    if unknown is None or not unknown.any():
        raise ImageError(
            f"{source} marks no unknown pixel, so there is nothing to complete; {HOW_TO_MARK[digit]}", source
        )
    return OccludedImage(pixels, unknown)


def encode_png(pixels: np.ndarray) -> bytes:
    """(H, W) grey levels -> PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def encode_strip(images: list[np.ndarray]) -> bytes:
    """n (28, 28) images side by side -> one (28, 28n) PNG."""
    return encode_png(np.concatenate(images, axis=1))


def read_mask_png(data: bytes) -> np.ndarray:
    """A mask PNG's bytes -> (28, 28) bool, True where unknown (white or transparent); ImageError if it is not one."""
    return mask_from_png(decode_png(data, "mask"))
