"""The engine's admission and results: requests queued together join together, prompts of one
length in one prefill forward, a failed group leaves nothing of itself decoding, empty prompts start
from the cached state after BOS, and non-streamed samples (read from the slot buffers at the end)
equal their streamed tokens; rows that filter (top-k, top-p) draw filtered beside rows that do not.
A real engine thread on a tiny model; requests are queued before the engine starts, so they are
admitted in one step."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from model.decode.sampling import SamplingParams
from server.engine.core import Engine, EngineFailure, EngineLimits
from server.engine.output import LocalOutput
from server.metrics import Metrics
from server.engine.multistep import PassCosts
from server.engine.runner import ModelRunner, Slots
from server.engine.types import GenerationRequest
from conftest import make_tiny_model

PROMPTS = [([1, 2, 3], 1, 10), ([4, 5, 6], 2, 20), ([7, 8, 9, 10, 11], 1, 30), ([12, 13, 14], 1, 40)]


def make_engine(kind: str, scheduler_steps: int = EngineLimits.scheduler_steps) -> Engine:
    limits = EngineLimits(max_batch=8, max_waiting=8, scheduler_steps=scheduler_steps)
    model = make_tiny_model(kind, seed=2)
    return Engine("tiny", model, {}, limits, LocalOutput.recording(Metrics(), "tiny", model))


def request(i: int, prompt: list[int], n: int, seed: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", prompt, max_new_tokens=12, sampling=SamplingParams(seed=seed), n=n, logprobs=True)


def queue_then_start(engine: Engine, requests: list[GenerationRequest], each_event: bool) -> list:
    """Queue all requests, then start the engine if it is not running yet: their streams."""
    streams = [engine.submit(r, each_event=each_event) for r in requests]
    if engine._thread is None:
        engine.start()
    return streams


async def _whole_results(engine: Engine, requests: list[GenerationRequest]) -> list[list]:
    """The SampleResults of each request, non-streamed."""
    return [[r async for r in stream] for stream in queue_then_start(engine, requests, each_event=False)]


async def answers(engine: Engine, requests: list[GenerationRequest]) -> list[list[tuple[int, int, float]]]:
    """(sample, token, logprob) per generated token, per request, non-streamed."""
    return [
        [(r.sample, token, logprob) for r in results for token, logprob in zip(r.tokens, r.logprobs)]
        for results in await _whole_results(engine, requests)
    ]


@pytest.mark.parametrize("kind", ["softmax", "linear", "linformer", "reformer"])
def test_requests_admitted_together_get_their_solo_answers(kind, monkeypatch):
    groups = []
    prefill = Engine._prefill
    monkeypatch.setattr(Engine, "_prefill", lambda self, streams: groups.append(len(streams)) or prefill(self, streams))
    requests = [request(i, *p) for i, p in enumerate(PROMPTS)]
    together = make_engine(kind)
    try:
        joint = asyncio.run(answers(together, requests))
    finally:
        together.stop()
    assert groups == [3, 1]  # the three 3-token prompts in one forward, the 5-token one alone
    for req, got in zip(requests, joint):
        alone = make_engine(kind)
        try:
            solo = asyncio.run(answers(alone, [req]))[0]
        finally:
            alone.stop()
        assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in solo]
        assert [lp for *_, lp in got] == pytest.approx([lp for *_, lp in solo], abs=1e-4)


def test_a_failed_group_prefill_fails_its_requests_and_leaves_no_row_decoding(monkeypatch):
    copy_rows = Slots.copy_rows  # how a prefilled row is copied to a request's further samples
    failing = {"on": True}

    def copy_or_fail(self, src, dst):
        if failing["on"]:
            raise RuntimeError("copy failed")
        copy_rows(self, src, dst)

    monkeypatch.setattr(Slots, "copy_rows", copy_or_fail)
    engine = make_engine("linear")

    async def scenario():
        streams = queue_then_start(engine, [request(i, *p) for i, p in enumerate(PROMPTS)], each_event=False)
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(sum([len(r.tokens) async for r in stream]))
            except EngineFailure as exc:
                outcomes.append(str(exc))
        failing["on"] = False
        later = await answers(engine, [request(9, [1, 2, 3], 2, 5)])
        return outcomes, later

    try:
        outcomes, later = asyncio.run(scenario())
    finally:
        engine.stop()
    generated = engine.metrics.metrics.registry.get_sample_value(
        "rnnserve_generated_tokens_total", {"model": "tiny", "attention": "linear"}
    )
    # The 3-token group needed a copy (n = 2) and failed whole; the 5-token request went on.
    assert outcomes[0] == outcomes[1] == outcomes[3] == "prefill failed: copy failed"
    assert outcomes[2] == 12
    assert len(later[0]) == 24 and {s for s, _, _ in later[0]} == {0, 1}
    assert generated == 12 + 24  # no row of the failed group decoded a token


async def streamed(engine: Engine, req: GenerationRequest) -> list[tuple[int, int, float]]:
    """(sample, token, logprob) of one request's per-token events, streamed."""
    (stream,) = queue_then_start(engine, [req], each_event=True)
    return [(e.sample, e.token, e.logprob) async for e in stream]


