"""One engine interface, `EngineHandle` (server/engine/base.py), that the thread engine, the engine process's client
and the pool of engine processes all implement: checked here at run time on real, started engines, and by mypy
statically (`make lint` type-checks this file: `as_handles` below only type-checks if each class conforms)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from server.engine.base import EngineHandle, EngineLimits
from server.engine.client import EngineClient
from server.engine.core import Engine
from server.engine.output import LocalOutput
from server.engine.pool import EnginePool
from server.metrics import Metrics
from conftest import make_tiny_model

LIMITS = EngineLimits(max_batch=2, max_waiting=2, cuda_graphs=False, compile_decode=False)


def as_handles(thread: Engine, process: EngineClient, pool: EnginePool) -> list[EngineHandle]:
    """The static half of the check: mypy rejects this function if any of the three is not an EngineHandle."""
    return [thread, process, pool]


def protocol_methods() -> dict[str, inspect.Signature]:
    """The interface's methods (properties and attributes left out) and their signatures."""
    return {
        name: inspect.signature(member)
        for name, member in vars(EngineHandle).items()
        if not name.startswith("_") and inspect.isfunction(member)
    }


def shape(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    """What a caller relies on: each parameter's name, kind and default (annotations are checked by mypy)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineHandle]]:
    """A started engine of each kind on one tiny model: a thread engine, an engine process, a pool of two."""
    model, metrics = make_tiny_model("linear", seed=3), Metrics()
    thread = Engine("tiny", model, {}, LIMITS, LocalOutput.recording(metrics, "tiny", model))
    process = EngineClient("tiny", model, {}, LIMITS, metrics, 1)
    pool = EnginePool([EngineClient("pooled", model, {}, LIMITS, metrics, 1, worker=i) for i in range(2)])
    started: list[EngineHandle] = []
    try:
        for engine in as_handles(thread, process, pool):
            engine.start()
            started.append(engine)
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_the_interface_names_what_handlers_use():
    members = {n for n in vars(EngineHandle) if not n.startswith("_")} | set(EngineHandle.__annotations__)
    assert {"enqueue", "score", "start", "stop", "check_prompt", "metrics", "limits"} <= members
    assert inspect.iscoroutinefunction(vars(EngineHandle)["enqueue"])


def test_thread_process_and_pool_engines_are_each_an_engine_handle(engines):
    assert [type(e).__name__ for e in engines] == ["Engine", "EngineClient", "EnginePool"]
    for engine in engines:
        assert isinstance(engine, EngineHandle), f"{type(engine).__name__} lacks part of EngineHandle"
        assert engine.ready


@pytest.mark.parametrize("method", sorted(protocol_methods()))
def test_each_engine_s_methods_take_what_the_interface_says(engines, method):
    """Same parameters (names, kinds, defaults) and the same sync or async call as the Protocol's: a handler
    written against EngineHandle calls any of the three alike."""
    wanted = protocol_methods()[method]
    protocol_is_async = inspect.iscoroutinefunction(vars(EngineHandle)[method])
    for engine in engines:
        implementation = getattr(type(engine), method)
        assert shape(inspect.signature(implementation)) == shape(wanted), f"{type(engine).__name__}.{method}"
        assert inspect.iscoroutinefunction(implementation) == protocol_is_async, f"{type(engine).__name__}.{method}"


def test_a_missing_member_is_seen():
    """The run-time check can fail: an object without the interface's members is no EngineHandle."""

    class Partial:
        name = "partial"

        async def enqueue(self, request: object, each_event: bool = True) -> None: ...

    assert not isinstance(Partial(), EngineHandle)
