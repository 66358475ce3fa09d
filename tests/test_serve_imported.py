"""An imported GPT-2 served over real HTTP and spoken to with the OpenAI client: text in, text out through its own
tokenizer, with Hugging Face's greedy tokens, its token strings in logprobs, usage in its tokens, stop sequences
that end inside a token, logit_bias on ids past 255, and its end-of-text token ending a sample. Its linearized
twin (`rnnserve linearize`, fine-tuned on text tokenized by the same tokenizer) is served beside it."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)
openai = pytest.importorskip("openai", reason="the OpenAI client (make test installs it)")

from hf_support import CORPUS, END_OF_TEXT, UNICODE, gpt2_folder, imported  # noqa: E402  (fixtures; after the skip)
from server_support import make_settings, running_server, save_tiny_model, sse_payloads  # noqa: E402

from model.io.vocabulary import vocabulary_for  # noqa: E402
from model.io.weights import load_model, read_metadata, read_tokenizer  # noqa: E402
from rnnserve_cli import main  # noqa: E402
from training.train import INHERITED_FIELDS  # noqa: E402

__all__ = ["gpt2_folder", "imported"]
MODEL = "gpt2-tiny"
LINEAR = "gpt2-tiny-hedgehog"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def linearized(imported, corpus):
    out = imported.parent / f"{LINEAR}.safetensors"
    flags = ["--feature-map", "hedgehog", "--data", str(corpus), "--steps", "3", "--batch-size", "2"]
    run = ["--device", "cpu", "--threads", "1", "--no-progress", "--checkpoint", str(out.with_suffix(".ckpt"))]
    assert main(["linearize", str(imported), "--out", str(out), *flags, *run]) == 0
    return out


def test_the_linearized_model_keeps_the_vocabulary_and_tokenizer(imported, linearized):
    source, _ = read_metadata(imported)
    config, info = read_metadata(linearized)
    assert (config.attention, config.linear_feature_map) == ("linear", "hedgehog")
    assert {f: getattr(config, f) for f in INHERITED_FIELDS} == {f: getattr(source, f) for f in INHERITED_FIELDS}
    assert read_tokenizer(linearized) == read_tokenizer(imported)
    assert read_tokenizer(linearized.with_suffix(".ckpt")) == read_tokenizer(imported)  # rnnserve eval reads it


def test_its_loss_is_per_byte_of_the_validation_text(linearized, corpus, hf):
    _, tokenizer = hf
    raw = corpus.read_bytes()
    valid = raw[len(raw) * 9 // 10 :].decode("utf-8", errors="ignore")  # the cut moves to a character's start
    evaluation = read_metadata(linearized)[1]["eval"]
    assert evaluation["bytes"] == len(valid.encode()) and evaluation["tokens"] == len(tokenizer.encode(valid))
    per_byte = evaluation["loss_nats_per_token"] * evaluation["tokens"] / evaluation["bytes"]
    assert evaluation["loss_nats_per_byte"] == pytest.approx(per_byte)
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss_nats_per_token"]))
    model, _ = load_model(linearized)
    assert model.config.vocab_size == len(tokenizer)


@pytest.fixture(scope="module")
def server(imported, linearized):
    save_tiny_model(imported.parent, "bytes-text", "linear", "text", seed=1)  # a byte model served beside it
    with running_server(make_settings(weights=imported.parent, max_batch=8)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(gpt2_folder):
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    return model, transformers.AutoTokenizer.from_pretrained(gpt2_folder)


def hf_greedy(hf, prompt: str | list[int], new_tokens: int) -> list[int]:
    """Hugging Face's greedy tokens after `prompt` as its tokenizer encodes it, nothing prepended (as
    `pipeline("text-generation")` and vLLM read it); stops at the end token."""
    model, tokenizer = hf
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids = torch.tensor([tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=end
    )
    return out[0, ids.shape[1] :].tolist()


def greedy(client, prompt, max_tokens: int = 24, **options):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **options)


def test_models_name_each_model_s_tokenizer(server):
    models = {m["id"]: m for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert models[MODEL]["tokenizer"].endswith("tokens)") and "BPE" in models[MODEL]["tokenizer"]
    assert models[LINEAR]["tokenizer"] == models[MODEL]["tokenizer"]
    assert (models[LINEAR]["attention"], models["bytes-text"]["tokenizer"]) == ("linear", "bytes")


def test_the_linearized_twin_answers_text_through_the_same_tokenizer(client, hf):
    _, tokenizer = hf
    answer = client.completions.create(model=LINEAR, prompt=UNICODE, max_tokens=8, temperature=0, logprobs=0)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(UNICODE)) and answer.usage.completion_tokens == 8
    shown = {tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))}
    assert all(t in shown or t.startswith("bytes:") for t in answer.choices[0].logprobs.tokens)


def test_text_in_text_out_is_hugging_face_s_greedy_decode(client, hf):
    expected = hf_greedy(hf, UNICODE, 24)
    answer = greedy(client, UNICODE)
    _, tokenizer = hf
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(UNICODE))
    assert answer.usage.completion_tokens == len(expected)


@pytest.mark.parametrize("prompt", ["To be", " naïve café: ∑ x²", "Whether 'tis nobler in the mind"])
def test_64_greedy_tokens_continue_the_prompt_as_written_as_hugging_face_does(client, hf, imported, prompt):
    _, tokenizer = hf
    expected = hf_greedy(hf, prompt, 64)
    answer = greedy(client, prompt, 64, logprobs=0)
    shown = vocabulary_for(*read_metadata(imported)[:1], read_tokenizer(imported)).shown  # how logprobs name ids
    assert answer.choices[0].logprobs.tokens == [shown[t] for t in expected]  # token for token, not only the text
    assert answer.usage.prompt_tokens == len(tokenizer(prompt).input_ids)


def test_echo_scores_the_prompt_as_hugging_face_does_and_its_first_token_has_none(client, hf):
    model, tokenizer = hf
    ids = tokenizer("To be, or not to be").input_ids
    answer = greedy(client, ids, 0, echo=True, logprobs=1).choices[0].logprobs
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)  # position t predicts token t + 1
    assert answer.token_logprobs[0] is None and answer.top_logprobs[0] is None
    assert answer.token_logprobs[1:] == pytest.approx([float(expected[t, i]) for t, i in enumerate(ids[1:])], abs=1e-4)


def test_the_whole_context_is_usable_and_one_token_more_is_refused(server, client, hf):
    _, tokenizer = hf
    context = 128  # the folder's n_positions
    ids = (tokenizer("To be, or not to be, that is the question. ").input_ids * context)[:context]
    assert greedy(client, ids, 1).usage.completion_tokens == 1  # reads all 128 positions, draws one more
    assert greedy(client, ids[:100], 29).usage.completion_tokens == 29
    too_long = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": ids[:100], "max_tokens": 30})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_token_ids_and_text_prompts_give_the_same_answer(client, hf):
    _, tokenizer = hf
    by_text = greedy(client, "naïve café")
    by_ids = greedy(client, tokenizer.encode("naïve café"))
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streamed_chunks_join_to_the_whole_answer(client):
    whole = greedy(client, UNICODE, 40).choices[0].text
    chunks = [c.choices[0].text for c in greedy(client, UNICODE, 40, stream=True) if c.choices]
    assert "".join(chunks) == whole and len(chunks) > 1


def test_logprobs_name_the_tokenizer_s_tokens(client, hf):
    _, tokenizer = hf
    answer = greedy(client, "To be, or not", 12, logprobs=2, echo=True)
    logprobs = answer.choices[0].logprobs
    prompt = tokenizer.encode("To be, or not")
    shown = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(prompt)]
    assert logprobs.tokens[: len(prompt)] == shown  # the echoed prompt, token by token
    assert answer.choices[0].text.startswith("To be, or not") and len(logprobs.tokens) == len(prompt) + 12
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[1] == len(shown[0])


def wordy(client, hf, max_tokens: int = 40, **options):
    """A seeded sample drawn from the tokenizer's merged tokens only (the random model's own choice is mostly
    single bytes that are no text): pieces of the corpus's words, several characters each."""
    _, tokenizer = hf
    merged = {
        str(t): 30 for t in range(len(tokenizer)) if len(tokenizer.decode([t])) > 1 and "�" not in tokenizer.decode([t])
    }
    return client.completions.create(
        model=MODEL, prompt=UNICODE, max_tokens=max_tokens, temperature=1.0, seed=7, logit_bias=merged, **options
    )


