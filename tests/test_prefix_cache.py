"""The prefix cache of decode states (server/engine/prefix_cache.py): a request whose start was read before
prefills only the rest, and answers exactly as it does with the cache off.

Engines run in-process on tiny models; each property test sends rounds of prompts built from a few shared stems
(so they share prefixes, overlap, repeat and extend each other) to an engine with the cache on, under a budget
small enough to force evictions, and to one with it off: greedy tokens and seeded samples must match, and
log-probabilities within 1e-4.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.decode.sampling import SamplingParams
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.prefix_cache import LOGIT_BYTES, PrefixCache, Snapshot, take_snapshot
from server.engine.runner import ModelRunner
from server.engine.types import GenerationRequest
from server.metrics import Metrics
from conftest import make_tiny_model
from server_support import TEXT_MAX_LEN, metric_value, save_tiny_model, serving_process

CACHED_KINDS = ["linear", "linformer", "hybrid", "softmax", "reformer", "softmax+llama", "linear+llama", "hybrid+qwen2"]
STEMS = ([5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 20], [30, 31], [40])  # share prefixes with each other


def snapshot(nbytes: int) -> Snapshot:
    return Snapshot([[torch.zeros(nbytes // 4 - 1)]], 1, torch.zeros(1))


def test_the_longest_cached_prefix_is_found_and_the_least_recently_used_is_evicted_first():
    cache = PrefixCache(budget=3 * 400)
    assert cache.insert([1, 2], snapshot(400)) and cache.insert([1, 2, 3, 4], snapshot(400))
    assert cache.insert([9], snapshot(400))
    hit = cache.lookup([1, 2, 3, 4, 5])
    assert hit is not None and hit.length == 4
    assert cache.lookup([1, 2, 3]).length == 2
    assert cache.lookup([7]) is None
    assert (cache.queried_tokens, cache.hit_tokens) == (9, 6)
    assert cache.insert([8], snapshot(400))  # [9] is the least recently used: it goes
    assert cache.lookup([9]) is None and cache.entries == 3 and cache.bytes_held == 1200
    assert not cache.insert([7], snapshot(2000))  # larger than the whole budget: not kept, nothing evicted
    assert cache.entries == 3


def test_an_evicted_branch_is_pruned_from_the_trie():
    cache = PrefixCache(budget=400)
    cache.insert([1, 2, 3], snapshot(400))
    cache.insert([4], snapshot(400))
    assert cache.lookup([1, 2, 3]) is None and not cache._root.children.get(1)


def test_keeping_a_state_copies_it_only_where_none_is_kept_and_makes_it_the_most_recently_used():
    cache = PrefixCache(budget=2 * 400)
    copies: list[Snapshot] = []

    def take() -> Snapshot:
        copies.append(snapshot(400))
        return copies[-1]

    first = cache.keep([1, 2], take)
    assert first is copies[0] and cache.keep([3], take) is copies[1]
    assert cache.keep([1, 2], take) is first and len(copies) == 2  # kept already: no copy, only a use
    assert cache.keep([4], take) is copies[2]  # [3] is now the least recently used: it goes
    assert cache.holds([1, 2]) and not cache.holds([3]) and (cache.entries, cache.bytes_held) == (2, 800)


def test_a_state_kept_above_the_entry_it_evicts_stays_in_the_trie():
    """The only entry, [1, 2, 3], makes room for [1, 2]: the pruning of its bare branch stops at [1, 2]."""
    cache = PrefixCache(budget=400)
    cache.insert([1, 2, 3], snapshot(400))
    kept = cache.keep([1, 2], lambda: snapshot(400))
    assert kept is not None and cache.holds([1, 2]) and not cache.holds([1, 2, 3])
    hit = cache.lookup([1, 2, 5])
    assert hit is not None and (hit.length, hit.snapshot) == (2, kept)


def test_a_state_larger_than_the_budget_leaves_no_branch_behind():
    cache = PrefixCache(budget=400)
    cache.insert([1], snapshot(400))
    assert cache.keep([1, 2, 3], lambda: snapshot(800)) is None
    assert cache.entries == 1 and cache.holds([1]) and not cache._root.children[1].children


@pytest.mark.parametrize("kind", ["linear", "linformer", "softmax", "softmax+llama", "linear+llama"])
def test_a_cached_prefix_holds_the_state_of_its_length_and_the_logits(kind):
    """The memory arithmetic docs/operations.md gives: a state at the prefix's length (constant for linear and
    Linformer, growing for softmax), plus float32 logits."""
    model = make_tiny_model(kind)
    state = model.new_state(2)
    with torch.inference_mode():
        model(torch.arange(1, 12)[None].expand(2, -1), state)
    taken = take_snapshot(state, 1, torch.zeros(model.config.vocab_out))
    assert taken.length == 11
    assert taken.nbytes == model.state_bytes_per_sequence(11) + LOGIT_BYTES * model.config.vocab_out


def make_engine(kind: str, prefix_bytes: int, seed: int = 3) -> Engine:
    limits = EngineLimits(max_batch=8, max_waiting=16, prefix_cache_memory=prefix_bytes)
    model = make_tiny_model(kind, seed=seed)
    return Engine("tiny", model, {}, limits, LocalOutput.recording(Metrics(), "tiny", model))


async def _run_round(engine: Engine, requests: list[GenerationRequest]) -> list[list]:
    streams = [engine.submit(r, each_event=False) for r in requests]
    return [[result async for result in stream] for stream in streams]


def run_rounds(engine: Engine, rounds: list[list[GenerationRequest]]) -> list[list]:
    """Each round's requests submitted together (their prompts of one length prefill in one group), round after
    round: per request, its samples' (tokens, logprobs, cached tokens)."""
    engine.start()
    try:
        answers = []
        for requests in rounds:
            for results in asyncio.run(_run_round(engine, requests)):
                answers.append([(r.tokens, r.logprobs, r.cached_tokens) for r in results])
        return answers
    finally:
        engine.stop()


