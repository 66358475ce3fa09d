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
- **periodic snapshots**: for a constant-size state (linear, Linformer, hybrid), every `every` tokens read
  (`--prefix-cache-every`, at multiples of it from the first token read), so that even the second prompt with a
  shared start finds most of it. A softmax or Reformer cache needs none: partial hits cut any stored one.

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
    """What a model's state allows: `every` > 0 takes periodic snapshots; `truncates`: partial hits serve branch
    points (no branch snapshots)."""

    every: int = 0
    truncates: bool = False


@dataclass(frozen=True)
class PrefillPlan:
    """One prompt's prefill: the cached prefix it starts from, and the positions (tokens read, ascending, each
    past the hit and before the end) after which its state goes to the prefix cache."""

    hit: Hit | None = None
    stops: tuple[int, ...] = ()


def plan_prefill(found: Lookup, total: int, policy: SnapshotPolicy) -> PrefillPlan:
    """The plan of a prompt of `total` tokens read, from what the lookup found."""
    done = found.hit.length if found.hit is not None else 0
    stops: set[int] = set()
    if policy.every > 0:
        stops.update(range((done // policy.every + 1) * policy.every, total, policy.every))
    branch = found.shared
    if not policy.truncates and branch < total and branch - done >= MIN_BRANCH_TOKENS:
        stops.add(branch)
    return PrefillPlan(found.hit, tuple(sorted(stops)))


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
