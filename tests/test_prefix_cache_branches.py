"""Prompts that share a start but end differently (a system prompt, a few-shot block): the prefix cache keeps the
state where they part (a branch point) and, for a constant-size state, every `--prefix-cache-every` tokens; a
softmax or Reformer cache cuts a longer kept state to any shorter prefix of it (server/engine/prefix_plan.py,
server/engine/prefix_cache.py). Answers stay those of an engine (or a server) without the cache.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.decode.sampling import SamplingParams
from server.engine.core import Engine, EngineLimits
from server.engine.output import LocalOutput
from server.engine.prefix_cache import (
    LOGIT_BYTES,
    Hit,
    Lookup,
    PrefixCache,
    Snapshot,
    restore_snapshot,
    take_snapshot,
)
from server.engine.prefix_plan import MIN_BRANCH_TOKENS, SnapshotPolicy, plan_prefill, runs_of_equal_keys
from server.engine.runner import ModelRunner, snapshot_policy
from server.engine.types import GenerationRequest
from server.metrics import Metrics
from server.serve import add_arguments, settings_from_args
from server.settings import SettingsError, build_settings
from conftest import make_tiny_model
from server_support import TEXT_MAX_LEN, metric_value, save_tiny_model, serving_process
from test_prefix_cache import CACHED_KINDS, assert_same_answers, build_rounds, rounds_of, run_rounds

TRUNCATING_KINDS = ["softmax", "reformer", "softmax+llama", "softmax+mistral"]  # caches kept by position
SHARED = [100 + (7 * i) % 50 for i in range(30)]  # a long start several prompts share


def snap(length: int, nbytes: int = 400) -> Snapshot:
    return Snapshot([[torch.zeros(nbytes // 4 - 1)]], length, torch.zeros(1))


def test_a_lookup_says_how_far_the_input_runs_along_the_stored_sequences():
    cache = PrefixCache(budget=10_000)
    cache.insert([1, 2, 3, 4, 5, 6], snap(6))
    assert cache.find([1, 2, 3, 9]) == Lookup(None, 3)
    cache.insert([1, 2], snap(2))
    found = cache.find([1, 2, 3, 9])
    assert found.hit is not None and (found.hit.length, found.shared) == (2, 3) and not found.hit.partial
    assert cache.find([7, 1]) == Lookup(None, 0)
    assert (cache.queried_tokens, cache.hit_tokens) == (10, 2)


def test_a_partial_hit_cuts_a_longer_snapshot_and_leaves_a_token_to_run():
    cache = PrefixCache(budget=10_000)
    longer = snap(6)
    cache.insert([1, 2, 3, 4, 5, 6], longer)
    assert cache.find([1, 2, 3, 9, 9], truncate=True).hit == Hit(3, longer)
    # a prompt that is a start of the kept one: all but its last token, whose forward gives the next logits
    assert cache.find([1, 2, 3, 4], truncate=True).hit == Hit(3, longer)
    assert cache.find([1, 2, 3, 4, 5, 6, 7], truncate=True).hit == Hit(6, longer)  # a whole one: not partial
    assert cache.find([1, 2, 3, 9], truncate=False).hit is None  # a state that cannot be cut
    assert cache.find([1], truncate=True).hit is None  # nothing would be left to run
    assert cache.hit_tokens == 3 + 3 + 6


def test_a_partial_hit_is_a_use_of_the_longer_entry():
    cache = PrefixCache(budget=800)
    cache.insert([1, 2, 3, 4], snap(4))
    cache.insert([7, 8], snap(2))
    assert cache.find([1, 2, 9], truncate=True).hit == Hit(2, cache.snapshot_of([1, 2, 3, 4]))
    cache.insert([5], snap(1))  # [7, 8] is now the least recently used: it goes
    assert cache.holds([1, 2, 3, 4]) and not cache.holds([7, 8])


def test_a_prefill_stops_at_every_and_its_doublings_and_once_at_a_branch_point():
    every = SnapshotPolicy(every=16)
    assert plan_prefill(Lookup(None, 0), 50, every).stops == (16, 32)  # never at the end: it is kept anyway
    assert plan_prefill(Lookup(None, 0), 200, every).stops == (16, 32, 64, 128)
    assert plan_prefill(Lookup(Hit(32, snap(32)), 32), 200, every).stops == (64, 128)  # past what the cache gave
    assert plan_prefill(Lookup(Hit(32, snap(40)), 41), 47, every).stops == (41,)  # branch point 9 past the hit
    assert plan_prefill(Lookup(Hit(32, snap(40)), 32 + MIN_BRANCH_TOKENS - 1), 47, every).stops == ()  # too near
    assert plan_prefill(Lookup(None, 31), 80, SnapshotPolicy()).stops == (31,)  # one stop: where it branches
    assert plan_prefill(Lookup(None, 31), 31, SnapshotPolicy()).stops == ()  # the prompt ends there
    assert plan_prefill(Lookup(None, 31), 80, SnapshotPolicy(truncates=True)).stops == ()  # cut from longer ones
    assert plan_prefill(Lookup(None, 5), 80, SnapshotPolicy()).stops == ()  # a trivially short shared start
    assert runs_of_equal_keys([(1,), (1,), None, (1,), (2,)]) == [(0, 2), (3, 4), (4, 5)]


def test_a_prefill_takes_only_the_periodic_states_the_budget_holds_besides_its_branch_point_and_end():
    def stops(budget_states: int, shared: int = 0, sharing: int = 1) -> tuple[int, ...]:
        policy = SnapshotPolicy(every=16, budget_states=budget_states)
        return plan_prefill(Lookup(None, shared), 200, policy, sharing).stops

    assert stops(1000) == (16, 32, 64, 128)
    assert stops(3) == (64, 128)  # the deepest ones, which save the most
    assert stops(1) == stops(0) == ()  # the end's state alone fills it
    assert stops(3, shared=100) == (100, 128)  # the branch point's state is kept whatever the room
    assert stops(1, shared=100) == (100,)
    assert stops(5, sharing=2) == (128,)  # two prompts keep states in one prefill: two states each


def test_the_periodic_interval_is_a_flag_and_an_environment_variable(monkeypatch):
    monkeypatch.delenv("RNNSERVE_PREFIX_CACHE_EVERY", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).prefix_cache_every == 64
    assert settings_from_args(parser.parse_args(["--prefix-cache-every", "0"])).prefix_cache_every == 0
    monkeypatch.setenv("RNNSERVE_PREFIX_CACHE_EVERY", "128")
    assert build_settings().prefix_cache_every == 128
    with pytest.raises(SettingsError, match="--prefix-cache-every / RNNSERVE_PREFIX_CACHE_EVERY: .*greater than"):
        build_settings(prefix_cache_every=-1)


@pytest.mark.parametrize("kind", CACHED_KINDS)
def test_each_kind_takes_periodic_snapshots_or_cuts_longer_ones_not_both(kind):
    model = tiny(kind)
    policy = snapshot_policy(model, 64, 1 << 24)
    constant = kind.split("+")[0] in ("linear", "linformer", "hybrid")
    assert (policy.every, policy.truncates) == (64 if constant else 0, not constant)
    if constant:  # as many states as the budget holds, each the state and its logits
        per_state = model.state_bytes_per_sequence() + LOGIT_BYTES * model.config.vocab_out
        assert policy.budget_states == (1 << 24) // per_state
        assert snapshot_policy(model, 64, 2 * per_state).every == 64
        assert snapshot_policy(model, 64, 2 * per_state - 1).every == 0  # room for a prompt's end state alone


@pytest.mark.parametrize("kind", ["linear", "linformer", "hybrid", "hybrid+qwen2"])
def test_a_long_prompt_prefills_in_periodic_pieces_only_where_the_cache_keeps_their_states(kind):
    """A budget of no state or of the prompt's end state alone: one forward, no state copied mid-prompt; room for
    three states: the two deepest periodic ones; room for all: every one. The logits are a full prefill's."""
    model = tiny(kind)
    per_state = model.state_bytes_per_sequence() + LOGIT_BYTES * model.config.vocab_out
    prompt = [1 + (7 * i) % 90 for i in range(90)]  # past 64 tokens read, within the tiny max_len
    read = [*model.config.prompt_lead(len(prompt)), *prompt]
    pieces_and_states = {
        per_state - 1: ([len(read)], []),
        per_state: ([len(read)], [read]),
        3 * per_state: ([32, 32, len(read) - 64], [read[:32], read[:64], read]),
        100 * per_state: ([16, 16, 32, len(read) - 64], [read[:16], read[:32], read[:64], read]),
    }
    plain_logits = prefill_one(model, 0, prompt)[1]
    for budget, (want_pieces, want_kept) in pieces_and_states.items():
        runner, logits, pieces = prefill_one(model, budget, prompt)
        assert pieces == want_pieces
        cache = runner.prefix_cache
        assert cache is not None and cache.entries == len(want_kept)
        assert all(cache.holds(tokens) for tokens in want_kept)
        assert torch.allclose(logits, plain_logits, atol=1e-4)