def build_rounds(
    draws: list[list[tuple[int, list[int], int, int]]], stems: tuple[list[int], ...] = STEMS
) -> list[list[GenerationRequest]]:
    """(stem, tail, n, seed) per request per round -> requests: greedy for even seeds, sampled for odd ones."""
    rounds = []
    for r, draw in enumerate(draws):
        requests = []
        for i, (stem, tail, n, seed) in enumerate(draw):
            sampling = SamplingParams(temperature=0.0 if seed % 2 == 0 else 1.0, seed=seed)
            prompt = [*stems[stem], *tail]
            requests.append(GenerationRequest(f"r{r}-{i}", prompt, 6, sampling, n=n, logprobs=True))
        rounds.append(requests)
    return rounds


def rounds_of(stems: tuple[list[int], ...]) -> st.SearchStrategy:
    """2 to 4 rounds of 1 to 3 requests, each (stem index, tail, n, seed) as build_rounds reads them."""
    a_request = st.tuples(
        st.integers(0, len(stems) - 1), st.lists(st.integers(0, 3), max_size=4), st.integers(1, 2), st.integers(0, 5)
    )
    return st.lists(st.lists(a_request, min_size=1, max_size=3), min_size=2, max_size=4)


some_rounds = rounds_of(STEMS)


def assert_same_answers(cached: list[list], plain: list[list]) -> None:
    assert len(cached) == len(plain)
    for with_cache, without in zip(cached, plain):
        assert [tokens for tokens, _, _ in with_cache] == [tokens for tokens, _, _ in without]
        for (_, lp_cached, _), (_, lp_plain, _) in zip(with_cache, without):
            assert lp_cached == pytest.approx(lp_plain, abs=1e-4)
        assert all(cached_tokens == 0 for _, _, cached_tokens in without)


@pytest.mark.parametrize("kind", CACHED_KINDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draws=some_rounds, budget_states=st.sampled_from([1, 3, 1000]))
def test_answers_with_the_cache_are_those_without_it(kind, draws, budget_states):
    """A budget of a few states forces evictions; a large one keeps every prefix."""
    per_state = make_tiny_model(kind).state_bytes_per_sequence(len(STEMS[0]) + 6)
    rounds = build_rounds(draws)
    cached = run_rounds(make_engine(kind, budget_states * per_state), rounds)
    plain = run_rounds(make_engine(kind, 0), build_rounds(draws))
    assert_same_answers(cached, plain)
    if budget_states == 1000:  # nothing evicted: a prompt that starts with an earlier round's takes its state
        assert all(a[0][2] >= least for a, least in zip(cached, expected_cached(rounds)))


def expected_cached(rounds: list[list[GenerationRequest]]) -> list[int]:
    """Per request, the longest earlier round's prompt it starts with (its state is kept when that round ends)."""
    seen: list[list[int]] = []
    expected = []
    for requests in rounds:
        for request in requests:
            starts = [len(p) for p in seen if request.prompt[: len(p)] == p]
            expected.append(max(starts, default=0))
        seen.extend(r.prompt for r in requests)
    return expected


@pytest.mark.parametrize("kind", CACHED_KINDS)
def test_a_repeated_or_extended_prompt_reports_its_cached_tokens(kind):
    engine = make_engine(kind, 1 << 24)
    stem = STEMS[0]
    rounds = [
        [GenerationRequest("a", stem, 4, SamplingParams(temperature=0.0), logprobs=True)],
        [GenerationRequest("b", stem, 4, SamplingParams(temperature=0.0), logprobs=True)],
        [GenerationRequest("c", [*stem, 1, 2], 4, SamplingParams(temperature=0.0), logprobs=True)],
    ]
    answers = run_rounds(engine, rounds)
    assert [a[0][2] for a in answers] == [0, len(stem), len(stem)]
    plain = run_rounds(make_engine(kind, 0), rounds)
    assert_same_answers(answers, plain)
    cache = engine.runner.prefix_cache
    # Two prompts and two finished sequences ("b" read what "a" read): each state kept once
    assert cache is not None and cache.entries == 4 and cache.hit_tokens > 0


