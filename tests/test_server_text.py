"""POST /v1/completions over real HTTP, plus the UTF-8 / stop-sequence logic it relies on."""

from __future__ import annotations

import codecs
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from server.engine.stopping import StoppingCriteria
from model.io.vocabulary import Vocabulary, byte_vocabulary, shown_bytes
from server.api.sample_text import SampleText, char_offsets, incomplete_utf8_suffix, longest_stop_prefix
from server_support import (
    KINDS,
    TEXT_MAX_LEN,
    make_settings,
    running_server,
    save_script_model,
    save_tiny_model,
    sse_payloads,
    token_bytes,
)

SCRIPT = "> €é😀 ok".encode()  # 3-, 2- and 4-byte characters, written one byte per token


# -- UTF-8 hold-back and stop sequences (no server) ---------------------------


@pytest.mark.parametrize(
    "data, held",
    [
        (b"abc", 0),
        (b"\xe2\x82", 2),
        (b"\xe2\x82\xac", 0),
        (b"a\xf0\x9f\x98", 3),
        (b"\xf0\x9f\x98\x80", 0),
        (b"\xc3", 1),
        (b"\x80", 0),
        (b"\xff", 0),
        (b"\xe0\x80", 0),  # never valid: shown now, not held
    ],
)
def test_incomplete_utf8_suffix(data, held):
    assert incomplete_utf8_suffix(data) == held


@given(st.binary(max_size=40), st.lists(st.integers(0, 40), max_size=8))
@hsettings(max_examples=300, deadline=None)
def test_chunks_join_to_the_whole_decode(data, cuts):
    """Taking text after every byte (any bytes) gives exactly the text of the whole."""
    text = SampleText()
    pieces = []
    for byte in data:
        text.push(byte, None)
        pieces.append(text.take().text)
    pieces.append(text.take(final=True).text)
    assert "".join(pieces) == data.decode("utf-8", errors="replace")


@given(st.text(max_size=20))
@hsettings(max_examples=200, deadline=None)
def test_valid_utf8_never_shows_a_split_character(s):
    text = SampleText()
    for byte in s.encode():
        text.push(byte, None)
        assert "\ufffd" not in text.take().text
    assert text.take(final=True).text == "" and text.chars_sent == len(s)


def test_char_offsets_point_at_the_character_of_each_byte():
    assert char_offsets("a€b".encode()) == [0, 1, 1, 1, 2]
    assert char_offsets(b"xy", start=5) == [5, 6]


def test_a_byte_token_is_shown_in_openai_bytes_form():
    shown = byte_vocabulary().shown
    assert shown[ord("a")] == "a"
    assert shown[0xE2] == "bytes:\\xe2"


def test_stop_sequence_is_cut_and_its_prefix_held_back():
    text, stopping = SampleText(stops=[b"END"]), StoppingCriteria((b"END",), max_new_tokens=10)
    for byte in b"abE":
        text.push(byte, -1.0)
        assert stopping.push(byte) is None
    assert text.take().text == "ab"  # "E" may start "END": held
    text.push(ord("N"), -1.0)
    assert stopping.push(ord("N")) is None
    assert text.take().text == ""
    text.push(ord("D"), -1.0)
    assert stopping.push(ord("D")) == "stop" and stopping.matched == b"END"
    text.end(stopping.matched)
    chunk = text.take()
    assert chunk.text == "" and text.stopped
    assert text.data == bytearray(b"ab")


def test_false_stop_prefix_is_released():
    text = SampleText(stops=[b"END"])
    for byte in b"aEx":
        text.push(byte, None)
    assert text.take().text == "aEx"
    assert longest_stop_prefix(b"xxEN", [b"END"]) == 2


def test_stop_is_only_searched_in_generated_bytes():
    text, stopping = SampleText(stops=[b"b"], prefix=b"ab"), StoppingCriteria((b"b",), max_new_tokens=5)
    text.push(ord("c"), None)
    assert stopping.push(ord("c")) is None  # the prompt's "b" is not looked at
    assert text.take(final=True).text == "abc"


def test_incremental_decoder_agrees_on_pending_bytes():
    """incomplete_utf8_suffix is exactly what Python's decoder keeps pending."""
    for data in (b"\xf0\x9f", b"ab\xe2", b"\xc3\xa9\xe2\x82"):
        decoder = codecs.getincrementaldecoder("utf-8")()
        decoder.decode(data)
        assert incomplete_utf8_suffix(data) == len(decoder.getstate()[0])