def test_a_stop_sequence_inside_a_token_cuts_the_text_where_it_begins(client, hf):
    whole = wordy(client, hf, logprobs=0).choices[0]
    tokens, offsets = whole.logprobs.tokens, whole.logprobs.text_offset
    k = next(i for i in range(1, len(tokens)) if len(tokens[i]) >= 3)  # a later token of three characters or more
    stop = whole.text[offsets[k] + 1 : offsets[k] + 3]  # begins inside that token
    answer = wordy(client, hf, stop=[stop]).choices[0]
    assert answer.finish_reason == "stop"
    assert answer.text == whole.text[: whole.text.index(stop)]
    streamed = "".join(c.choices[0].text for c in wordy(client, hf, stop=[stop], stream=True) if c.choices)
    assert streamed == answer.text


def test_logit_bias_reaches_tokens_past_255_and_the_end_token_stops(client, hf):
    _, tokenizer = hf
    token = tokenizer.encode(" the")[0] if len(tokenizer.encode(" the")) == 1 else len(tokenizer) - 2
    assert token > 255
    forced = greedy(client, "x", 5, logit_bias={str(token): 100})
    assert forced.choices[0].text == tokenizer.decode([token] * 5)
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ended = greedy(client, "x", 5, logit_bias={str(end): 100})
    assert (ended.choices[0].text, ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("", "stop", 1)


def test_ids_outside_the_vocabulary_are_refused_and_the_server_goes_on(server, client, hf):
    _, tokenizer = hf
    size = len(tokenizer)
    for body, param in (
        ({"prompt": [1, size]}, "prompt"),
        ({"prompt": "x", "logit_bias": {str(size): 1}}, "logit_bias"),
    ):
        answer = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == param and f"0..{size - 1}" in error["message"]
    assert greedy(client, "x", 2).choices[0].text is not None


def test_a_byte_model_beside_it_keeps_its_byte_tokens(server):
    body = {"model": "bytes-text", "prompt": "€", "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True}
    answer = httpx.post(f"{server}/v1/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 3  # three UTF-8 bytes
    assert answer["choices"][0]["logprobs"]["tokens"][:3] == ["bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"]
    stream = httpx.post(f"{server}/v1/completions", json={**body, "stream": True, "logprobs": None})
    assert (
        "".join(p["choices"][0]["text"] for p in sse_payloads(stream.text) if p["choices"])
        == (answer["choices"][0]["text"])
    )


def test_tokenize_and_detokenize_use_each_model_s_tokens(server, hf):
    _, tokenizer = hf
    ours = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": UNICODE, "return_token_strs": True}).json()
    assert ours["tokens"] == tokenizer.encode(UNICODE) and ours["count"] == len(ours["tokens"])
    assert ours["max_model_len"] == 128 and len(ours["token_strs"]) == ours["count"]
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": ours["tokens"]}).json()
    assert back["prompt"] == UNICODE
    as_bytes = httpx.post(f"{server}/tokenize", json={"model": "bytes-text", "prompt": "é", "return_token_strs": True})
    assert (as_bytes.json()["tokens"], as_bytes.json()["token_strs"]) == ([0xC3, 0xA9], ["bytes:\\xc3", "bytes:\\xa9"])


def test_tokenize_refusals_name_the_field(server):
    cases = [
        ("/detokenize", {"model": MODEL, "tokens": [10**6]}, "tokens", "0.."),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens", ""),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, "prompt", "lone UTF-16 surrogate"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, "model", "not loaded"),
    ]
    for path, body, param, words in cases:
        answer = httpx.post(f"{server}{path}", content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param, (path, answer.text)
        assert words in answer.json()["error"]["message"]