@pytest.mark.parametrize("kind", CACHED_KINDS)
def test_a_conversations_next_turn_takes_the_state_after_the_last_answer(kind):
    """A finished sequence's state is kept after all it read: the next turn repeats prompt and answer, and
    prefills only the tokens after them (the answer's last token was drawn, never read)."""
    first = GenerationRequest("t1", STEMS[0], 4, SamplingParams(temperature=0.0), logprobs=True)
    engine = make_engine(kind, 1 << 24)
    (answer,) = run_rounds(engine, [[first]])
    turn = [*STEMS[0], *answer[0][0], 3, 1]
    second = GenerationRequest("t2", turn, 4, SamplingParams(temperature=0.0), logprobs=True)
    engine = make_engine(kind, 1 << 24)
    cached = run_rounds(engine, [[first], [second]])
    assert cached[1][0][2] == len(STEMS[0]) + 4 - 1
    assert_same_answers(cached, run_rounds(make_engine(kind, 0), [[first], [second]]))


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_a_weighed_prompt_takes_its_likelihood_from_the_cache_as_from_a_full_prefill(kind):
    """Requests with particles (images) need log p(prompt): the cached part's is kept with its state."""

    def likelihoods(prefix_bytes: int) -> list[float]:
        runner = ModelRunner(make_tiny_model(kind, seed=4), 4, cuda_graphs=False, prefix_cache_bytes=prefix_bytes)
        runner.allocate()
        got = []
        for i, prompt in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]):
            sampling = SamplingParams(temperature=0.8, seed=i)
            request = GenerationRequest(f"p{i}", prompt, 4, sampling, particles=1)
            got.extend(runner.prefill([request], 0))
            got.append(float(runner.slots.logits[0].sum()))
        return got

    with torch.inference_mode():
        assert likelihoods(1 << 24) == pytest.approx(likelihoods(0), abs=1e-4)


def test_a_server_answers_a_repeated_long_prefix_from_its_cache_as_a_server_without_one(tmp_path):
    """Real `rnnserve serve` processes: the second request with the first's long prompt and more reports
    cached_tokens, counts them in /metrics, and answers as a server with --prefix-cache-memory 0 does."""
    save_tiny_model(tmp_path, "tiny", "linear", "text", seed=5)
    prefix = "the same long system prompt, "
    assert len(prefix) + 10 < TEXT_MAX_LEN
    bodies = [
        {"model": "tiny", "prompt": prefix, "max_tokens": 6, "temperature": 0, "logprobs": 1},
        {"model": "tiny", "prompt": prefix + "and more", "max_tokens": 6, "temperature": 0, "logprobs": 1},
    ]

    def serve(*flags: str) -> tuple[list[dict], str, dict]:
        with serving_process(tmp_path, *flags) as url:
            answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for body in bodies]
            models = httpx.get(f"{url}/v1/models", timeout=30).json()
            return answers, httpx.get(f"{url}/metrics", timeout=30).text, models

    cached, metrics, models = serve("--prefix-cache-memory", "1MiB")
    plain, plain_metrics, plain_models = serve("--prefix-cache-memory", "0")
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in cached] == [0, len(prefix)]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in plain] == [0, 0]
    for with_cache, without in zip(cached, plain):
        assert with_cache["choices"][0]["text"] == without["choices"][0]["text"]
        lp_cached = with_cache["choices"][0]["logprobs"]["token_logprobs"]
        assert lp_cached == pytest.approx(without["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert metric_value(metrics, "rnnserve_prefix_cache_hit_tokens_total", model="tiny") == len(prefix) + 1  # + BOS
    queried = 2 * (len(prefix) + 1) + len("and more")
    assert metric_value(metrics, "rnnserve_prefix_cache_queried_tokens_total", model="tiny") == queried
    # two prompts' states, and two finished sequences' (prompt and generated tokens)
    assert metric_value(metrics, "rnnserve_prefix_cache_entries", model="tiny") == 4
    assert 0 < metric_value(metrics, "rnnserve_prefix_cache_bytes", model="tiny") <= 1 << 20
    assert metric_value(plain_metrics, "rnnserve_prefix_cache_hit_tokens_total", model="tiny") == 0
    assert models["data"][0]["prefix_cache_memory"] == 1 << 20
    assert models["data"][0]["prefix_cache_bytes_per_prefix"] > models["data"][0]["state_bytes_per_sequence"]
    assert plain_models["data"][0]["prefix_cache_memory"] == 0
    assert plain_models["data"][0]["prefix_cache_bytes_per_prefix"] is None