def piece_vocabulary(pieces: list[bytes]) -> Vocabulary:
    """A tokenizer-like vocabulary whose tokens add these bytes (a token may end inside a character)."""
    return Vocabulary("test", tuple(pieces), tuple(map(shown_bytes, pieces)), tokenizer_json="{}")


PIECES = st.lists(st.binary(min_size=0, max_size=4), min_size=2, max_size=12)


@given(PIECES, st.data())
@hsettings(max_examples=300, deadline=None)
def test_multi_byte_tokens_chunk_into_the_whole_decode_with_whole_tokens(pieces, data):
    """Tokens of several bytes: the chunks join to the whole text, every token is shown once, in order, and a
    chunk never shows a character split between tokens."""
    vocabulary = piece_vocabulary(pieces)
    tokens = data.draw(st.lists(st.integers(0, len(pieces) - 1), max_size=30))
    text, chunks = SampleText(vocabulary=vocabulary), []
    for token in tokens:
        text.push(token, -1.0)
        chunks.append(text.take())
    chunks.append(text.take(final=True))
    whole = b"".join(pieces[t] for t in tokens)
    assert "".join(c.text for c in chunks) == whole.decode("utf-8", errors="replace")
    assert [t for c in chunks for t in c.tokens] == tokens
    for chunk in chunks[:-1]:  # each non-final chunk is the exact bytes of its tokens, ending on a whole character
        assert chunk.text.encode("utf-8", errors="surrogatepass") == b"".join(pieces[t] for t in chunk.tokens) or (
            "\ufffd" in chunk.text
        )


@given(PIECES, st.binary(min_size=1, max_size=3), st.data())
@hsettings(max_examples=300, deadline=None)
def test_a_stop_inside_a_token_ends_the_text_where_it_begins_and_never_shows(pieces, stop, data):
    vocabulary = piece_vocabulary(pieces)
    tokens = data.draw(st.lists(st.integers(0, len(pieces) - 1), max_size=30))
    text = SampleText(stops=[stop], vocabulary=vocabulary)
    stopping = StoppingCriteria((stop,), max_new_tokens=1000, pieces=vocabulary.pieces)
    shown, reason = b"", None
    for token in tokens:
        text.push(token, -1.0)
        reason = stopping.push(token)
        if reason is not None:
            text.end(stopping.matched)
        shown += text.take(final=reason is not None).text.encode("utf-8", errors="replace")
        if reason is not None:
            break
    if reason is None:  # the tokens ran out: the sample ends by length
        shown += text.take(final=True).text.encode("utf-8", errors="replace")
    generated = b"".join(pieces[t] for t in tokens[: stopping.generated])
    assert (reason == "stop") == (stop in generated)
    if reason == "stop":
        assert stopping.matched == stop and bytes(text.data) == generated[: generated.index(stop)]
    assert stop not in bytes(text.data) and shown == bytes(text.data).decode("utf-8", errors="replace").encode(
        "utf-8", errors="replace"
    )


def test_an_end_of_text_token_ends_the_sample_and_adds_no_text():
    vocabulary = Vocabulary("test", (b"ab", b"", b"c"), ("ab", "<end>", "c"), eos=1, tokenizer_json="{}")
    stopping = StoppingCriteria((), max_new_tokens=10, pieces=vocabulary.pieces, eos=vocabulary.eos)
    assert stopping.push_run([0, 2, 1, 0]) == ("stop", 3)
    text = SampleText(vocabulary=vocabulary)
    for token in (0, 2, 1):
        text.push(token, -0.5)
    chunk = text.take(final=True)
    assert (chunk.text, chunk.tokens, chunk.offsets) == ("abc", [0, 2, 1], [0, 2, 3])