def prefill_one(model, budget: int, prompt: list[int]) -> tuple[ModelRunner, torch.Tensor, list[int]]:
    """A runner with a prefix cache of `budget` bytes (states every 16 tokens) prefills `prompt`: the runner, the
    next-token logits (V,), and the tokens each forward read."""
    runner = ModelRunner(model, 2, cuda_graphs=False, prefix_cache_bytes=budget, prefix_cache_every=16)
    runner.allocate()
    pieces: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args: pieces.append(args[0].shape[1]))
    try:
        with torch.inference_mode():
            runner.prefill([GenerationRequest("long", prompt, 4, SamplingParams(temperature=0.0))], 0)
    finally:
        hook.remove()
    return runner, runner.slots.logits[0].clone(), pieces


@pytest.mark.parametrize("kind", TRUNCATING_KINDS)
def test_a_cache_kept_by_position_cut_to_a_prefix_is_the_state_after_that_prefix(kind):
    model, tokens = tiny(kind), torch.arange(1, 24)[None]  # (1, 23)
    with torch.inference_mode():
        longer, shorter = model.new_state(1), model.new_state(1)
        model(tokens, longer)
        model(tokens[:, :15], shorter)
        cut = model.new_state(1)
        restore_snapshot(cut, 0, take_snapshot(longer, 0, torch.zeros(model.config.vocab_out)), 15)
        assert int(cut.lengths[0]) == 15
        for got, want in zip(cut.layers, shorter.layers):
            for g, w in zip(got.tensors(), want.tensors()):
                assert torch.allclose(g.float(), w.float(), atol=1e-5)
        rest = torch.tensor([[9, 8, 7]])
        assert torch.allclose(model(rest, cut)[0], model(rest, shorter)[0], atol=1e-4)


