"""Typed decoding states, batched along dimension 0.

Every attention kind keeps its per-layer state in a dataclass derived from
`RowState`: all tensor fields are batched along dim 0, so resetting, copying
or moving one row (one sequence in a continuous batch) is the same generic
operation for every kind.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# Rows of a batch, as the engine names them: one, a list or range of them, or an index tensor.
Rows = int | Sequence[int] | torch.Tensor


def _tensor_fields(obj: RowState) -> Iterator[tuple[str, torch.Tensor]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            yield f.name, value


@dataclass
class RowState:
    """Base for per-layer states; every tensor field has batch on dim 0."""

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in _tensor_fields(self)]

    @property
    def batch_size(self) -> int:
        return self.tensors()[0].shape[0]

    def reset_rows(self, rows: torch.Tensor) -> None:
        for t in self.tensors():
            t[rows] = 0

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def write_rows(self, dst: torch.Tensor, other: "RowState") -> None:
        """Copy every row of `other` (a smaller batch) into rows `dst` of self."""
        for t, o in zip(self.tensors(), other.tensors(), strict=True):
            t[dst] = o.to(t.dtype)

    # Whether `snapshot_row` keeps everything the row's future depends on (a prefix cache may reuse it).
    snapshots_exact = True
    # Whether a snapshot's first `length` positions are the state after its first `length` tokens, so that
    # `restore_row` may take them from a longer one: caches kept by position; not a constant-size state, which
    # holds no earlier state.
    snapshots_truncate = False

    def snapshot_row(self, row: int, length: int) -> list[torch.Tensor]:
        """A copy of what row `row` holds after `length` tokens: the whole row for a constant-size state."""
        del length
        return [t[row].clone() for t in self.tensors()]

    def restore_row(self, row: int, saved: list[torch.Tensor], length: int) -> None:
        """Write a `snapshot_row` copy back into row `row` (where `snapshots_truncate`, the first `length`
        positions of a longer one)."""
        del length
        for t, s in zip(self.tensors(), saved, strict=True):
            t[row].copy_(s)

    def slice(self, start: int, stop: int) -> "RowState":
        """A view of rows [start, stop): in-place updates write through to self."""
        return dataclasses.replace(self, **{name: t[start:stop] for name, t in _tensor_fields(self)})

    def nbytes(self) -> int:
        """Bytes allocated for all rows."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def nbytes_in_use(self, lengths: torch.Tensor) -> int:
        """Bytes that hold information for rows 0..len(lengths)-1, of the given lengths.

        A constant-size state uses all of its rows' bytes; caches override this.
        """
        return self.row_bytes * lengths.numel()

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes allocated per row (read every step for the metrics: computed once)."""
        return self.nbytes() // self.batch_size


@dataclass
class ModelState:
    """Whole-model state: one RowState per layer plus tokens seen per row."""

    layers: list[RowState]
    lengths: torch.Tensor  # (B,) int64, tokens consumed so far per row

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def _as_index(self, rows: Rows) -> torch.Tensor:
        return torch.as_tensor(rows, dtype=torch.long, device=self.lengths.device).reshape(-1)

    def reset_rows(self, rows: Rows) -> None:
        """Make rows empty, ready for a new sequence."""
        idx = self._as_index(rows)
        self.lengths[idx] = 0
        for layer in self.layers:
            layer.reset_rows(idx)

    def copy_rows(self, src: Rows, dst: Rows) -> None:
        """Duplicate rows src into rows dst (n > 1 samples of one prompt)."""
        s, d = self._as_index(src), self._as_index(dst)
        self.lengths[d] = self.lengths[s]
        for layer in self.layers:
            layer.copy_rows(s, d)

    def write_rows(self, dst: Rows, other: "ModelState") -> None:
        """Copy all rows of `other` (e.g. a batch-1 prefill) into rows dst; a 1-row `other` fills every one."""
        d = self._as_index(dst)
        self.lengths[d] = other.lengths.to(self.lengths.device)
        for layer, o in zip(self.layers, other.layers, strict=True):
            layer.write_rows(d, o)

    def slice(self, start: int, stop: int) -> "ModelState":
        """A view of rows [start, stop): the live rows of a compacted batch, or
        one row to prefill in place. Updates write through to self."""
        return ModelState([layer.slice(start, stop) for layer in self.layers], self.lengths[start:stop])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers) + self.lengths.numel() * 8

    def nbytes_in_use(self, rows: int | None = None) -> int:
        """Bytes holding information for all rows, or for rows [0, rows) (the live rows of a compacted batch)."""
        lengths = self.lengths if rows is None else self.lengths[:rows]
        return sum(layer.nbytes_in_use(lengths) for layer in self.layers)
