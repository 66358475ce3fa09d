"""A prefix cache of decode states: a token trie whose nodes hold the model's state after that prefix.

The key is every token the model READ (its lead, the start token for models that read one first, then the
prompt), so two prompts share a node exactly when the model's state after them is the same. A node may hold a
snapshot at any token position, not only at block boundaries: a linear or Linformer state is constant-size, a
softmax cache keeps only its first `length` positions (model/state.py `RowState.snapshot_row`). With the
snapshot goes the logits of its last position, so a request whose whole input is cached runs no forward at all,
and one that goes on runs only its new tokens: its state and logits are those of a full prefill.

A lookup also says how deep the input runs along stored sequences (`Lookup.shared`): past the deepest snapshot on
its path, the input still matches tokens some deeper snapshot was taken after. A cache kept by position (softmax,
Reformer) takes the state there from that deeper snapshot's first positions (a partial hit); the runner stores a
constant-size state at such a branch point as it prefills (server/engine/runner.py).

Entries are evicted least recently used first, within a byte budget. A `Hit` holds its snapshot, so one evicted
between the lookup and the restore (by a snapshot the same prefill stored) still restores whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.state import ModelState


LOGIT_BYTES = 4  # a snapshot's next-token logits are float32


@dataclass
class Snapshot:
    """The state of one row after `length` tokens, and the next-token logits there."""

    layers: list[list[torch.Tensor]]  # per layer, the row's tensors (softmax: its first `length` positions)
    length: int
    logits: torch.Tensor  # (V,) float32
    # log p(prompt) under each sampling distribution a weighed request (particles) asked it with: such a request
    # needs its whole prompt's likelihood, so it takes a snapshot only where it knows the part before it.
    likelihoods: dict[tuple[float, ...], float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for tensors in self.layers for t in tensors)
        return held + self.logits.numel() * self.logits.element_size()


@dataclass(eq=False)  # compared and hashed by identity: a node that holds a snapshot is its own LRU key
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    parent: _Node | None = None
    token: int = -1


@dataclass(frozen=True)
class Hit:
    """The longest cached prefix of a request's input: `length` tokens, whose state is `snapshot`'s, or (a partial
    hit, `length` below the snapshot's) the first `length` positions of a longer snapshot's. A partial hit's
    snapshot logits are not those after `length` tokens: it always leaves at least one token to run."""

    length: int
    snapshot: Snapshot

    @property
    def partial(self) -> bool:
        return self.length < self.snapshot.length


@dataclass(frozen=True)
class Lookup:
    """What a lookup found: the longest cached prefix, if any, and how many of the input's tokens run along stored
    sequences (`shared` >= the hit's length; where the input branches off every stored one)."""

    hit: Hit | None
    shared: int


class PrefixCache:
    """Snapshots of one engine's states keyed by the tokens read, within `budget` bytes (LRU)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._root = _Node()
        self._recent: OrderedDict[_Node, None] = (
            OrderedDict()
        )  # the nodes that hold snapshots, least recently used first
        self.bytes_held = 0
        self.queried_tokens = 0  # tokens looked up, and those found cached: counters for the metrics
        self.hit_tokens = 0

    @property
    def entries(self) -> int:
        return len(self._recent)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def holds(self, tokens: list[int]) -> bool:
        """Whether a snapshot after exactly `tokens` is kept."""
        return self.snapshot_of(tokens) is not None

    def snapshot_of(self, tokens: list[int]) -> Snapshot | None:
        """The snapshot after exactly `tokens`, if kept."""
        node = self._root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node.snapshot  # the root holds none

    def lookup(self, tokens: list[int], usable: Callable[[Snapshot], bool] | None = None) -> Hit | None:
        """The longest prefix of `tokens` with a snapshot (that `usable` accepts, if given); it becomes the most
        recently used. Counted in `queried_tokens` and `hit_tokens`."""
        return self.find(tokens, usable).hit

    def find(
        self, tokens: list[int], usable: Callable[[Snapshot], bool] | None = None, truncate: bool = False
    ) -> Lookup:
        """As `lookup`, with how deep `tokens` run along stored sequences. truncate: snapshots kept by position
        (model/state.py `snapshots_truncate`), so that a deeper snapshot's first positions may serve as a partial
        hit; never with `usable` (a partial hit has no stored likelihoods)."""
        self.queried_tokens += len(tokens)
        node, shared, best_length = self._root, 0, 0
        best: _Node | None = None
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            node, shared = child, shared + 1
            if node.snapshot is not None and (usable is None or usable(node.snapshot)):
                best, best_length = node, shared
        # A partial hit needs the logits of its last position from a forward: it leaves one token to run.
        partial_length = min(shared, len(tokens) - 1)
        if truncate and usable is None and partial_length > best_length:
            best, best_length = _snapshot_below(node), partial_length
        if best is None or best.snapshot is None:
            return Lookup(None, shared)
        self._recent.move_to_end(best)
        self.hit_tokens += best_length
        return Lookup(Hit(best_length, best.snapshot), shared)

    def insert(self, tokens: list[int], snapshot: Snapshot) -> bool:
        """Keep `snapshot` as the state after `tokens`, evicting the least recently used entries to fit (if one is
        kept there already, it stays: only its use is new). False when it cannot fit at all (larger than the
        budget)."""
        return self.keep(tokens, lambda: snapshot) is not None

    def keep(self, tokens: list[int], take: Callable[[], Snapshot]) -> Snapshot | None:
        """The snapshot after exactly `tokens`: the one kept already (now the most recently used), or else `take()`'s,
        kept by evicting the least recently used entries to fit; None when that is larger than the whole budget
        (nothing evicted). One walk down the trie, and `take` (a state's copy) only when nothing is kept there."""
        if not tokens:
            return None
        node = self._path_to(tokens)
        if node.snapshot is not None:
            self._recent.move_to_end(node)
            return node.snapshot
        try:
            snapshot = take()
        except BaseException:
            _prune(node)  # every leaf holds a snapshot (`_snapshot_below` relies on it)
            raise
        size = snapshot.nbytes
        if size > self.budget:
            _prune(node)
            return None
        node.snapshot = snapshot  # before evicting: an evicted branch's pruning stops at a node that holds one
        while self.bytes_held + size > self.budget:
            self._evict_oldest()
        self._recent[node] = None
        self.bytes_held += size
        return snapshot

    def _path_to(self, tokens: list[int]) -> _Node:
        """The node after `tokens`, made (with the nodes above it) where missing."""
        node = self._root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(parent=node, token=token)
            node = child
        return node

    def _evict_oldest(self) -> None:
        node, _ = self._recent.popitem(last=False)
        assert node.snapshot is not None  # every listed node holds one
        self.bytes_held -= node.snapshot.nbytes
        node.snapshot = None
        _prune(node)


def _prune(node: _Node) -> None:
    """Remove `node` and the nodes above it that are left bare: no snapshot, no children."""
    while node.parent is not None and not node.children and node.snapshot is None:
        del node.parent.children[node.token]
        node = node.parent


def _snapshot_below(node: _Node) -> _Node:
    """The first node at or below `node` that holds a snapshot: every leaf of the trie holds one (an evicted
    entry's bare branch is pruned), so following any child gets there."""
    while node.snapshot is None:
        node = next(iter(node.children.values()))
    return node


def take_snapshot(state: ModelState, row: int, logits: torch.Tensor) -> Snapshot:
    """Row `row` of `state` as it is now, with its (V,) next-token logits."""
    length = int(state.lengths[row])
    return Snapshot([layer.snapshot_row(row, length) for layer in state.layers], length, logits.detach().clone())


def restore_snapshot(state: ModelState, row: int, snapshot: Snapshot, length: int | None = None) -> None:
    """Write `snapshot` into row `row` of `state`: the row is as it was after the snapshot's tokens, or after its
    first `length` (a partial hit, for states kept by position only)."""
    length = snapshot.length if length is None else length
    if length != snapshot.length and not all(layer.snapshots_truncate for layer in state.layers):
        raise ValueError(f"a state of this kind cannot be cut to {length} of its snapshot's {snapshot.length} tokens")
    state.lengths[row] = length
    for layer, saved in zip(state.layers, snapshot.layers, strict=True):
        layer.restore_row(row, saved, length)