def test_a_constant_size_state_cannot_be_cut():
    model = tiny("linear")
    state = model.new_state(1)
    with torch.inference_mode():
        model(torch.arange(1, 10)[None], state)
    with pytest.raises(ValueError, match="cannot be cut to 4"):
        restore_snapshot(model.new_state(1), 0, take_snapshot(state, 0, torch.zeros(model.config.vocab_out)), 4)


def tiny(kind: str, seed: int = 3):
    """A tiny model whose hybrid window is shorter than the prompts, so its linear sums are used."""
    return make_tiny_model(kind, seed=seed, **({"hybrid_window": 8} if kind.startswith("hybrid") else {}))


def make_engine(kind: str, prefix_bytes: int, every: int = 0) -> Engine:
    limits = EngineLimits(max_batch=8, max_waiting=16, prefix_cache_memory=prefix_bytes, prefix_cache_every=every)
    model = tiny(kind)
    return Engine("tiny", model, {}, limits, LocalOutput.recording(Metrics(), "tiny", model))


def shared_start_rounds() -> list[list[GenerationRequest]]:
    """A, B and C: the shared start with three endings, one after the other; B sampled with a seed."""
    endings = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    return [
        [GenerationRequest(name, [*SHARED, *ending], 4, sampling, logprobs=True)]
        for name, ending, sampling in zip("ABC", endings, samplings)
    ]


