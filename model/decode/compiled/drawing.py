"""The compiled draw's inputs: the one layout its graphs are captured with and called in, for a caller's batch and
for a warm-up's scratch rows; and what the C++ draw (model/kernels/categorical_draw.cpp) takes instead."""

from __future__ import annotations

import torch

from ...transformer import Transformer
from ..sampling import BatchSampling

# The C++ draw's per-row inputs: (n,) float32 temperatures, int64 seeds and int64 positions.
DrawRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def kernel_draw_rows(params: BatchSampling, position: torch.Tensor) -> DrawRows | None:
    """The rows' inputs of the C++ draw when it takes them: no row asking for top-k, top-p or min-p (known, not read
    back), CPU tensors of its dtypes. Else None: the caller draws another way. Plain attribute reads: they run
    before every token."""
    temperature, seed = params.temperature, params.seed
    if (
        params.filters is not False
        or temperature.dtype is not torch.float32
        or seed.dtype is not torch.long
        or position.dtype is not torch.long
        or not (temperature.is_cpu and seed.is_cpu and position.is_cpu)
    ):
        return None
    return temperature, seed, position


def kernel_takes_logits(logits: torch.Tensor) -> bool:
    """Whether the C++ draw takes these logits as they are: (n, V) float32 on the CPU, unit stride along V."""
    return logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 2 and logits.stride(1) == 1


def draw_inputs(logits: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The draw's inputs in the one layout its graphs were captured with, which their guard-free calls rely
    on: (n, V) float32 logits, then temperature float32, seed and position int64, (n,) each; unit strides
    (a prefill's last position is a strided view); made under inference mode. None for other shapes."""
    if logits.dim() != 2 or any(t.shape != logits.shape[:1] for t in rows):
        return None
    typed = (logits.float(), rows[0].float(), rows[1].long(), rows[2].long())
    return tuple(
        t if t.is_contiguous() and t.is_inference() else t.clone(memory_format=torch.contiguous_format) for t in typed
    )


def draw_scratch(model: Transformer, rows: int) -> tuple[torch.Tensor, ...]:
    """Inputs of an unfiltered draw for `rows` rows, laid out as `draw_inputs` lays a caller's out."""
    device = model.device
    scratch = draw_inputs(
        torch.zeros(rows, model.config.vocab_out, device=device),
        torch.ones(rows, device=device),
        torch.zeros(rows, dtype=torch.long, device=device),
        torch.zeros(rows, dtype=torch.long, device=device),
    )
    assert scratch is not None  # made in the layout the draw takes
    return scratch
