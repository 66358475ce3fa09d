"""Which replica a request should go to so that it finds its prefix cached: plain functions, no Ray.

Each replica keeps its own prefix cache, so a conversation's next turn or a
prompt sharing a long start with an earlier one hits only on the replica that
served the earlier one. The routing key is the model's name and the start of
the prompt (its first `chars` characters as sent: the tokenizer lives in the
replicas, and equal starts of the text are equal starts of the tokens as far
as the cache is concerned), or an image request's whole known part. Replicas
are ranked by rendezvous hashing of the key: every router ranks them alike
without talking to the others, and when a replica comes or goes only the keys
it held move. A preferred replica that is busier than the least busy one by
`imbalance` requests or more is passed over for the least busy one: a hot
prefix must not queue behind one replica while the other idles.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

Replica = TypeVar("Replica", bound=Hashable)

TEXT_ROUTES = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
IMAGE_ROUTE = "/v1/images/completions"
IMAGE_FIELDS = ("keep_rows", "pixels", "image", "mask")  # what decides the known pixels of an image request


def routing_key(path: str, body: bytes, chars: int) -> str | None:
    """The key of a request to `path` with JSON `body`; None: no prefix to keep (other routes, bad bodies)."""
    if path not in TEXT_ROUTES and path != IMAGE_ROUTE:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the replica answers the error; any replica will do
    if not isinstance(request, dict):
        return None
    model = str(request.get("model"))
    if path == IMAGE_ROUTE:
        known = {field: request.get(field) for field in IMAGE_FIELDS}
        return f"{model}\n{json.dumps(known, sort_keys=True)}"
    return f"{model}\n{text_of(request.get(TEXT_ROUTES[path]))[:chars]}"


def affinity(key: str, replica: Hashable) -> int:
    """The rendezvous weight of `replica` for `key` (the highest weight wins)."""
    digest = hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def by_affinity(key: str, replicas: Sequence[Replica]) -> list[Replica]:
    """`replicas` from the one that holds `key`'s prefix to the least likely to."""
    return sorted(replicas, key=lambda replica: affinity(key, replica), reverse=True)


def preference(
    key: str | None, replicas: Sequence[Replica], queued: Mapping[Replica, int], imbalance: int
) -> list[list[Replica]]:
    """Ranks of replicas to try in order (within a rank, the least busy first).

    `queued` holds the requests each replica is known to have (missing: unknown). Without a key every
    replica is equal; with one, the key's replica alone, then the others, unless it is overloaded.
    """
    if key is None or len(replicas) < 2:
        return [list(replicas)]
    first, *rest = by_affinity(key, replicas)
    known = [queued[r] for r in replicas if r in queued]
    if first in queued and known and queued[first] - min(known) >= imbalance:
        return [list(replicas)]
    return [[first], rest]


def text_of(value: Any) -> str:
    """A JSON value as the text the key is cut from."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
