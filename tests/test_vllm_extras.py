"""vLLM's common extras: its sampling fields (against Hugging Face's logits processors and `generate`, and through
a real server on an imported GPT-2 whose end-of-text token logit_bias can force), and /tokenize's fields."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)

from hf_support import END_OF_TEXT, UNICODE, gpt2_folder, imported, save_gpt2_folder  # noqa: E402  (after the skip)
from server_support import TEXT_MAX_LEN, make_settings, running_server, save_tiny_model, sse_payloads  # noqa: E402

from conftest import make_tiny_model  # noqa: E402
from rnnserve_cli import main  # noqa: E402
from server.engine.core import Engine, EngineLimits  # noqa: E402
from server.engine.output import LocalOutput  # noqa: E402
from server.engine.types import GenerationRequest  # noqa: E402
from server.metrics import Metrics  # noqa: E402
from server.engine.registry import served_names  # noqa: E402
from server.engine.slot_budget import slot_bytes  # noqa: E402
from server.settings import SettingsError, build_settings, parse_bytes  # noqa: E402

from model.io.vocabulary import vocabulary_for  # noqa: E402
from model.io.weights import load_model, read_metadata, read_tokenizer  # noqa: E402
from model.decode.sampling import (  # noqa: E402
    BatchSampling,
    SamplingParams,
    filtered_logits,
    min_p_mask,
    repetition_penalized,
    suppressed_until,
    top_k_mask,
)

__all__ = ["gpt2_folder", "imported"]
MODEL = "gpt2-tiny"
VOCAB = 300


def random_logits(seed: int, rows: int = 6) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


# -- the pure functions, row by row against Hugging Face's processors ------------------------------------------


def test_the_repetition_penalty_is_hugging_face_s_row_by_row():
    logits = random_logits(0)
    generator = torch.Generator().manual_seed(1)
    seen_ids = [torch.randint(0, VOCAB, (20,), generator=generator) for _ in range(len(logits))]
    seen = torch.zeros(len(logits), VOCAB, dtype=torch.bool)
    for row, ids in enumerate(seen_ids):
        seen[row, ids] = True
    penalties = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.05, 5.0])
    ours = repetition_penalized(logits, seen, penalties)
    for row, ids in enumerate(seen_ids):
        processor = transformers.RepetitionPenaltyLogitsProcessor(float(penalties[row]))
        theirs = processor(ids[None], logits[row : row + 1].clone())
        assert torch.allclose(ours[row], theirs[0]), row
    assert torch.equal(ours[0], logits[0])  # a penalty of 1 changes nothing
    assert not torch.equal(ours[1], logits[1])


def test_min_p_is_hugging_face_s_row_by_row():
    logits = random_logits(2)
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.5, 0.9, 1.0])
    ours = min_p_mask(logits, min_p)
    for row in range(1, len(logits)):  # Hugging Face's warper takes min_p in (0, 1]
        theirs = transformers.MinPLogitsWarper(float(min_p[row]))(None, logits[row : row + 1].clone())
        assert torch.equal(ours[row].isinf(), theirs[0].isinf()), row
        kept = ~ours[row].isinf()
        assert torch.equal(ours[row][kept], logits[row][kept])
    assert not ours[0].isinf().any() and (~ours[5].isinf()).sum() == 1  # 0 keeps all, 1 the best alone


def test_top_k_is_hugging_face_s_row_by_row_and_minus_one_is_off():
    logits = random_logits(3)
    top_k = torch.tensor([0, 1, 5, 40, VOCAB, 1000])
    ours = top_k_mask(logits, top_k)
    for row in range(1, len(logits)):
        theirs = transformers.TopKLogitsWarper(int(top_k[row]))(None, logits[row : row + 1].clone())
        assert torch.equal(ours[row].isinf(), theirs[0].isinf()), row
    params = [SamplingParams(top_k=0), SamplingParams(min_p=0.2), SamplingParams(top_k=3, min_p=0.01)]
    filtered = filtered_logits(logits[:3], BatchSampling.from_params(params))
    assert not filtered[0].isinf().any()
    assert torch.equal(filtered[1].isinf(), min_p_mask(logits[1:2], torch.tensor([0.2]))[0].isinf())
    assert (~filtered[2].isinf()).sum() == 3


def test_min_tokens_holds_the_ending_tokens_back_until_its_position():
    logits = random_logits(4, rows=3)
    ends = torch.zeros(3, VOCAB, dtype=torch.bool)
    ends[:, [7, 9]] = True
    held = suppressed_until(logits, ends, torch.tensor([5, 8, 9]), torch.tensor([8, 8, 12]))
    assert held[0, [7, 9]].isinf().all() and held[2, [7, 9]].isinf().all()
    assert torch.equal(held[1], logits[1])  # at its `until`: free
    assert torch.equal(held[0, :7], logits[0, :7])


# -- through a server -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(imported):
    with running_server(make_settings(weights=imported.parent, max_batch=8)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def hf(gpt2_folder):
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    return model, transformers.AutoTokenizer.from_pretrained(gpt2_folder)


def complete(server: str, **body) -> httpx.Response:
    return httpx.post(f"{server}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def choice(server: str, **body) -> tuple[dict, dict]:
    answer = complete(server, **body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0], answer.json()["usage"]


def end_token(hf) -> int:
    return hf[1].convert_tokens_to_ids(END_OF_TEXT)


def a_word_token(hf) -> int:
    """A token of several plain characters (not special)."""
    tokenizer = hf[1]
    return next(t for t in range(len(tokenizer) - 1, 255, -1) if tokenizer.decode([t]).strip().isalpha())


def test_the_repetition_penalty_gives_hugging_face_s_greedy_tokens(server, hf, imported):
    model, tokenizer = hf
    shown = vocabulary_for(read_metadata(imported)[0], read_tokenizer(imported)).shown  # how logprobs name ids
    for prompt in ("To be, or not to be", UNICODE):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=end_token(hf),
        )
        expected = [shown[t] for t in out[0, ids.shape[1] :].tolist()]
        got, _ = choice(server, prompt=prompt, max_tokens=24, repetition_penalty=1.3, logprobs=0)
        assert got["logprobs"]["tokens"] == expected
        plain, _ = choice(server, prompt=prompt, max_tokens=24, logprobs=0)
        assert plain["logprobs"]["tokens"] != expected  # the penalty changed something


def test_min_tokens_holds_back_the_end_token_that_logit_bias_forces(server, hf):
    bias = {str(end_token(hf)): 100}
    at_once, usage = choice(server, prompt="x", max_tokens=8, logit_bias=bias)
    assert (at_once["finish_reason"], usage["completion_tokens"]) == ("stop", 1)
    held, usage = choice(server, prompt="x", max_tokens=8, logit_bias=bias, min_tokens=3)
    assert (held["finish_reason"], usage["completion_tokens"]) == ("stop", 4)
    held_stream = complete(server, prompt="x", max_tokens=8, logit_bias=bias, min_tokens=3, stream=True)
    assert held_stream.text.count('"finish_reason":"stop"') == 1


def test_ignore_eos_generates_past_the_end_token_and_skip_special_tokens_shows_it(server, hf):
    bias = {str(end_token(hf)): 100}
    ignored, usage = choice(server, prompt="x", max_tokens=5, logit_bias=bias, ignore_eos=True)
    assert (ignored["text"], ignored["finish_reason"], usage["completion_tokens"]) == ("", "length", 5)
    shown, _ = choice(server, prompt="x", max_tokens=5, logit_bias=bias, ignore_eos=True, skip_special_tokens=False)
    assert shown["text"] == END_OF_TEXT * 5


def test_stop_token_ids_end_a_sample_and_include_stop_str_in_output_keeps_them(server, hf):
    word = a_word_token(hf)
    text = hf[1].decode([word])
    bias = {str(word): 100}
    unstopped, _ = choice(server, prompt="x", max_tokens=3, logit_bias=bias)
    assert (unstopped["text"], unstopped["finish_reason"]) == (text * 3, "length")
    stopped, usage = choice(server, prompt="x", max_tokens=3, logit_bias=bias, stop_token_ids=[word])
    assert (stopped["text"], stopped["finish_reason"], usage["completion_tokens"]) == ("", "stop", 1)
    kept, _ = choice(
        server, prompt="x", max_tokens=3, logit_bias=bias, stop_token_ids=[word], include_stop_str_in_output=True
    )
    assert (kept["text"], kept["finish_reason"]) == (text, "stop")
    late, usage = choice(server, prompt="x", max_tokens=3, logit_bias={str(word): 100}, min_tokens=2, stop=[text])
    assert (late["text"], usage["completion_tokens"]) == (text, 2)  # the stop string ends it at min_tokens, not before
    by_string, _ = choice(
        server, prompt="x", max_tokens=3, logit_bias=bias, stop=[text], include_stop_str_in_output=True
    )
    assert by_string["text"] == text
    for extra in ({"stop": [text]}, {"stop_token_ids": [word]}):  # streamed, the same text
        body = {"prompt": "x", "max_tokens": 3, "logit_bias": bias, "include_stop_str_in_output": True, **extra}
        chunks = sse_payloads(complete(server, stream=True, **body).text)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


def test_min_p_one_leaves_the_most_likely_token_alone(server):
    greedy, _ = choice(server, prompt=UNICODE, max_tokens=12)
    sampled, _ = choice(server, prompt=UNICODE, max_tokens=12, temperature=1.0, seed=3, min_p=1.0, n=2)
    assert sampled["text"] == greedy["text"]
    free, _ = choice(server, prompt=UNICODE, max_tokens=12, temperature=1.0, seed=3, top_k=-1)
    assert free["text"] != greedy["text"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_extras_are_refused_naming_the_field(server, body, param):
    answer = complete(server, prompt="x", **{"max_tokens": 2, **body})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert choice(server, prompt="x", max_tokens=1)[1]["completion_tokens"] == 1


# -- /tokenize and /detokenize ------------------------------------------------------------------------------------


def test_tokenize_answers_vllm_s_fields(server, hf, imported):
    tokenizer = hf[1]
    plain = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": UNICODE}).json()
    assert plain == {
        "count": len(tokenizer(UNICODE).input_ids),
        "max_model_len": 128,
        "tokens": tokenizer(UNICODE).input_ids,
        "token_strs": None,
    }
    strs = httpx.post(f"{server}/tokenize", json={"prompt": UNICODE, "return_token_strs": True}).json()["token_strs"]
    shown = vocabulary_for(read_metadata(imported)[0], read_tokenizer(imported)).shown  # as logprobs name them
    assert strs == [shown[t] for t in plain["tokens"]]
    written = httpx.post(f"{server}/tokenize", json={"prompt": "a" + END_OF_TEXT, "add_special_tokens": False}).json()
    assert written["tokens"][-1] == end_token(hf)  # a special token written in the text is read as one
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": UNICODE}


def test_add_special_tokens_says_whether_the_tokenizer_s_start_token_comes_first(tmp_path):
    folder = save_gpt2_folder(tmp_path / "hf", start_token=True)
    served = tmp_path / "served"
    assert main(["import", "hf", str(folder), "--out", str(served / "starts.safetensors")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with running_server(make_settings(weights=served, engine_process=False, max_batch=2)) as (url, _):
        for add in (True, False):
            body = {"prompt": "To be", "add_special_tokens": add, "return_token_strs": True}
            answer = httpx.post(f"{url}/tokenize", json=body).json()
            assert answer["tokens"] == tokenizer("To be", add_special_tokens=add).input_ids
            assert (answer["token_strs"][0] == END_OF_TEXT) == add
        assert answer["tokens"] != httpx.post(f"{url}/tokenize", json={"prompt": "To be"}).json()["tokens"]


# -- the server's flags: --served-model-name, --max-model-len, a decode memory budget --------------------------


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    save_tiny_model(folder, "softy", "softmax", "text")  # a context of TEXT_MAX_LEN tokens
    save_tiny_model(folder, "lin", "linear", "text", seed=1)
    return folder


def test_served_names_max_model_len_and_the_memory_budget_reach_the_api(two_models):
    budget = 96 * 1024
    settings = make_settings(
        weights=two_models,
        served_model_name=["softy=chatty"],
        max_model_len=32,
        kv_cache_memory=f"{budget // 1024}KiB",
        max_batch=8,
        engine_process=False,
    )
    with running_server(settings) as (url, _):
        cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
        assert set(cards) == {"chatty", "lin"}
        for card in cards.values():
            assert card["max_len"] == card["max_model_len"] == 32 < TEXT_MAX_LEN
            assert card["decode_memory_budget"] == budget // 2
            assert card["decode_slots"] == min(8, budget // 2 // card["decode_slot_bytes"])
        assert cards["chatty"]["decode_slots"] < 8  # the budget, not --max-batch, set a softmax model's slots
        chatty = cards["chatty"]  # its state is the slots' keys and values at 32 positions (and their lengths)
        slots_state = chatty["decode_slots"] * chatty["state_bytes_per_sequence"]
        assert slots_state <= chatty["state_bytes_allocated"] < slots_state + chatty["state_bytes_per_sequence"]
        body = {"model": "chatty", "prompt": "x" * 20, "max_tokens": 20}
        refused = httpx.post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert "at most 32" in refused.json()["error"]["message"]
        fits = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8}).json()
        assert fits["model"] == "chatty" and fits["usage"]["completion_tokens"] == 8
        assert httpx.post(f"{url}/tokenize", json={"model": "chatty", "prompt": "a"}).json()["max_model_len"] == 32
        unknown = httpx.post(f"{url}/v1/completions", json={**body, "model": "softy"})
        assert unknown.status_code == 404


def test_without_a_budget_every_engine_takes_max_batch_slots(two_models):
    with running_server(make_settings(weights=two_models, max_batch=3, engine_process=False)) as (url, _):
        for card in httpx.get(f"{url}/v1/models").json()["data"]:
            assert (card["decode_slots"], card["decode_memory_budget"], card["max_len"]) == (3, None, TEXT_MAX_LEN)
            assert card["decode_slot_bytes"] > card["state_bytes_per_sequence"] > 0


def test_a_budget_that_holds_no_sequence_stops_start_up_saying_what_one_needs(two_models, capsys):
    flags = ["--weights", str(two_models), "--port", "0", "--device", "cpu", "--kv-cache-memory", "4KB"]
    assert main(["serve", *flags]) == 2
    error = capsys.readouterr().err
    assert "one sequence needs" in error and "--kv-cache-memory" in error and "4000 bytes" not in error
    assert "share of the decode memory budget is 2000 bytes" in error


@pytest.mark.parametrize(
    "names, words",
    [
        (["solo"], "name each as STEM=NAME"),
        (["nope=x"], "no model file is named 'nope'"),
        (["softy=lin"], "both be served as 'lin'"),
        (["softy="], "the name is empty"),
    ],
)
def test_served_model_names_that_cannot_work_are_refused(two_models, names, words):
    paths = sorted(two_models.glob("*.safetensors"))
    with pytest.raises(SettingsError, match=words):
        served_names(names, paths)
    assert served_names(["lin=b"], paths) == {
        two_models / "lin.safetensors": "b",
        two_models / "softy.safetensors": "softy",
    }


def test_sizes_take_vllm_s_units():
    assert [parse_bytes(v) for v in ("2GiB", "500MB", "1024", "1.5G", "3kib")] == [
        2 * 1024**3,
        500 * 1000**2,
        1024,
        1_500_000_000,
        3072,
    ]
    with pytest.raises(SettingsError, match="a size in bytes"):
        build_settings(kv_cache_memory="lots")
    with pytest.raises(SettingsError, match="not both"):
        build_settings(kv_cache_memory="1G", kv_cache_memory_fraction=0.5)


# -- per row in one batch ---------------------------------------------------------------------------------------


def engine_answers(requests: list[GenerationRequest]) -> list[list[list[int]]]:
    """Each request's samples' tokens from one engine, the requests queued together (admitted in one step)."""
    model = make_tiny_model("softmax", seed=2)
    limits = EngineLimits(max_batch=8, max_waiting=8)
    engine = Engine("tiny", model, {}, limits, LocalOutput.recording(Metrics(), "tiny", model))

    async def run() -> list[list[list[int]]]:
        streams = [engine.submit(r, each_event=False) for r in requests]
        engine.start()
        return [[result.tokens async for result in stream] for stream in streams]

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def test_rows_with_different_extras_draw_in_one_batch_as_each_alone():
    settings = [
        SamplingParams(seed=1),
        SamplingParams(seed=2, repetition_penalty=1.5),
        SamplingParams(seed=3, min_p=0.3),
        SamplingParams(seed=4, min_tokens=5, stop_token_ids=(10, 11), repetition_penalty=0.8),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    requests = [GenerationRequest(f"r{i}", [1, 2, 3, 1, 2], 10, p, n=2) for i, p in enumerate(settings)]
    together = engine_answers(requests)
    for request, got in zip(requests, together):
        assert got == engine_answers([request])[0], request.sampling
    assert together[0] != together[1]  # the penalty and the seeds make each its own


def test_a_budget_for_fewer_workers_than_asked_runs_fewer(tmp_path):
    path = save_tiny_model(tmp_path, "softy", "softmax", "text")
    one_slot = slot_bytes(load_model(path)[0])
    settings = make_settings(weights=tmp_path, workers=2, threads=2, kv_cache_memory=one_slot * 3 // 2)
    with running_server(settings) as (url, _):
        card = httpx.get(f"{url}/v1/models/softy").json()
        assert (card["workers"], card["threads"], card["decode_slots"]) == (1, 2, 1)
        assert card["decode_slot_bytes"] == one_slot
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"


def test_a_fraction_of_the_memory_is_a_budget_in_proportion():
    half = build_settings(kv_cache_memory_fraction=0.5).decode_memory_budget("cpu")
    quarter = build_settings(kv_cache_memory_fraction=0.25).decode_memory_budget("cpu")
    assert 0 < quarter < half and abs(half - 2 * quarter) <= 2
    assert build_settings().decode_memory_budget("cpu") is None