def expected_cached(kind: str, every: int) -> list[int]:
    """A takes nothing. B: a softmax or Reformer cache all of the shared start (cut from A's state); a
    constant-size one the deepest of `every`, 2 `every`, 4 `every`, ... tokens read within it (none without periodic
    snapshots). C takes all of it: from the state B kept where it left A (or cut from A's or B's)."""
    lead = len(tiny(kind).config.prompt_lead(len(SHARED)))
    if kind in TRUNCATING_KINDS:
        return [0, len(SHARED), len(SHARED)]
    periodic = max((every << k for k in range(8) if every << k <= lead + len(SHARED)), default=0)
    assert lead + len(SHARED) - periodic >= MIN_BRANCH_TOKENS  # B stops at the branch point
    return [0, max(0, periodic - lead), len(SHARED)]


@pytest.mark.parametrize("every", [0, 16])
@pytest.mark.parametrize("kind", CACHED_KINDS)
def test_prompts_sharing_a_start_take_it_from_the_second_or_third_on(kind, every):
    engine = make_engine(kind, 1 << 24, every)
    cached = run_rounds(engine, shared_start_rounds())
    want = expected_cached(kind, every)
    assert [answer[0][2] for answer in cached] == want
    assert_same_answers(cached, run_rounds(make_engine(kind, 0, every), shared_start_rounds()))
    cache, lead = engine.runner.prefix_cache, len(engine.model.config.prompt_lead(1))
    assert cache is not None
    assert cache.queried_tokens == sum(lead + len(r[0].prompt) for r in shared_start_rounds())
    assert cache.hit_tokens == sum(lead + n for n in want if n)  # tokens read, the lead included


@pytest.mark.parametrize("kind", TRUNCATING_KINDS)
def test_a_prompt_that_starts_a_kept_one_takes_all_but_its_last_token(kind):
    first = GenerationRequest("long", [*SHARED, 1, 2, 3], 4, SamplingParams(temperature=0.0), logprobs=True)
    start = GenerationRequest("start", SHARED, 4, SamplingParams(temperature=0.0), logprobs=True)
    rounds = [[first], [start]]
    cached = run_rounds(make_engine(kind, 1 << 24), rounds)
    assert [answer[0][2] for answer in cached] == [0, len(SHARED) - 1]
    assert_same_answers(cached, run_rounds(make_engine(kind, 0), rounds))


# Stems that share long starts, so that later prompts meet branch points, periodic states and longer states to cut.
LONG_STEMS = ([*SHARED[:20], 1, 2, 3], [*SHARED[:20], 4], [*SHARED[:12], 5, 6], [30, 31])


some_rounds = rounds_of(LONG_STEMS)


def least_cached(kind: str, rounds: list[list[GenerationRequest]]) -> list[int]:
    """Per request, what an earlier round's prompt guarantees it with nothing evicted: all of that prompt if it
    starts with it; for a cache kept by position, as much as they share (all but the last token of its own)."""
    seen: list[list[int]] = []
    least = []
    for requests in rounds:
        for request in requests:
            prompt, found = request.prompt, [0]
            for earlier in seen:
                common = next(
                    (i for i, (a, b) in enumerate(zip(prompt, earlier)) if a != b), min(len(prompt), len(earlier))
                )
                found.append(len(earlier) if common == len(earlier) else 0)
                if kind in TRUNCATING_KINDS:
                    found.append(min(common, len(prompt) - 1))
            least.append(max(found))
        seen.extend(r.prompt for r in requests)
    return least