# -- over HTTP ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_weights")
    for kind in KINDS:
        save_tiny_model(folder, f"{kind}-text", kind, "text", seed=1)
    save_tiny_model(folder, "linear-mnist", "linear", "mnist")
    save_script_model(folder, "script", SCRIPT)
    with running_server(make_settings(weights=folder, max_batch=8, max_waiting=8)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def complete(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_shape_and_usage(server):
    out = complete(server, model="linear-text", prompt="Hello", max_tokens=6, n=2, seed=3)
    assert out["object"] == "text_completion" and out["model"] == "linear-text" and out["id"].startswith("cmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in out["choices"])
    usage = {**out["usage"]}
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert cached in (0, 5)  # the whole prompt, if an earlier test asked it (its n samples share one prefill)


def test_seed_fixes_samples_and_sample_i_uses_seed_plus_i(server):
    body = dict(model="softmax-text", prompt="ab", max_tokens=8, logprobs=0)
    pair = complete(server, **body, n=2, seed=40)["choices"]
    again = complete(server, **body, n=1, seed=40)["choices"]
    next_seed = complete(server, **body, n=1, seed=41)["choices"]
    assert pair[0]["logprobs"]["tokens"] == again[0]["logprobs"]["tokens"]
    assert pair[1]["logprobs"]["tokens"] == next_seed[0]["logprobs"]["tokens"]
    assert pair[0]["logprobs"]["tokens"] != pair[1]["logprobs"]["tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_requests_that_arrive_together_get_what_they_get_alone(server, kind):
    """Requests queued together join the batch together (prompts of one length share one
    prefill forward, further samples copy their row): each still gets its solo answer."""
    bodies = [
        dict(model=f"{kind}-text", prompt=prompt, max_tokens=12, n=n, seed=seed, logprobs=0)
        for prompt, n, seed in [("abc", 1, 1), ("xyz", 2, 2), ("abc", 1, 3), ("hello", 1, 4), ("world", 1, 5)]
    ]
    alone = [complete(server, **body)["choices"] for body in bodies]
    barrier = threading.Barrier(len(bodies))

    def together(body):
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            barrier.wait()
            return complete(client, **body)["choices"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        concurrent = list(pool.map(together, bodies))
    for solo, joint in zip(alone, concurrent):
        assert [c["logprobs"]["tokens"] for c in joint] == [c["logprobs"]["tokens"] for c in solo]
        for a, b in zip(solo, joint):
            assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)


def test_stream_framing_and_same_text_as_unstreamed(server):
    body = dict(model="linear-text", prompt="Hi", max_tokens=10, seed=7, n=2)
    whole = complete(server, **body)
    response = server.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.text)
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("kind", KINDS)
def test_generated_logprobs_match_echo_scoring(server, kind):
    """RNN-mode decoding and one parallel forward pass give the same log-probabilities."""
    prompt = list(b"The cat")
    gen = complete(server, model=f"{kind}-text", prompt=prompt, max_tokens=24, logprobs=1, seed=5, temperature=1.0)
    lp = gen["choices"][0]["logprobs"]
    generated = token_bytes(lp["tokens"])
    assert len(generated) == 24
    scored = complete(server, model=f"{kind}-text", prompt=prompt + generated, max_tokens=0, echo=True, logprobs=1)
    choice = scored["choices"][0]
    assert token_bytes(choice["logprobs"]["tokens"]) == prompt + generated
    assert choice["logprobs"]["token_logprobs"][len(prompt) :] == pytest.approx(lp["token_logprobs"], abs=1e-3)
    assert scored["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"


def test_echo_without_logprobs_returns_the_prompt(server):
    out = complete(server, model="linear-text", prompt="héllo", max_tokens=0, echo=True)
    assert out["choices"][0]["text"] == "héllo" and out["choices"][0]["logprobs"] is None


def test_echo_with_generation_prefixes_the_prompt(server):
    out = complete(server, model="script", prompt="> ", max_tokens=3, echo=True, logprobs=1, temperature=0)
    choice = out["choices"][0]
    assert choice["text"] == "> €"
    assert choice["logprobs"]["tokens"] == [">", " ", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 2, 2]
    assert all(lp > -1e-3 for lp in choice["logprobs"]["token_logprobs"][2:])  # the script is certain


def test_stream_never_splits_a_utf8_character(server):
    response = server.post(
        "/v1/completions",
        json=dict(model="script", prompt="> ", max_tokens=len(SCRIPT) - 2, stream=True, logprobs=0, seed=1),
    )
    chunks = [c["choices"][0] for c in sse_payloads(response.text)]
    texts = [c["text"] for c in chunks]
    assert "".join(texts) == SCRIPT.decode()[2:]
    assert all("\ufffd" not in t for t in texts)
    assert "😀" in texts  # four tokens, one chunk
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert bytes(token_bytes(tokens)) == SCRIPT[2:]


def test_stop_sequence_ends_the_sample_without_it(server):
    out = complete(server, model="script", prompt="> ", max_tokens=10, stop=["é", "zz"], temperature=0)
    assert out["choices"][0]["text"] == "€" and out["choices"][0]["finish_reason"] == "stop"
    response = server.post(
        "/v1/completions", json=dict(model="script", prompt="> ", max_tokens=10, stop="😀", stream=True, temperature=0)
    )
    chunks = [c["choices"][0] for c in sse_payloads(response.text)]
    assert "".join(c["text"] for c in chunks) == "€é" and chunks[-1]["finish_reason"] == "stop"


def test_empty_prompt(server):
    out = complete(server, model="linear-text", prompt="", max_tokens=3, seed=1)
    assert out["model"] == "linear-text" and out["usage"]["completion_tokens"] == 3
    assert out["usage"]["prompt_tokens"] == 0


@pytest.mark.parametrize("named", [{}, {"model": ""}])
def test_a_missing_model_with_several_loaded_is_refused_listing_them(server, named):
    response = server.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **named})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "model" and error["code"] == "model_required"
    assert all(f"{kind}-text" in error["message"] for kind in KINDS)


def test_max_tokens_zero_without_echo_is_empty(server):
    out = complete(server, model="linear-text", prompt="x", max_tokens=0)
    assert out["choices"][0]["text"] == "" and out["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        (dict(prompt="a" * 60, max_tokens=10), 400, "max_tokens", ["60", "10", str(TEXT_MAX_LEN)]),
        (dict(prompt="a", max_tokens=-1), 400, "max_tokens", ["greater than or equal to 0"]),
        (dict(prompt="a", n=0), 400, "n", ["greater than or equal to 1"]),
        (dict(prompt="a", n=65), 400, "n", ["less than or equal to 64"]),
        (dict(prompt="a", n=9), 400, "n", ["--max-batch", "8"]),
        (dict(prompt="a", n=9, max_tokens=0), 400, "n", ["--max-batch", "8"]),  # generating nothing: the same limit
        (dict(prompt="a", n=2, best_of=9, max_tokens=0, echo=True), 400, "n", ["--max-batch", "8"]),
        (dict(prompt="a", temperature=-1), 400, "temperature", ["greater than or equal to 0"]),
        (dict(prompt="a", top_p=0), 400, "top_p", ["greater than 0"]),
        (dict(prompt=[1, 300]), 400, "prompt", ["255"]),
        (dict(prompt="a", stop=["a", "b", "c", "d", "e"]), 400, "stop", ["at most 4"]),
        (dict(prompt="a", stop=[""]), 400, "stop", ["must not be empty"]),
        (dict(prompt="a", logprobs=6), 400, "logprobs", ["less than or equal to 5"]),
        (dict(prompt="a", best_of=2, stream=True), 400, "best_of", ["stream"]),
        (dict(prompt="a", suffix="b"), 400, "suffix", ["not supported"]),
        (dict(prompt="a", nonsense=1), 400, "nonsense", ["Extra inputs"]),
    ],
)
def test_bad_requests_say_what_to_fix(server, body, status, param, words):
    response = server.post("/v1/completions", json={"model": "linear-text", **body})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


def test_unknown_and_wrong_task_models(server):
    missing = server.post("/v1/completions", json={"model": "nope", "prompt": "a"})
    assert missing.status_code == 404
    assert "linear-text" in missing.json()["error"]["message"] and missing.json()["error"]["code"] == "model_not_found"
    wrong = server.post("/v1/completions", json={"model": "linear-mnist", "prompt": "a"})
    assert wrong.status_code == 400 and "mnist model" in wrong.json()["error"]["message"]


def test_body_that_is_not_json(server):
    response = server.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16_weights")
    for kind in KINDS:
        save_tiny_model(folder, f"{kind}-text", kind, "text")
    with running_server(make_settings(weights=folder, device="cpu", dtype="bfloat16", max_batch=4)) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_serving_decodes_like_its_parallel_pass(bf16_server, kind):
    """--dtype bfloat16: every kind runs in 16-bit, and RNN-mode decoding still agrees with one
    parallel pass, to bfloat16's precision (8 bits of mantissa) rather than float32's."""
    entry = bf16_server.get(f"/v1/models/{kind}-text").json()
    assert entry["dtype"] == "bfloat16"
    assert entry["cuda_graphs"] is False  # a CPU server never captures graphs
    prompt = list(b"The cat")
    gen = complete(bf16_server, model=f"{kind}-text", prompt=prompt, max_tokens=16, logprobs=1, seed=3)
    lp = gen["choices"][0]["logprobs"]
    generated = token_bytes(lp["tokens"])
    scored = complete(bf16_server, model=f"{kind}-text", prompt=prompt + generated, max_tokens=0, echo=True, logprobs=1)
    parallel = scored["choices"][0]["logprobs"]["token_logprobs"][len(prompt) :]
    assert parallel == pytest.approx(lp["token_logprobs"], abs=0.15)
