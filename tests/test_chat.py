"""POST /v1/chat/completions on a real server process, spoken to with the OpenAI client: an imported GPT-2 whose
folder held a chat template chats as Hugging Face's generate does after apply_chat_template; streamed chunks
join to the whole answer; log-probabilities come in the chat shape; every refusal is a 400 that says why and
leaves the server serving; a byte model chats with a template given at start-up (--chat-template), whose
problems stop start-up with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face reference (make test installs it)")
openai = pytest.importorskip("openai", reason="the OpenAI client (make test installs it)")

from hf_support import END_OF_TEXT, UNICODE, save_gpt2_folder  # noqa: E402  (after the skip)
from server_support import TEXT_MAX_LEN, free_port, make_settings, save_tiny_model, serving_process, sse_payloads  # noqa: E402

from model.io.chat_template import ChatTemplate  # noqa: E402
from model.io.weights import read_chat_template  # noqa: E402
from rnnserve_cli import main  # noqa: E402

MODEL = "gpt2-chat"
BYTES = "bytes-text"
FIRST_TURN = "Conversations must start with a user or system message"
# The start token before each turn (a special token the template writes as text), and a check that raises
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('" + FIRST_TURN + "') }}{% endif %}"
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }}\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)
BYTE_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": UNICODE},
]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A GPT-2 folder as save_pretrained writes it, with a chat template (chat_template.jinja)."""
    folder = save_gpt2_folder(tmp_path_factory.mktemp("gpt2-chat"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def weights(chat_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat-weights")
    assert main(["import", "hf", str(chat_folder), "--out", str(folder / f"{MODEL}.safetensors")]) == 0
    save_tiny_model(folder, BYTES, "linear", "text", seed=1)  # no template: it cannot chat
    return folder


@pytest.fixture(scope="module")
def hf(chat_folder):
    model = transformers.GPT2LMHeadModel.from_pretrained(chat_folder).eval()
    return model, transformers.AutoTokenizer.from_pretrained(chat_folder)


@pytest.fixture(scope="module")
def server(weights):
    with serving_process(weights, "--max-batch", "8") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, messages=CHAT, model=MODEL, **options):
    options.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=model, messages=messages, **options)


def test_the_import_stores_the_template_and_the_special_tokens_text(weights):
    stored = ChatTemplate.from_json(read_chat_template(weights / f"{MODEL}.safetensors"))
    assert stored == ChatTemplate(TEMPLATE, END_OF_TEXT, END_OF_TEXT)
    assert read_chat_template(weights / f"{BYTES}.safetensors") is None


def test_a_template_given_at_start_up_gets_an_imported_model_s_start_and_end_tokens(tmp_path):
    from server.engine.registry import checked_chat_templates, checked_vocabularies

    out = tmp_path / "plain.safetensors"
    assert main(["import", "hf", str(save_gpt2_folder(tmp_path / "plain")), "--out", str(out)]) == 0
    assert read_chat_template(out) is None  # its folder had no template
    template = tmp_path / "chat.jinja"
    template.write_text(BYTE_TEMPLATE, encoding="utf-8")
    settings = make_settings(models=[out], chat_template=template)
    templates = checked_chat_templates(settings, checked_vocabularies(settings))
    assert templates == {out: ChatTemplate(BYTE_TEMPLATE, END_OF_TEXT, END_OF_TEXT)}  # the names of its tokens


def test_models_say_which_can_chat(server):
    models = {m["id"]: m for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert (models[MODEL]["chat_template"], models[BYTES]["chat_template"]) == (True, False)


def test_greedy_chat_is_hugging_face_s_generate_after_apply_chat_template(client, hf):
    model, tokenizer = hf
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    prompt = ids["input_ids"]
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    out = model.generate(
        prompt, max_new_tokens=16, do_sample=False, pad_token_id=end, output_scores=True, return_dict_in_generate=True
    )
    expected = out.sequences[0, prompt.shape[1] :].tolist()
    answer = chat(client, temperature=0, logprobs=True)
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage.prompt_tokens == prompt.shape[1] and answer.usage.completion_tokens == len(expected)
    assert choice.finish_reason == ("stop" if expected[-1] == end else "length")
    theirs = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, expected)]
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(theirs, abs=1e-3)


def test_logprobs_come_in_the_chat_shape(client):
    answer = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert (tops[0].token, tops[0].logprob) == (entry.token, pytest.approx(entry.logprob))  # greedy: the likeliest
    pieces = b"".join(bytes(e.bytes or []) for e in content)  # the end token adds no bytes
    assert pieces.decode("utf-8", errors="replace") == answer.choices[0].message.content
    assert chat(client, temperature=0).choices[0].logprobs is None


