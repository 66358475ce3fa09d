"""Each row class's compiled step and draw: traced once on scratch rows made as the decoder's own (the warm-up), then
captured for the decoder's own inputs, so that its calls skip dynamo's guard checks."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...state import ModelState
from ...transformer import Transformer
from ..sampling import draw_unfiltered
from .drawing import draw_scratch
from .graphs import DYNAMO_OPTIONS, compiled_guard_free
from .routing import RowClass


def _decode_step(model: Transformer, tokens: torch.Tensor, state: ModelState) -> torch.Tensor:
    return model.decode_step(tokens, state)


class ClassGraphs:
    """Per row class (by its `fewest`), a compiled decode step and a compiled draw, each with a code of its own:
    dynamo keeps a class's graph apart from the others' (which a call's guards alone could not tell apart). Once
    a class is warmed up and captured, its calls skip dynamo's per-call guard checks (guard_free.py)."""

    def __init__(self, row_classes: Sequence[RowClass]):
        self.steps = {c.fewest: compiled_guard_free(_decode_step) for c in row_classes}
        self.draws = {c.fewest: compiled_guard_free(draw_unfiltered) for c in row_classes}

    @torch.inference_mode()
    def warm_up(
        self, row_class: RowClass, model: Transformer, stepped: Transformer, inference_tensors: bool, steps: bool
    ) -> None:
        """A compiled step of `stepped` (unless `steps` is false: the steps are one C++ call) and a compiled draw
        on a scratch state of `model`'s, made as the decoder's own state was (inference tensors or not), so that
        its steps find the graph compiled here; traced with the class's fewest rows as the row count's size hint."""
        rows = row_class.scratch_rows
        with torch.inference_mode(inference_tensors):
            scratch = model.new_state(rows)
            tokens = torch.zeros(rows, dtype=torch.long, device=model.device)
        draw = draw_scratch(model, rows)
        if rows > 1:
            # The row count is a size of its own from the first trace: traced as a plain 2 it would be taken
            # for any other size of 2 (two key heads in grouped-query attention) and stay specialised to it.
            hint = {"hint_override": row_class.fewest} if row_class.hinted else {}
            for t in [tokens, scratch.lengths, *(t for layer in scratch.layers for t in layer.tensors()), *draw]:
                torch._dynamo.mark_dynamic(t, 0, **hint)
        with torch._dynamo.config.patch(DYNAMO_OPTIONS):
            if steps:
                self.steps[row_class.fewest](None, stepped, tokens, scratch)
            self.draws[row_class.fewest](None, *draw)

    @torch.inference_mode()
    def capture(
        self,
        row_class: RowClass,
        model: Transformer,
        batch_size: int,
        step_inputs: Callable[[int], tuple[Any, ...]],
        steps: bool,
    ) -> None:
        """Pick the warmed-up graphs for the decoder's own inputs of that row class (`step_inputs(n)`: its state
        views, its token buffer; read only, as steps may be running on another thread), and the draw's for inputs
        laid out as `draw_inputs` lays them: graphs that take the class's fewest rows, one more, and all the
        `batch_size` rows (a class of fewer rows serves more while a class of more is compiling)."""
        fewest, most = row_class.fewest, batch_size
        counts = [1] if fewest == 1 else sorted({n for n in (fewest, fewest + 1, most) if n <= most})
        key = row_class.fewest
        if steps:
            self.steps[key].capture(key, [step_inputs(n) for n in counts])
        self.draws[key].capture(key, [draw_scratch(model, n) for n in counts])

    def captured(self, row_class: int, steps: bool) -> bool:
        """Whether the class's draws, and its steps unless `steps` is false, run without guard checks."""
        jobs = (self.steps, self.draws) if steps else (self.draws,)
        return all(g[row_class].captured(row_class) for g in jobs)
