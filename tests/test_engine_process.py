"""The engine in a process of its own (`--engine-process`, server/engine/process.py): a real spawned
process on a tiny model, driven from asyncio as the handlers drive it. It answers what an engine on a
thread of this process answers, token for token; its metrics reach this process's registry before its
answers do; its refusals keep their kinds across the pipe; and when it dies, what waits on it fails
with a message that says so instead of hanging. (tests/test_server_process.py runs the whole server
both ways over HTTP.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import httpx
import pytest

from model.decode.sampling import SamplingParams
from server.engine.core import Engine, EngineLimits
from server.engine.client import EngineClient
from server.engine.output import Gauges, LocalOutput
from server.engine import messages as msg
from server.engine.process import HOLD_SECONDS, Pipe, PipeSink
from server.metrics import Metrics
from server.engine.scheduler import QueueFull
from server.settings import Settings
from server.engine.streams import DONE, EngineFailure, GenerationStream
from server.engine.types import Generation, GenerationRequest, StepStats
from server.engine.validation import InvalidRequest
from conftest import make_tiny_model
from server_support import metric_value, running_server, save_tiny_model

LIMITS = EngineLimits(max_batch=4, max_waiting=2)


def make(kind: type, limits: EngineLimits = LIMITS, metrics: Metrics | None = None):
    model, metrics = make_tiny_model("linear", seed=3), metrics or Metrics()
    if kind is Engine:
        return Engine("tiny", model, {}, limits, LocalOutput.recording(metrics, "tiny", model))
    return kind("tiny", model, {}, limits, metrics)


def requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}", prompt, max_new_tokens=10, sampling=SamplingParams(seed=seed, temperature=1.0), n=n, logprobs=True
        )
        for i, (prompt, n, seed) in enumerate([([1, 2, 3], 1, 5), ([4, 5], 2, 6), ([], 1, 7)])
    ]


async def results_of(engine, batch: list[GenerationRequest]) -> list[list[tuple]]:
    """Each request's finished samples by sample index: samples that finish in one step may arrive in either order
    (the handlers place each by its index), so arrival order is not compared."""
    streams = [await engine.enqueue(r, each_event=False) for r in batch]
    return [sorted((s.sample, s.tokens, s.logprobs) for s in [event async for event in stream]) for stream in streams]


async def streamed_tokens(engine, request: GenerationRequest) -> list[int]:
    return [g.token async for g in await engine.enqueue(request, each_event=True)]


def both_ways(scenario):
    """Run `scenario(engine)` on a thread engine and on a process engine; both results."""
    answers = []
    for kind in (Engine, EngineClient):
        engine = make(kind)
        engine.start()
        try:
            answers.append(asyncio.run(scenario(engine)))
        finally:
            engine.stop()
    return answers


def tokens_of(answer) -> list:
    results, streamed, _, top = answer
    return [[(sample, tokens) for sample, tokens, _ in samples] for samples in results] + [
        streamed,
        [[t for t, _ in row] for row in top],
    ]


def numbers_of(answer) -> list[float]:
    results, _, logprobs, top = answer
    return (
        [x for samples in results for _, _, values in samples for x in values]
        + logprobs
        + [p for row in top for _, p in row]
    )


def test_the_engine_process_answers_what_the_engine_thread_answers():
    async def scenario(engine):
        scored = await engine.score([9, 8, 7, 6], top=2)
        return (
            await results_of(engine, requests()),
            await streamed_tokens(engine, requests()[0]),
            scored.logprobs,
            scored.top_logprobs,
        )

    on_thread, in_process = both_ways(scenario)
    results, streamed, logprobs, top = in_process
    assert [len(samples) for samples in results] == [1, 2, 1] and all(len(s[1]) == 10 for r in results for s in r)
    assert streamed == results[0][0][1]  # streamed and whole answers agree in the engine process too
    assert tokens_of(in_process) == tokens_of(on_thread)
    assert numbers_of(in_process) == pytest.approx(numbers_of(on_thread), abs=1e-5)  # other threads, other sums
    assert len(logprobs) == 4 and all(len(t) == 2 for t in top)


def test_its_steps_are_counted_here_before_its_answer_arrives():
    async def scenario(engine):
        before = metric_value(
            metrics.render()[0].decode(), "rnnserve_generated_tokens_total", model="tiny", attention="linear"
        )
        await results_of(engine, requests()[:1])
        after = metric_value(
            metrics.render()[0].decode(), "rnnserve_generated_tokens_total", model="tiny", attention="linear"
        )
        return before, after

    metrics = Metrics()
    engine = make(EngineClient, metrics=metrics)
    engine.start()
    try:
        before, after = asyncio.run(scenario(engine))
        text = metrics.render()[0].decode()
    finally:
        engine.stop()
    assert (before, after) == (0, 10)
    assert (
        metric_value(text, "rnnserve_decode_state_allocated_bytes", model="tiny", attention="linear")
        == engine.state_bytes_allocated
        > 0
    )


def test_a_pass_s_figures_and_events_cross_the_pipe_in_one_message_and_held_events_stay_behind():
    api_end, engine_end = multiprocessing.Pipe()
    sink = PipeSink(Pipe(engine_end))
    streamed = GenerationStream(GenerationRequest("s", [1], 2), sink, each_event=True)
    whole = GenerationStream(GenerationRequest("w", [1], 2), sink, each_event=False)
    sink.keys.update({streamed: 7, whole: 8})
    sink.streams.update({7: streamed, 8: whole})
    token = Generation("s", 0, 1, 42, None, None, None, None)
    stats = StepStats(batch=2, steps=1, tokens=2, running=2, waiting=0, state_bytes=64)
    sink.step(stats, {streamed: [token], whole: ["held until its end"]})
    first = api_end.recv()
    assert first == msg.Step([stats], [(7, [token])])  # the non-streamed request's event waits for its end
    sink.step(stats, {whole: [DONE]})
    assert api_end.recv() == msg.Step([stats], [(8, ["held until its end", DONE])])
    assert sink.streams == {7: streamed}  # an ended stream is unbound
    assert not api_end.poll(0.1)  # nothing else was sent: no separate record


def test_a_pass_without_events_sends_nothing_its_figures_go_with_the_next_message():
    api_end, engine_end = multiprocessing.Pipe()
    sink = PipeSink(Pipe(engine_end))
    stream = GenerationStream(GenerationRequest("w", [1], 3), sink, each_event=False)
    sink.keys[stream], sink.streams[9] = 9, stream
    passes = [StepStats(batch=1, steps=8, tokens=8, running=1, waiting=0, state_bytes=32 * i) for i in (1, 2, 3)]
    sink.step(passes[0], {stream: ["token"]})  # held by the stream until its end: no event this pass
    sink.step(passes[1], {})
    assert not api_end.poll(0.05)  # no message wakes the API process for figures alone
    sink.step(passes[2], {stream: [DONE]})
    assert api_end.recv() == msg.Step(passes, [(9, ["token", DONE])])  # every pass's figures, before the events
    sink.step(passes[0], {})
    sink.gauges(Gauges(0, 0, idle=True))  # an idle engine leaves nothing held
    assert api_end.recv() == msg.GaugesNow(Gauges(0, 0, idle=True), [passes[0]])  # one message: figures, gauges
    assert not api_end.poll(0.05)


def test_figures_held_back_wait_at_most_hold_seconds():
    api_end, engine_end = multiprocessing.Pipe()
    sink = PipeSink(Pipe(engine_end))
    stats = StepStats(batch=1, steps=8, tokens=8, running=1, waiting=0, state_bytes=32)
    sink.step(stats, {})
    time.sleep(HOLD_SECONDS)
    sink.step(stats, {})  # a long request's passes: its figures still reach /metrics while it runs
    assert api_end.recv() == msg.Step([stats, stats], [])


def test_refusals_keep_their_kind_across_the_pipe():
    long_request = GenerationRequest("long", [1], max_new_tokens=90, sampling=SamplingParams(seed=1))

    async def scenario(engine):
        with pytest.raises(InvalidRequest, match="--max-batch"):
            await engine.enqueue(GenerationRequest("wide", [1], 5, n=5))
        held = []
        with pytest.raises(QueueFull, match="retry later"):  # slots and waiting places run out
            while len(held) <= LIMITS.max_batch + LIMITS.max_waiting:
                held.append(await engine.enqueue(long_request, each_event=False))
        for stream in held:
            stream.cancel()
        return len(held)

    engine = make(EngineClient)
    engine.start()
    try:
        assert LIMITS.max_waiting <= asyncio.run(scenario(engine)) <= LIMITS.max_batch + LIMITS.max_waiting
        assert engine.ready  # a refusal is not a failure
    finally:
        engine.stop()


def test_a_dead_engine_process_fails_what_waits_on_it_stops_being_ready_and_comes_back():
    async def killed_mid_stream(engine):
        """Tokens the stream gave before it failed. The engine is frozen (SIGSTOP) as soon as it has the
        request, so that it cannot finish all 90 tokens before the kill lands."""
        stream = await engine.enqueue(GenerationRequest("r", [1], max_new_tokens=90, sampling=SamplingParams(seed=1)))
        os.kill(engine.pid, signal.SIGSTOP)
        os.kill(engine.pid, signal.SIGKILL)
        seen = []
        with pytest.raises(EngineFailure, match="engine process died") as failed:
            async for event in stream:
                seen.append(event)
        assert failed.value.code == "engine_restarting"
        return len(seen)

    async def answered(engine):
        stream = await engine.enqueue(
            GenerationRequest("again", [1], max_new_tokens=5, sampling=SamplingParams(seed=1)), each_event=False
        )
        return [result async for result in stream]

    engine = make(EngineClient)
    engine.start()
    try:
        first_pid = engine.pid
        assert engine.ready
        assert asyncio.run(killed_mid_stream(engine)) < 90
        assert not engine.ready and engine.state_bytes_allocated == 0
        deadline = time.monotonic() + 120
        while not engine.ready and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.ready and engine.pid != first_pid and engine.restarts == 1
        [result] = asyncio.run(answered(engine))
        assert len(result.tokens) == 5
    finally:
        engine.stop()
    assert not engine.ready


def test_a_call_that_fails_in_the_engine_process_is_answered_and_the_process_serves_on():
    """A bug hit by one call (here: a submit whose request is not a GenerationRequest, which the client's own
    checks never let through) fails that call with the reason; the engine process keeps serving."""

    async def scenario(engine):
        key, future = -1, asyncio.get_running_loop().create_future()
        with engine._lock:
            engine._pending[key] = (asyncio.get_running_loop(), future)
        engine._send(msg.Submit(key, "not a request", False))
        with pytest.raises(EngineFailure, match="internal error"):
            await future
        return await results_of(engine, requests()[:1])

    engine = make(EngineClient)
    engine.start()
    try:
        assert len(asyncio.run(scenario(engine))[0][0][1]) == 10  # the next request is answered in full
        assert engine.ready
    finally:
        engine.stop()


def test_an_engine_process_that_cannot_allocate_its_slots_says_so():
    engine = make(EngineClient, EngineLimits(max_batch=2**40))
    with pytest.raises(EngineFailure, match="failed to start.*lower --max-batch"):
        engine.start()
    assert not engine.ready


def test_over_http_a_killed_engine_process_leaves_the_server_answering(tmp_path):
    save_tiny_model(tmp_path, "one", "linear", "text")
    save_tiny_model(tmp_path, "two", "linear", "text")
    with running_server(Settings(weights=tmp_path, compile_decode=False, engine_process=True)) as (url, app):
        two = app.state.server.engines.engines["two"]
        assert isinstance(two, EngineClient) and two.pid != os.getpid()
        os.kill(two.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code == 200:
            assert time.monotonic() < deadline, "/health kept saying ready after the engine process died"
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json()["error"]["message"] == "models not ready: two"
        refused = httpx.post(f"{url}/v1/completions", json={"model": "two", "prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert (
            httpx.post(f"{url}/v1/completions", json={"model": "one", "prompt": "a", "max_tokens": 3}).status_code
            == 200
        )
