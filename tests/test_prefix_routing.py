"""Prefix-aware routing's choices (server/rayserve/prefix_routing.py), without Ray: which key a request has,
which replica a key goes to, and when an overloaded replica is passed over. tests/test_ray.py runs it on a real
Ray cluster."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from server.rayserve.prefix_routing import by_affinity, preference, routing_key

REPLICAS = ["a1b2c3", "d4e5f6"]
SHARED = "You are a careful assistant. Answer in one sentence. " * 6  # over 256 characters


def completion(prompt, model: str = "text") -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()


def test_prompts_sharing_their_first_characters_share_a_key():
    first = routing_key("/v1/completions", completion(SHARED + "What is 2 + 2?"), 256)
    second = routing_key("/v1/completions", completion(SHARED + "Name a colour."), 256)
    assert first == second and first is not None
    assert routing_key("/v1/completions", completion("Short and different"), 256) != first


def test_the_key_names_the_model_and_reads_every_prompt_form():
    assert routing_key("/v1/completions", completion(SHARED, "a"), 256) != routing_key(
        "/v1/completions", completion(SHARED, "b"), 256
    )
    ids = routing_key("/v1/completions", completion([5, 6, 7]), 256)
    assert ids is not None and ids != routing_key("/v1/completions", completion([5, 6, 8]), 256)
    chat = {"model": "text", "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": "hi"}]}
    later = {**chat, "messages": chat["messages"] + [{"role": "assistant", "content": "hello"}]}
    assert routing_key("/v1/chat/completions", json.dumps(chat).encode(), 256) == routing_key(
        "/v1/chat/completions", json.dumps(later).encode(), 256
    )


def test_an_image_key_is_its_whole_known_part():
    blank_top = [[0] * 28 for _ in range(10)]
    seven = {"model": "digits", "pixels": blank_top + [[255] * 28] * 18, "keep_rows": 14}
    one = {"model": "digits", "pixels": blank_top + [[128] * 28] * 18, "keep_rows": 14}
    key = routing_key("/v1/images/completions", json.dumps(seven).encode(), 256)
    assert key == routing_key("/v1/images/completions", json.dumps({**seven, "seed": 3}).encode(), 256)
    assert key != routing_key("/v1/images/completions", json.dumps(one).encode(), 256)


def test_no_key_for_other_routes_or_bodies_that_are_not_json_objects():
    assert routing_key("/health", b"", 256) is None
    assert routing_key("/v1/models", b"", 256) is None
    assert routing_key("/v1/completions", b"{not json", 256) is None
    assert routing_key("/v1/completions", b"[1, 2]", 256) is None
    assert routing_key("/v1/completions", b"\xff\xfe", 256) is None


def test_the_same_key_goes_to_the_same_replica_whatever_order_replicas_are_listed_in():
    key = routing_key("/v1/completions", completion(SHARED), 256)
    assert by_affinity(key, REPLICAS)[0] == by_affinity(key, list(reversed(REPLICAS)))[0]
    assert preference(key, REPLICAS, {}, imbalance=8)[0] == [by_affinity(key, REPLICAS)[0]]


def test_different_prefixes_spread_over_the_replicas():
    replicas = ["r0", "r1", "r2", "r3"]
    chosen = Counter(by_affinity(f"text\nconversation {i}: hello", replicas)[0] for i in range(400))
    assert set(chosen) == set(replicas)
    assert all(count > 400 / 4 / 2 for count in chosen.values()), chosen


def test_a_removed_replica_moves_only_its_own_keys():
    keys = [f"text\nprompt {i}" for i in range(200)]
    before = {k: by_affinity(k, ["r0", "r1", "r2"])[0] for k in keys}
    after = {k: by_affinity(k, ["r0", "r1"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)


def test_an_overloaded_replica_yields_to_the_least_busy():
    key = "text\nhot prefix"
    first, second = by_affinity(key, REPLICAS)
    assert preference(key, REPLICAS, {first: 3, second: 0}, imbalance=8) == [[first], [second]]
    assert preference(key, REPLICAS, {first: 8, second: 0}, imbalance=8) == [REPLICAS]
    assert preference(None, REPLICAS, {}, imbalance=8) == [REPLICAS]
    assert preference(key, REPLICAS[:1], {}, imbalance=8) == [REPLICAS[:1]]


def test_a_forwarded_request_gets_the_apps_messages_and_a_caller_gone_is_a_disconnect():
    """router.asgi_messages, which runs a replica's app on a request the front read, on a real Starlette app."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from server.rayserve.router import asgi_messages

    heard: list[str] = []

    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()

        async def parts():
            try:
                for i in range(1000):
                    yield body + str(i).encode()
                    await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                heard.append("cancelled")
                raise

        return StreamingResponse(parts(), status_code=201)

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    scope = {"method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"", "headers": []}

    async def first_messages(count: int) -> list[dict]:
        seen = []
        messages = asgi_messages(app, scope, b"hi")
        async for message in messages:
            seen.append(message)
            if len(seen) == count:
                break
        await messages.aclose()  # the caller went away
        return seen

    seen = asyncio.run(first_messages(3))
    assert seen[0]["type"] == "http.response.start" and seen[0]["status"] == 201
    assert [m["body"] for m in seen[1:]] == [b"hi0", b"hi1"]
    assert heard == ["cancelled"]
