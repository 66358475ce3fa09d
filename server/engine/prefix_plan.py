"""Where a prefill stores decode states in the prefix cache besides the end of its prompt.

A state kept only where a prompt or a finished sequence ended never serves two prompts that share a long start
(a system prompt, a few-shot block) but end differently. So, for what the model reads:

- **branch points**: where the input leaves the stored sequences (`Lookup.shared`) deeper than the deepest
  snapshot on its path, the prefill stops once there and stores the state, so the next prompt with that start
  takes all of it (Marconi's idea). Only for states that cannot be cut: a cache kept by position (softmax,
  Reformer) takes the state at a branch point from a deeper snapshot's first positions instead (a partial hit,
  server/engine/prefix_cache.py), with no snapshot of its own. Not when the branch point is fewer than
  `MIN_BRANCH_TOKENS` past what the cache gave: a stop costs a forward's overhead and a stored state, to save
  later prompts only those few tokens.
- **periodic snapshots**: for a constant-size state (linear, Linformer, hybrid), after `every`, 2 `every`,
  4 `every`, ... tokens read (`--prefix-cache-every`, counted from the first token read), so that even the second
  prompt with a shared start finds at least half of it. Doubling, not a fixed step: each stop costs every prompt
  that long a forward's overhead and a state's copy, so a prompt of T tokens stops about log2(T / every) times,
  not T / every, and keeps as few states. Only as many as the cache's budget holds besides the states the same
  prefill keeps at branch points and ends (the deepest ones, which save the most): a state the prefill's own
  later ones would evict, or one larger than the budget, is not worth its stop. A softmax or Reformer cache needs
  none: partial hits cut any stored one.

A weighed request (particles) needs its prompt's likelihood up to any state it takes, which a mid-prefill
snapshot does not keep: it stores none.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from server.engine.prefix_cache import Hit, Lookup

MIN_BRANCH_TOKENS = 8  # a branch point nearer than this to the cached part is not worth a stop


@dataclass(frozen=True)
class SnapshotPolicy:
    """What a model's state allows: `every` > 0 takes periodic snapshots (the first after `every` tokens read);
    `truncates`: partial hits serve branch points (no branch snapshots); `budget_states`: how many states the
    cache's budget holds (a constant-size state's; None: no bound)."""

    every: int = 0
    truncates: bool = False
    budget_states: int | None = None


@dataclass(frozen=True)
class PrefillPlan:
    """One prompt's prefill: the cached prefix it starts from, and the positions (tokens read, ascending, each
    past the hit and before the end) after which its state goes to the prefix cache."""

    hit: Hit | None = None
    stops: tuple[int, ...] = ()


def plan_prefill(found: Lookup, total: int, policy: SnapshotPolicy, sharing: int = 1) -> PrefillPlan:
    """The plan of a prompt of `total` tokens read, from what the lookup found. `sharing`: the prompts one prefill
    keeps states of (this one included), between which the budget's states are split."""
    done = found.hit.length if found.hit is not None else 0
    stops: list[int] = []
    branch = found.shared
    if not policy.truncates and branch < total and branch - done >= MIN_BRANCH_TOKENS:
        stops.append(branch)
    periodic = [stop for stop in periodic_stops(done, total, policy.every) if stop != branch]
    if policy.budget_states is not None:  # room besides its end's state and its branch point's
        room = max(0, policy.budget_states // sharing - 1 - len(stops))
        periodic = periodic[max(0, len(periodic) - room) :]  # the deepest
    return PrefillPlan(found.hit, tuple(sorted([*stops, *periodic])))


def periodic_stops(done: int, total: int, every: int) -> list[int]:
    """every, 2 every, 4 every, ... tokens read: those past `done` (what the cache gave) and before `total` (the
    end's state is kept anyway); none for `every` 0."""
    stops: list[int] = []
    stop = every
    while 0 < stop <= done:
        stop *= 2
    while 0 < stop < total:
        stops.append(stop)
        stop *= 2
    return stops


def runs_of_equal_keys(keys: Sequence[Hashable | None]) -> list[tuple[int, int]]:
    """[start, stop) runs of neighbours with the same key, None never in a run: [a, a, None, a] ->
    [(0, 2), (3, 4)]."""
    runs: list[tuple[int, int]] = []
    for i, key in enumerate(keys):
        if key is None:
            continue
        if runs and runs[-1][1] == i and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