def counts(usage) -> tuple[int, int, int]:
    """The usage's token counts (what the prefix cache held of the prompt differs between a request and its
    repeat)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_streamed_chunks_join_to_the_whole_answer(client):
    options = dict(n=2, seed=11, temperature=1.0, max_tokens=24)
    whole = chat(client, **options)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **options))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    for choice in whole.choices:
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
        assert [d.finish_reason for d in deltas][-1] == choice.finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    # the same prompt again: the prefix cache held all of it
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens


def test_a_stop_sequence_ends_the_message_before_it(client, hf):
    _, tokenizer = hf
    words = {  # the random model's own choice is mostly single bytes that are no text: favour whole words
        str(t): 30 for t in range(len(tokenizer)) if len(tokenizer.decode([t])) > 1 and "�" not in tokenizer.decode([t])
    }
    whole = chat(client, temperature=0, logit_bias=words).choices[0].message.content
    stop = whole[3:5]
    answer = chat(client, temperature=0, logit_bias=words, stop=[stop]).choices[0]
    assert (answer.message.content, answer.finish_reason) == (whole[: whole.index(stop)], "stop")


def test_text_parts_are_joined_and_max_completion_tokens_limits(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "To be,"}, {"type": "text", "text": "or not"}]}]
    joined = [{"role": "user", "content": "To be,\nor not"}]
    as_parts = chat(client, parts, temperature=0, max_tokens=None, max_completion_tokens=5)
    as_text = chat(client, joined, temperature=0, max_tokens=5)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert counts(as_parts.usage) == counts(as_text.usage) and as_parts.usage.completion_tokens <= 5


def post_chat(server, body):
    """The body sent as ASCII JSON, so that it may hold a lone surrogate (escaped)."""
    content = json.dumps({"model": MODEL, "max_tokens": 2, **body})
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server}/v1/chat/completions", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": BYTES, "messages": CHAT}, "model", "has no chat template"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages[0] has the role 'robot'"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0] has no content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "not a text part"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", FIRST_TURN),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs", "at most 5"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"messages": CHAT, "max_tokens": 1000}, "max_tokens", "handles at most 128"),
        ({"messages": [{"role": "user", "content": "x " * 200}], "max_tokens": None}, "prompt", "handles at most 128"),
        ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "disagree"),
        ({"messages": CHAT, "tools": []}, "tools", "tools"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "lone UTF-16 surrogate"),
    ],
)
def test_a_bad_chat_is_a_400_that_says_why_and_the_server_goes_on(server, client, body, param, words):
    answer = post_chat(server, body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param, answer.text
    assert words in error["message"]
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_the_no_template_answer_says_how_to_give_one(server):
    message = post_chat(server, {"model": BYTES, "messages": CHAT}).json()["error"]["message"]
    assert "--chat-template FILE" in message and "POST /v1/completions" in message


@pytest.fixture(scope="module")
def byte_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-chat")
    save_tiny_model(folder, BYTES, "softmax", "text", seed=2)
    template = folder / "chat.jinja"
    template.write_text(BYTE_TEMPLATE, encoding="utf-8")
    with serving_process(folder, "--chat-template", str(template)) as url:
        yield url


def test_a_byte_model_chats_with_the_template_given_at_start_up_and_fills_its_context_by_default(byte_server):
    models = httpx.get(f"{byte_server}/v1/models").json()["data"]
    assert [m["chat_template"] for m in models] == [True]
    client = openai.OpenAI(base_url=f"{byte_server}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Grüße"}]
    answer = client.chat.completions.create(model=BYTES, messages=messages, max_tokens=12, temperature=0)
    rendered = "user: Grüße\nassistant:"  # BYTE_TEMPLATE's text for this chat
    assert answer.usage.prompt_tokens == len(rendered.encode("utf-8"))
    completion = client.completions.create(model=BYTES, prompt=rendered, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == completion.choices[0].text
    assert counts(answer.usage) == counts(completion.usage)
    unbounded = client.chat.completions.create(model=BYTES, messages=messages, temperature=0)  # no max_tokens
    assert unbounded.usage.total_tokens == TEXT_MAX_LEN and unbounded.choices[0].finish_reason == "length"


def test_a_chat_stream_is_server_sent_events_ending_with_done(byte_server):
    body = {"model": BYTES, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    payloads = sse_payloads(httpx.post(f"{byte_server}/v1/chat/completions", json=body, timeout=60).text)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def run_to_exit(args: list[str], folder: Path) -> tuple[int, str]:
    """`rnnserve serve ARGS` run until it exits: its status and what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    script = Path(sys.executable).parent / "rnnserve"
    run = subprocess.run([str(script), "serve", *args], capture_output=True, text=True, env=env, timeout=120)
    return run.returncode, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "no such file"),
        (b"\xff\xfe{{ messages }}", "not UTF-8 text"),
        (b"{% for m in messages %}", "syntax error on line 1"),
    ],
)
def test_a_template_file_that_cannot_be_used_stops_start_up_with_one_line(tmp_path, content, words):
    save_tiny_model(tmp_path, BYTES, "linear", "text")
    template = tmp_path / "chat.jinja"
    if content is not None:
        template.write_bytes(content)
    code, out = run_to_exit(
        ["--weights", str(tmp_path), "--port", str(free_port()), "--chat-template", str(template)], tmp_path
    )
    errors = [line for line in out.splitlines() if line.startswith("rnnserve serve: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert f"--chat-template {template}: {words}" in errors[0]


def test_the_openapi_document_describes_the_chat_route(server):
    document = httpx.get(f"{server}/openapi.json").json()
    operation = document["paths"]["/v1/chat/completions"]["post"]
    assert "text/event-stream" in operation["responses"]["200"]["content"] and "422" not in operation["responses"]
    request = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "top_logprobs", "stream_options", "logit_bias"} <= set(request)
