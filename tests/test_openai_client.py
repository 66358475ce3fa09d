"""The official `openai` client against a real `rnnserve serve` process.

Lists of prompts (strings and token arrays), `n`, `best_of`, penalties,
`logit_bias`, `top_logprobs`, echo and stop, streamed and not. Penalties are
checked against OpenAI's published formula applied to the same weights file
in this process, greedily, so the expected tokens are exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model.transformer import with_bos
from model.io.weights import load_model
from server_support import save_script_model, save_tiny_model, serving_process

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

SCRIPT = b"> hello hello"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai_weights")
    save_tiny_model(folder, "tiny", "linear", "text", seed=3)
    save_script_model(folder, "script", SCRIPT)
    with serving_process(folder, "--max-batch", "16") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), folder, base


def texts(response) -> list[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def test_a_list_of_prompts_answers_prompt_by_prompt_then_n(served):
    client, _, _ = served
    both = client.completions.create(model="tiny", prompt=["ab", "cd"], n=2, max_tokens=6, seed=5)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [texts(client.completions.create(model="tiny", prompt=p, n=2, max_tokens=6, seed=5)) for p in ("ab", "cd")]
    assert texts(both) == alone[0] + alone[1]
    assert both.usage.prompt_tokens == 4 and both.usage.completion_tokens == 24


def test_token_array_prompts_stream_like_they_answer(served):
    client, _, _ = served
    whole = client.completions.create(model="tiny", prompt=[[72, 105], [65]], max_tokens=5, seed=2)
    parts = {0: "", 1: ""}
    for chunk in client.completions.create(model="tiny", prompt=[[72, 105], [65]], max_tokens=5, seed=2, stream=True):
        for choice in chunk.choices:
            parts[choice.index] += choice.text
    assert [parts[0], parts[1]] == texts(whole)
    assert texts(whole)[0] == texts(client.completions.create(model="tiny", prompt="Hi", max_tokens=5, seed=2))[0]


def test_best_of_returns_the_n_most_likely_of_its_samples(served):
    client, _, _ = served
    drawn = client.completions.create(model="tiny", prompt="x", n=4, max_tokens=8, seed=9, logprobs=0)
    totals = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in drawn.choices), reverse=True)
    best = client.completions.create(model="tiny", prompt="x", n=2, best_of=4, max_tokens=8, seed=9)
    assert [c.text for c in best.choices] == [text for _, text in totals[:2]]
    assert best.choices[0].logprobs is None  # not asked for, though ranking needed them


def greedy_with_penalties(path: Path, prompt: bytes, steps: int, frequency: float, presence: float) -> bytes:
    """OpenAI's definition, applied here: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    model, _ = load_model(path, device="cpu", dtype=torch.float32)
    tokens, counts = list(prompt), torch.zeros(256)
    with torch.inference_mode():
        for _ in range(steps):
            x = torch.tensor([tokens + [0]])
            logits = model(with_bos(x))[0][0, -1].float()
            token = int((logits - counts * frequency - (counts > 0) * presence).argmax())
            counts[token] += 1
            tokens.append(token)
    return bytes(tokens[len(prompt) :])


@pytest.mark.parametrize("frequency, presence", [(0.0, 0.0), (1.5, 0.0), (0.0, 2.0), (1.0, -1.0)])
def test_penalties_follow_openais_formula(served, frequency, presence):
    client, folder, _ = served
    expected = greedy_with_penalties(folder / "tiny.safetensors", b"ab", 12, frequency, presence)
    out = client.completions.create(
        model="tiny",
        prompt="ab",
        max_tokens=12,
        temperature=0,
        frequency_penalty=frequency,
        presence_penalty=presence,
        logprobs=0,
    )
    tokens = out.choices[0].logprobs.tokens
    got = bytes(int(t[len("bytes:\\x") :], 16) if t.startswith("bytes:") else ord(t) for t in tokens)
    assert got == expected


def test_streamed_top_logprobs_equal_the_whole_answers(served):
    client, _, _ = served
    whole = client.completions.create(model="tiny", prompt="ab", max_tokens=6, seed=4, logprobs=3).choices[0].logprobs
    streamed_tokens, streamed_top = [], []
    for chunk in client.completions.create(model="tiny", prompt="ab", max_tokens=6, seed=4, logprobs=3, stream=True):
        for choice in chunk.choices:
            streamed_tokens += choice.logprobs.tokens
            streamed_top += choice.logprobs.top_logprobs
    assert streamed_tokens == whole.tokens and len(streamed_top) == 6
    for mine, theirs in zip(streamed_top, whole.top_logprobs, strict=True):
        assert mine.keys() == theirs.keys() and all(math.isclose(mine[k], theirs[k], abs_tol=1e-6) for k in mine)


def test_logit_bias_moves_the_script_off_its_bytes(served):
    client, _, _ = served
    plain = client.completions.create(model="script", prompt="> ", max_tokens=5, temperature=0)
    assert plain.choices[0].text == "hello"
    banned = client.completions.create(
        model="script", prompt="> ", max_tokens=5, temperature=0, logit_bias={str(ord("h")): -100, str(ord("z")): 100}
    )
    assert banned.choices[0].text == "zzzzz"


def test_top_logprobs_agree_between_generation_and_echo_scoring(served):
    client, _, _ = served
    # Scored again from its text, a generation must encode back to its own bytes: the first seed whose bytes are
    # valid UTF-8 (a text decoded with replacement characters encodes to other bytes).
    for seed in range(4, 200):
        gen = client.completions.create(model="tiny", prompt="ab", max_tokens=6, seed=seed, logprobs=3)
        if "\ufffd" not in gen.choices[0].text:
            break
    else:
        pytest.fail("no seed of 4-199 generated valid UTF-8")
    lp = gen.choices[0].logprobs
    assert all(len(top) in (3, 4) and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    scored = client.completions.create(
        model="tiny", prompt="ab" + gen.choices[0].text, max_tokens=0, echo=True, logprobs=3
    )
    again = scored.choices[0].logprobs.top_logprobs[2:]
    for mine, theirs in zip(lp.top_logprobs, again, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(math.isclose(mine[k], theirs[k], abs_tol=1e-4) for k in mine)


def test_echo_and_stop_streamed_and_not(served):
    client, _, _ = served
    out = client.completions.create(model="script", prompt="> ", max_tokens=11, temperature=0, stop=" h", echo=True)
    assert out.choices[0].text == "> hello" and out.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="script", prompt="> ", max_tokens=11, temperature=0, stop=" h", echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == "> hello"


def test_neutral_values_of_standard_parameters_are_accepted(served):
    client, _, _ = served
    plain = client.completions.create(model="tiny", prompt="q", max_tokens=4, seed=1)
    neutral = client.completions.create(
        model="tiny",
        prompt="q",
        max_tokens=4,
        seed=1,
        frequency_penalty=0,
        presence_penalty=0,
        best_of=1,
        logit_bias={},
        suffix="",
        user="someone",
    )
    assert texts(neutral) == texts(plain)
