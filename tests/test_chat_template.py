"""Chat templates render exactly as transformers' apply_chat_template renders them, fail with the template's own
message, and are read from a Hugging Face folder as save_pretrained writes it (or as older tokenizer_config.json
files hold it)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers", reason="the reference renderer (make test installs it)")

from hf_support import byte_level_tokenizer  # noqa: E402  (after the skip)

from model.io.chat_template import ChatTemplate, ChatTemplateError, read_hf_chat_template  # noqa: E402

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2's: the system message folded into the first user turn, the start token before each, roles checked
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Zephyr's, written over several lines: only trim_blocks and lstrip_blocks keep its layout out of the prompt
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# tojson (no HTML escaping, its options), a namespace carried out of a loop, loop controls, a generation block
TOOLING = """{% set ns = namespace(last_user=-1) %}
{% for message in messages %}
    {% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{% endfor %}
{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}|{{ ns.last_user }}
{% for message in messages %}
    {% if message.role == 'assistant' %}{% continue %}{% endif %}
    {% generation %}{{ message.content | upper }}{% endgeneration %}
    {% if loop.index0 > 1 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}>{% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "zephyr": ZEPHYR, "tooling": TOOLING}

CHATS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system first": [
        {"role": "system", "content": "You answer in verse. <b>&amp;</b>"},
        {"role": "user", "content": "Grüße, 世界! naïve café 🙂"},
    ],
    "a longer chat": [
        {"role": "user", "content": "  What is 2 + 2?  "},
        {"role": "assistant", "content": "4, \"quoted\" and 'single'"},
        {"role": "user", "content": "And\nthen\n\ttabs?"},
    ],
}
BOS, EOS = "<s>", "</s>"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(300), bos_token=BOS, eos_token=EOS
    )


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_is_transformers_apply_chat_template(tokenizer, template, chat, add_generation_prompt):
    messages = CHATS[chat]
    expected = tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATES[template], add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ours = ChatTemplate(TEMPLATES[template], BOS, EOS).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert ours  # every template writes something for every chat


def test_a_template_without_special_tokens_sees_them_undefined(tokenizer):
    template = "{% if bos_token is defined %}{{ bos_token }}{% else %}none{% endif %}|{{ eos_token }}|"
    assert ChatTemplate(template).render(CHATS["one user turn"]) == "none||"
    assert ChatTemplate(template, BOS, EOS).render(CHATS["one user turn"]) == f"{BOS}|{EOS}|"


def test_raise_exception_fails_with_the_template_s_message(tokenizer):
    jinja2 = pytest.importorskip("jinja2")
    assistant_first = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello"}]
    with pytest.raises(jinja2.TemplateError) as theirs:
        tokenizer.apply_chat_template(assistant_first, chat_template=LLAMA2, tokenize=False)
    with pytest.raises(ChatTemplateError) as ours:
        ChatTemplate(LLAMA2, BOS, EOS).render(assistant_first)
    assert str(ours.value) == str(theirs.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }}", "syntax error on line 1: Unexpected end of template"),
        ("{{ messages[3].content.foo() }}", "list object has no element 3"),
        ("{% set ns = namespace(_secret=1) %}", "a chat template's namespace cannot hold '_secret'"),
        ("{{ messages | tojson(bad=1) }}", "TypeError"),
    ],
)
def test_a_template_that_fails_says_why(template, message):
    chat = ChatTemplate(template)
    with pytest.raises(ChatTemplateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        chat.render(CHATS["one user turn"])


@pytest.mark.parametrize(
    "reach", ["messages.__class__.__mro__", "''.__class__.__base__", "cycler.__init__.__globals__"]
)
def test_the_sandbox_keeps_python_s_internals_out_of_reach(reach):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ " + reach + " }}").render(CHATS["one user turn"])


def test_save_pretrained_s_template_and_special_tokens_are_read_from_the_folder(tokenizer, tmp_path):
    tokenizer.chat_template = ZEPHYR
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()  # what recent save_pretrained writes
    assert read_hf_chat_template(tmp_path) == ChatTemplate(ZEPHYR, BOS, EOS)


def write_config(folder, **fields):
    (folder / "tokenizer_config.json").write_text(json.dumps(fields), encoding="utf-8")


def test_tokenizer_config_s_template_field_and_its_added_token_objects(tmp_path):
    added = {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True}
    write_config(tmp_path, chat_template=CHATML, bos_token=added, eos_token=EOS)
    assert read_hf_chat_template(tmp_path) == ChatTemplate(CHATML, BOS, EOS)


def test_of_named_templates_the_default_is_taken(tmp_path):
    named = [{"name": "tool_use", "template": ZEPHYR}, {"name": "default", "template": CHATML}]
    write_config(tmp_path, chat_template=named)
    assert read_hf_chat_template(tmp_path) == ChatTemplate(CHATML)


def test_named_templates_without_a_default_are_an_error_that_says_what_to_do(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": ZEPHYR}])
    with pytest.raises(ChatTemplateError, match="none named 'default'; write the one to use to chat_template.jinja"):
        read_hf_chat_template(tmp_path)


def test_chat_template_jinja_wins_over_the_config_field_and_a_folder_may_have_none(tmp_path):
    write_config(tmp_path, chat_template=CHATML, eos_token=EOS)
    (tmp_path / "chat_template.jinja").write_text(ZEPHYR, encoding="utf-8")
    assert read_hf_chat_template(tmp_path) == ChatTemplate(ZEPHYR, None, EOS)
    (tmp_path / "chat_template.jinja").unlink()
    write_config(tmp_path, eos_token=EOS)
    assert read_hf_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").unlink()
    assert read_hf_chat_template(tmp_path) is None


def test_stored_as_json_and_read_back():
    chat = ChatTemplate(ZEPHYR, "<|endoftext|>", "🙂")
    assert ChatTemplate.from_json(chat.to_json()) == chat
    with pytest.raises(ChatTemplateError, match='not a JSON object with a "template" string'):
        ChatTemplate.from_json('{"bos_token": "x"}')