def test_whole_samples_match_their_streamed_tokens_as_rows_move(monkeypatch):
    """Non-streamed samples are read from the slot buffers at the end; requests of different
    lengths finish at different steps, so live rows move into freed slots on the way."""
    moves = []
    copy_rows = Slots.copy_rows
    monkeypatch.setattr(
        Slots, "copy_rows", lambda self, src, dst: moves.extend(zip(src, dst)) or copy_rows(self, src, dst)
    )
    lengths = [3, 12, 7, 20]
    requests = [
        GenerationRequest(
            f"r{i}", [1, 2, 3], max_new_tokens=m, sampling=SamplingParams(seed=i), n=2, logprobs=i % 2 == 0
        )
        for i, m in enumerate(lengths)
    ]
    together = make_engine("linear")
    try:
        streams_results = asyncio.run(_whole_results(together, requests))
    finally:
        together.stop()
    assert any(src > dst for src, dst in moves)  # a later row moved into an earlier one's slot
    for req, results in zip(requests, streams_results):
        alone = make_engine("linear")
        try:
            events = asyncio.run(streamed(alone, req))
        finally:
            alone.stop()
        for result in results:
            mine = [(t, lp) for s, t, lp in events if s == result.sample]
            assert result.start == 3 and result.finish_reason == "length"
            assert result.tokens == [t for t, _ in mine]
            if req.logprobs:
                assert result.logprobs == pytest.approx([lp for _, lp in mine], abs=1e-4)
            else:
                assert result.logprobs is None


@pytest.mark.parametrize("kind", ["softmax", "linear", "linformer", "reformer"])
def test_empty_prompts_start_from_the_state_after_bos(kind):
    """Empty prompts copy a state computed once at start-up instead of running the model: their
    tokens' log-probabilities must still be those of one parallel pass over BOS + the tokens."""
    engine = make_engine(kind)
    requests = [
        GenerationRequest(f"e{i}", [], max_new_tokens=10, sampling=SamplingParams(seed=i), n=2, logprobs=True)
        for i in range(2)
    ]
    try:
        results = asyncio.run(_whole_results(engine, requests))
        for result in (r for rs in results for r in rs):
            assert result.start == 0 and len(result.tokens) == 10
            assert result.logprobs == pytest.approx(engine.runner.score(result.tokens).logprobs, abs=1e-4)
    finally:
        engine.stop()


def test_scoring_runs_on_the_engine_thread_that_owns_the_model(monkeypatch):
    """Scores go through the worker thread, between steps, like every other use of the model."""
    threads = []
    score = ModelRunner.score
    monkeypatch.setattr(
        ModelRunner,
        "score",
        lambda self, tokens, top=0: threads.append(threading.current_thread().name) or score(self, tokens, top),
    )
    engine = make_engine("linear")

    async def both():
        (stream,) = queue_then_start(engine, [request(0, [1, 2, 3], 1, 1)], each_event=False)
        scored = await engine.score([5, 6, 7])
        return scored, [r async for r in stream]

    try:
        scored, results = asyncio.run(both())
    finally:
        engine.stop()
    assert threads == ["engine-tiny"]
    assert (
        scored.logprobs == pytest.approx(engine.runner.score([5, 6, 7]).logprobs, abs=1e-5)
        and len(results[0].tokens) == 12
    )


def test_rows_with_top_k_or_top_p_draw_from_their_filtered_distribution_beside_rows_without():
    """The engine tells sampling whether a live row filters, so a step without filters reads no flags
    back: top_k 1 and a tiny top_p keep only the best token, so those rows draw the greedy tokens, in a
    batch whose other rows draw from the whole distribution."""

    def req(i: int, **sampling) -> GenerationRequest:
        return GenerationRequest(f"f{i}", [1, 2, 3], max_new_tokens=16, sampling=SamplingParams(seed=i, **sampling))

    requests = [req(0, top_k=1), req(1, top_p=1e-6), req(2, temperature=0.0), req(3), req(4)]
    engine = make_engine("linear")
    try:
        results = asyncio.run(_whole_results(engine, requests))
    finally:
        engine.stop()
    top_k, top_p, greedy, free, other = ([r.tokens for r in rs] for rs in results)
    assert top_k == top_p == greedy
    assert free != greedy and other != greedy  # the unfiltered rows sample (a tiny random model is near uniform)


STOPS = [bytes([b]) for b in range(0, 256, 8)]  # a drawn byte stops a sample about one time in eight