@pytest.mark.parametrize("kind", [*CACHED_KINDS, "softmax+mistral"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draws=some_rounds, budget_states=st.sampled_from([1, 3, 1000]), every=st.sampled_from([0, 5, 16]))
def test_answers_with_branch_points_periodic_and_cut_states_are_those_without_the_cache(
    kind, draws, budget_states, every
):
    """A budget of a few states forces evictions (of states a prefill keeps mid-prompt too); a large one keeps
    every state."""
    per_state = tiny(kind).state_bytes_per_sequence(len(LONG_STEMS[0]) + 10)
    rounds = build_rounds(draws, LONG_STEMS)
    cached = run_rounds(make_engine(kind, budget_states * per_state, every), rounds)
    assert_same_answers(cached, run_rounds(make_engine(kind, 0), build_rounds(draws, LONG_STEMS)))
    if budget_states == 1000:
        assert all(a[0][2] >= least for a, least in zip(cached, least_cached(kind, rounds)))


def test_servers_of_every_kind_take_a_shared_start_from_their_caches_as_servers_without_them_answer(tmp_path):
    """Real `rnnserve serve` processes, one model of each kind: A = a 41-byte start + "KING:", B = the same start +
    "QUEEN:", C = the same start + "JACK:", one after the other; usage, /metrics and the answers of a server with
    --prefix-cache-memory 0."""
    kinds = ["linear", "linformer", "hybrid", "softmax", "reformer"]
    for kind in kinds:
        save_tiny_model(tmp_path, kind, kind, "text", seed=5, **({"hybrid_window": 16} if kind == "hybrid" else {}))
    start = "You are a helpful royal court attendant. "
    assert len(start) == 41 and len(start) + len("QUEEN:") + 6 <= TEXT_MAX_LEN
    endings = ["KING:", "QUEEN:", "JACK:"]
    bodies = [
        {"prompt": start + endings[0], "max_tokens": 6, "temperature": 0, "logprobs": 1},
        {"prompt": start + endings[1], "max_tokens": 6, "temperature": 0.9, "seed": 11, "logprobs": 1},
        {"prompt": start + endings[2], "max_tokens": 6, "temperature": 0, "logprobs": 1},
    ]

    def serve(*flags: str) -> tuple[dict[str, list[dict]], str, dict]:
        with serving_process(tmp_path, *flags) as url:
            answers = {
                kind: [
                    httpx.post(f"{url}/v1/completions", json={**b, "model": kind}, timeout=60).json() for b in bodies
                ]
                for kind in kinds
            }
            cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
            return answers, httpx.get(f"{url}/metrics", timeout=30).text, cards

    cached, metrics, cards = serve("--workers", "1", "--prefix-cache-memory", "4MiB", "--prefix-cache-every", "16")
    plain, plain_metrics, _ = serve("--workers", "1", "--prefix-cache-memory", "0")
    # Read: the start token, then the prompt's bytes: the shared start is 42 tokens read. Softmax and Reformer
    # cut A's state to it; the others take B's periodic state at 32 tokens read (31 bytes of it), then C the
    # state B kept at the branch point.
    want = {kind: [0, 41, 41] if kind in ("softmax", "reformer") else [0, 31, 41] for kind in kinds}
    got = {
        kind: [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        for kind, answers in cached.items()
    }
    assert got == want
    for kind in kinds:
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in plain[kind]] == [0, 0, 0]
        for with_cache, without in zip(cached[kind], plain[kind]):
            assert with_cache["choices"][0]["text"] == without["choices"][0]["text"]
            lp_cached = with_cache["choices"][0]["logprobs"]["token_logprobs"]
            assert lp_cached == pytest.approx(without["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
        queried = sum(1 + len(body["prompt"]) for body in bodies)
        assert metric_value(metrics, "rnnserve_prefix_cache_queried_tokens_total", model=kind) == queried
        hit = sum(1 + n for n in want[kind] if n)
        assert metric_value(metrics, "rnnserve_prefix_cache_hit_tokens_total", model=kind) == hit
        assert metric_value(plain_metrics, "rnnserve_prefix_cache_hit_tokens_total", model=kind) == 0
        assert cards[kind]["prefix_cache_every"] == (0 if kind in ("softmax", "reformer") else 16)
