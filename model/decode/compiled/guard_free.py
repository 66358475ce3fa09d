"""Compiled graphs called without dynamo's guard checks on every call.

Before each call of a torch.compile'd function, dynamo checks the guards of its
cached graphs (each input tensor's dtype, sizes and strides, the module's
attributes, the grad mode, ...) to choose one: a sizeable share of a small
model's decode step (benchmarks/results/NOTES.md has the figures). A decoder calls its
step with inputs whose layout it fixes itself (the same state views per row
count, its own token buffer, under inference mode), so once a shape class's
graph is known to accept those inputs the checks can only pass again.
`GuardFreeGraphs` checks them when the class is warmed up (on the inputs of
its fewest and most rows) and at each thread's first call (the guards also
read per-thread state), then calls the code dynamo compiled for that graph
directly (what vLLM's custom dispatcher does). Calls it cannot vouch for
(another grad mode, a class not captured, a thread whose first call failed the
guards) go through the guarded function as before.
"""

from __future__ import annotations

import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

log = logging.getLogger("rnnserve.guard_free")


def dynamo_cache(fn: Callable[..., Any]) -> list[Any]:
    """Dynamo's cache entries for `fn`'s code, most recently used first; [] if this torch cannot list them."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    return list(_debug_get_cache_entry_list(fn.__code__))


@dataclass
class _Captured:
    entry: Any  # dynamo's cache entry: its guards
    direct: Callable[..., Any]  # the code dynamo compiled for it, as a plain function
    # Per thread, whether its first call passed the guards: they also read per-thread state (the intra-op
    # thread count, autocast), which the capturing thread may not share. Thread-local, not by thread id:
    # a new thread may reuse a finished one's id.
    verdict: threading.local = field(default_factory=threading.local)


class GuardFreeGraphs:
    """`compiled` (torch.compile of the plain function `fn`), plus direct calls of the graphs captured per key."""

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self._fn = fn
        self._compiled = compiled
        self._captured: dict[Hashable, _Captured] = {}

    def capture(self, key: Hashable, samples: Sequence[tuple[Any, ...]]) -> bool:
        """After `key`'s warm-up: keep the cached graph whose guards accept every argument tuple in `samples`,
        what the class's calls will look like (e.g. its fewest and most rows: a graph compiled on 2 rows can be
        specialised to 2 when another size is 2 too). False if no graph does: those calls stay guarded."""
        scopes = [self._scope(args) for args in samples]
        try:
            entries = dynamo_cache(self._fn)
            chosen = next((e for e in entries if all(e.guard_manager.check(scope) for scope in scopes)), None)
        except (AttributeError, RuntimeError, TypeError) as exc:  # dynamo's private cache API changed
            log.warning("cannot read dynamo's cache of %s (%s): calls keep their guard checks", self._fn.__name__, exc)
            return False
        if chosen is None:
            log.info(
                "no compiled %s graph accepts all the %s inputs: those calls keep their guard checks",
                self._fn.__name__,
                key,
            )
            return False
        self._captured[key] = _Captured(
            chosen, types.FunctionType(chosen.code, self._fn.__globals__, self._fn.__name__)
        )
        return True

    def captured(self, key: Hashable) -> bool:
        return key in self._captured

    def traced(self) -> bool:
        """Whether dynamo holds any graph of it: it was compiled at least once."""
        return bool(dynamo_cache(self._fn))

    def accepts(self, key: Hashable, *args: Any) -> bool:
        """Whether the graph captured for `key` passes its guards on `args` here (what skipping them assumes)."""
        return key in self._captured and self._passes(self._captured[key], args)

    def __call__(self, key: Hashable | None, *args: Any) -> Any:
        captured = self._captured.get(key)
        if captured is not None and torch.is_inference_mode_enabled():
            passed = getattr(captured.verdict, "passed", None)
            if passed is None:
                passed = self._first_call(captured, args)
            if passed:
                return captured.direct(*args)
        return self._compiled(*args)

    def _first_call(self, captured: _Captured, args: tuple[Any, ...]) -> bool:
        """A thread's first call: check the guards once, in this thread's state."""
        passed = captured.verdict.passed = self._passes(captured, args)
        if not passed:
            log.info(
                "a %s call on thread %s fails the captured graph's guards: that thread's calls keep them",
                self._fn.__name__,
                threading.current_thread().name,
            )
        return passed

    def _passes(self, captured: _Captured, args: tuple[Any, ...]) -> bool:
        return bool(captured.entry.guard_manager.check(self._scope(args)))

    def _scope(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """The call's frame locals, as the guards read them."""
        names = self._fn.__code__.co_varnames[: self._fn.__code__.co_argcount]
        if len(args) != len(names):
            raise TypeError(f"{self._fn.__name__} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        return dict(zip(names, args))