def mixed_requests() -> list[GenerationRequest]:
    """Different budgets, stop sequences, penalties, known tokens, several samples, log-probabilities."""
    return [
        GenerationRequest("len", [1, 2, 3], 13, SamplingParams(seed=1), n=2, logprobs=True),
        GenerationRequest("stop", [4, 5, 6], 30, SamplingParams(seed=2), n=2, stop=STOPS),
        GenerationRequest("penalty", [7, 8, 9], 9, SamplingParams(seed=3, frequency_penalty=1.5, presence_penalty=0.5)),
        GenerationRequest("known", [], 20, SamplingParams(seed=4), forced={3: 17, 4: 18, 10: 200}, logprobs=True),
    ]


@pytest.mark.parametrize("kind", ["softmax", "linear", "linformer", "reformer"])
def test_several_steps_per_scheduling_pass_give_the_answers_of_one(kind):
    """Multi-step runs up to 8 decode steps before the scheduler looks again; rows that stop within them
    drop their later tokens. Every answer must be the one a pass after every step gives."""

    def run(steps: int) -> list[list]:
        engine = make_engine(kind, scheduler_steps=steps)
        try:
            return [
                sorted(results, key=lambda r: r.sample)
                for results in asyncio.run(_whole_results(engine, mixed_requests()))
            ]
        finally:
            engine.stop()

    each, multi = run(1), run(8)
    assert any(r.finish_reason == "stop" for r in each[1])  # the stop sequences were met
    for one, several in zip(each, multi):
        assert [(r.sample, r.tokens, r.finish_reason, r.matched_stop) for r in several] == [
            (r.sample, r.tokens, r.finish_reason, r.matched_stop) for r in one
        ]
        for a, b in zip(one, several):
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert [multi[3][0].tokens[p] for p in (3, 4, 10)] == [17, 18, 200]


class FixedCosts(PassCosts):
    """Pass costs that stay as set: the engine's measurements do not move them."""

    def observe_boundary(self, seconds: float) -> None:
        pass

    def observe_steps(self, seconds: float, steps: int) -> None:
        pass


@pytest.mark.parametrize("costs", ["measured", "boundary dearer than waiting"])
def test_a_request_that_can_join_ends_a_multi_step_run_early_unless_waiting_is_cheaper(monkeypatch, costs):
    """With 32 steps per pass, a request arriving during a pass joins within a step or two when its idle
    slot would cost more than stopping the run costs the one running row (measured here: always so with
    many steps left); when a pass boundary costs more, it joins when the run ends."""
    engine = make_engine("linear", scheduler_steps=32)
    if costs != "measured":
        engine._costs = FixedCosts(boundary_seconds=1e3, step_seconds=1e-3)
    joined_at = []
    register = engine.scheduler.register
    monkeypatch.setattr(
        engine.scheduler,
        "register",
        lambda places, *a: joined_at.append(int(engine.runner.slots.position[0])) or register(places, *a),
    )

    async def scenario():
        (long_one,) = queue_then_start(engine, [GenerationRequest("long", [1], 94, SamplingParams(seed=0))], False)
        while int(engine.runner.slots.position[0]) < 38:  # into its second run of 32 steps: the costs are measured
            await asyncio.sleep(0.001)
        submitted_at = int(engine.runner.slots.position[0])
        late = engine.submit(GenerationRequest("late", [2], 5, SamplingParams(seed=1)), each_event=False)
        results = [r async for r in late] + [r async for r in long_one]
        return submitted_at, results

    try:
        submitted_at, results = asyncio.run(scenario())
    finally:
        engine.stop()
    assert [len(r.tokens) for r in results] == [5, 94]
    if costs == "measured":
        assert joined_at[1] - submitted_at <= 2, (submitted_at, joined_at)
    else:
        assert joined_at[1] - joined_at[0] == 64, (submitted_at, joined_at)  # the second run's end


@pytest.mark.parametrize("steps_per_pass", [1, 8])
def test_decode_step_time_counts_every_forward(monkeypatch, steps_per_pass):
    """rnnserve_decode_step_seconds: a step is a draw and a forward. A pass's closing forward runs after its
    record is sent, so it is counted with the next pass; only the very last one can be missing."""
    from server_support import metric_value

    forward_seconds = 0.02
    decode = ModelRunner.decode
    monkeypatch.setattr(ModelRunner, "decode", lambda self, tokens: time.sleep(forward_seconds) or decode(self, tokens))
    engine = make_engine("linear", scheduler_steps=steps_per_pass)
    try:
        asyncio.run(_whole_results(engine, [GenerationRequest("timed", [1, 2], 12, SamplingParams(seed=0))]))
        text = engine.metrics.metrics.render()[0].decode()
    finally:
        engine.stop()
    steps = metric_value(text, "rnnserve_decode_steps_total")
    assert metric_value(text, "rnnserve_decode_step_seconds_count") == steps >= 12
    assert metric_value(text, "rnnserve_decode_step_seconds_sum") >= (steps - 1) * forward_seconds
