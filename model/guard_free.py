"""Compiled graphs called without dynamo's guard checks on every call.

Before each call of a torch.compile'd function, dynamo checks the guards of its
cached graphs (each input tensor's dtype, sizes and strides, the module's
attributes, the grad mode, ...) to choose one: about 0.1 ms a call here, a
third of a one-row decode step and a tenth of a 64-row one. A decoder calls its
step with inputs whose layout it fixes itself (the same state views per row
count, its own token buffer, under inference mode), so once a shape class's
graph is known to accept those inputs the checks can only pass again.
`GuardFreeGraphs` checks them once, when the class is warmed up, then calls
the code dynamo compiled for that graph directly (what vLLM's custom
dispatcher does). Calls it cannot vouch for (another grad mode, a class not
captured) go through the guarded function as before.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Hashable

import torch

log = logging.getLogger("rnnserve.guard_free")


def dynamo_cache(fn: Callable) -> list:
    """Dynamo's cache entries for `fn`'s code, most recently used first; [] if this torch cannot list them."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    return list(_debug_get_cache_entry_list(fn.__code__))


class GuardFreeGraphs:
    """`compiled` (torch.compile of the plain function `fn`), plus direct calls of the graphs captured per key."""

    def __init__(self, fn: Callable, compiled: Callable):
        self._fn = fn
        self._compiled = compiled
        self._captured: dict[Hashable, tuple[Any, Callable]] = {}  # key -> (cache entry, its compiled code)

    def capture(self, key: Hashable, *args) -> bool:
        """After `key`'s warm-up: keep the cached graph whose guards accept `args`, the inputs the class's
        calls will have (same layouts, same grad mode). False if none does: those calls stay guarded."""
        scope = self._scope(args)
        for entry in dynamo_cache(self._fn):
            if entry.guard_manager.check(scope):
                direct = types.FunctionType(entry.code, self._fn.__globals__, self._fn.__name__)
                self._captured[key] = (entry, direct)
                return True
        log.info("no compiled %s graph accepts the %s inputs: those calls keep their guard checks", self._fn.__name__, key)
        return False

    def captured(self, key: Hashable) -> bool:
        return key in self._captured

    def accepts(self, key: Hashable, *args) -> bool:
        """Whether the graph captured for `key` passes its guards on `args` (what skipping them assumes)."""
        return key in self._captured and self._captured[key][0].guard_manager.check(self._scope(args))

    def __call__(self, key: Hashable | None, *args):
        captured = self._captured.get(key)
        if captured is not None and torch.is_inference_mode_enabled():
            return captured[1](*args)
        return self._compiled(*args)

    def _scope(self, args: tuple) -> dict[str, Any]:
        """The call's frame locals, as the guards read them."""
        names = self._fn.__code__.co_varnames[:self._fn.__code__.co_argcount]
        if len(args) != len(names):
            raise TypeError(f"{self._fn.__name__} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        return dict(zip(names, args))
