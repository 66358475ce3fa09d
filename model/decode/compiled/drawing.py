"""The compiled draw's inputs: the one layout its graphs are captured with and called in, for a caller's batch and
for a warm-up's scratch rows."""

from __future__ import annotations

import torch

from ...transformer import Transformer


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
