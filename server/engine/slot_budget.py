"""How many decode slots each model takes from a memory budget (--kv-cache-memory, --kv-cache-memory-fraction).

A slot holds one sequence while it decodes: its decode state for the model's whole context (a softmax model's
keys and values at every position, a linear model's fixed sums) and the runner's buffers for one row (next-token
logits, the penalties' counts, the tokens and log-probabilities by position). They are all allocated at start-up,
so the budget says how many there are: shared equally by the models, a model's share by its engine workers, each
engine takes as many slots as its part holds, at most --max-batch. Without a budget every engine takes
--max-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.transformer import Transformer

from server.engine.runner import Slots
from server.settings import SettingsError

MIB = 1024 * 1024


@dataclass(frozen=True)
class SlotPlan:
    rows: int  # decode slots per engine worker
    workers: int  # engine workers (fewer than asked when the budget cannot give each a slot)
    slot_bytes: int  # what one slot holds
    budget: int | None  # the model's share of the budget; None: no budget


def slot_bytes(model: Transformer) -> int:
    """Bytes one decode slot takes: one row's state and buffers, as the runner allocates them."""
    one = Slots.allocate(model, 1)
    return one.state.nbytes() + sum(t.nbytes for t in one.row_tensors())


def plan_slots(name: str, model: Transformer, max_batch: int, workers: int, share: int | None) -> SlotPlan:
    """The slots of one model given its `share` of the budget (None: --max-batch each); raises SettingsError when
    the share cannot hold one sequence, saying what one needs."""
    size = slot_bytes(model)
    if share is None:
        return SlotPlan(max_batch, workers, size, None)
    fit = share // size
    if fit < 1:
        raise SettingsError(
            f"model '{name}': one sequence needs {size} bytes ({size / MIB:.1f} MiB) of decode state and buffers "
            f"at its context of {model.config.max_len} tokens, and its share of the decode memory budget is "
            f"{share} bytes ({share / MIB:.1f} MiB); raise --kv-cache-memory or --kv-cache-memory-fraction, "
            "or lower --max-model-len"
        )
    workers = min(workers, fit)
    return SlotPlan(min(max_batch, share // workers // size), workers, size, share)


def model_shares(budget: int | None, models: int) -> int | None:
    """Each model's equal share of the budget (None: no budget)."""
    return None if budget is None else budget // max(1, models)


def check_decode_budget(budget: int | None, models: list[tuple[str, Transformer]]) -> None:
    """Before serving: raise SettingsError if some model's share of the budget cannot hold one sequence."""
    share = model_shares(budget, len(models))
    for name, model in models:
        plan_slots(name, model, 1, 1, share)
