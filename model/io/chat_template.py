"""A chat model's template: how a list of messages becomes the text its prompt is tokenized from.

Hugging Face keeps the template beside the tokenizer: `chat_template.jinja` (what recent `save_pretrained`
writes) or the `chat_template` field of `tokenizer_config.json`, whose special tokens (`bos_token`,
`eos_token`) templates write out. `rnnserve import hf` stores all three in the model file (model/io/weights.py's
CHAT_TEMPLATE_KEY), and the server renders the template as transformers' `apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)` does: Jinja2 in its immutable sandbox (a template from the Hub is
untrusted code), blocks trimmed and stripped, and the helpers templates written for transformers call
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML). The rendered text is tokenized
without adding special tokens: the template writes them itself.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # jinja2 is imported when a template is first compiled
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.parser
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_NAME = "default"  # of a tokenizer_config's list of named templates: the one apply_chat_template uses


class ChatTemplateError(ValueError):
    """A template that cannot be read or rendered; the message is the template's own when it raised one."""


@dataclass(frozen=True)
class ChatTemplate:
    template: str  # Jinja2 source
    bos_token: str | None = None  # the special tokens' text, as the template's variables of those names
    eos_token: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ChatTemplate:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"the stored chat template is not valid JSON ({exc})") from exc
        if not isinstance(data, dict) or not isinstance(data.get("template"), str):
            raise ChatTemplateError('the stored chat template is not a JSON object with a "template" string')
        return cls(data["template"], _token_text(data.get("bos_token")), _token_text(data.get("eos_token")))

    def check(self) -> None:
        """Raise ChatTemplateError if the template does not parse."""
        _compiled(self.template)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (dicts of role, content, ...), ending with the assistant's turn opened."""
        template = _compiled(self.template)
        special = (("bos_token", self.bos_token), ("eos_token", self.eos_token))
        variables = {name: value for name, value in special if value is not None}  # as unset in transformers
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        try:
            return template.render(
                messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as exc:  # whatever a template's code does wrong (raise_exception, a bad index, a type)
            raise ChatTemplateError(_error_text(exc)) from exc


def read_hf_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model folder, with its special tokens' text; None if it has none.
    chat_template.jinja wins over tokenizer_config.json's field, as in transformers' from_pretrained."""
    config = _tokenizer_config(folder)
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    jinja = folder / TEMPLATE_FILE
    template: str | None
    if jinja.is_file():
        template = _read_text(jinja)
    else:
        template = _default_template(config.get("chat_template"), folder / TOKENIZER_CONFIG)
    # Stored as it is, as save_pretrained does: a template that does not parse is reported when rendered.
    return None if template is None else ChatTemplate(template, **special)


def read_template_file(path: Path) -> str:
    """A template file's text (`rnnserve serve --chat-template FILE`)."""
    if not path.is_file():
        raise ChatTemplateError(f"{path}: no such file; expected a Jinja2 chat template")
    return _read_text(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ChatTemplateError(f"{path}: cannot read it ({exc.strerror})") from exc


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{path}: not valid JSON ({exc})") from exc
    return config if isinstance(config, dict) else {}


def _default_template(field: Any, where: Path) -> str | None:
    """tokenizer_config's chat_template: one template, or a list of {name, template} of which "default" is used."""
    if field is None or isinstance(field, str):
        return field
    if isinstance(field, list) and all(isinstance(t, dict) for t in field):
        named = {t.get("name"): t.get("template") for t in field}
        default = named.get(DEFAULT_NAME)
        if isinstance(default, str):
            return default
        names = ", ".join(str(name) for name in named)
        raise ChatTemplateError(
            f"{where}: chat_template lists templates named {names} but none named '{DEFAULT_NAME}'; "
            f"write the one to use to {TEMPLATE_FILE} in the folder"
        )
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: its text, or an AddedToken object with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _error_text(exc: Exception) -> str:
    import jinja2

    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error on line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.TemplateError):
        return str(exc.message or type(exc).__name__)
    return f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """The template compiled once per distinct source, in an environment of its own."""
    try:
        return _environment().from_string(template)
    except Exception as exc:  # a syntax error, or a tag no extension knows
        raise ChatTemplateError(_error_text(exc)) from exc


def _environment() -> ImmutableSandboxedEnvironment:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_namespace_class())
    return env


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as the template wrote it: Jinja's own filter escapes <, >, & and ' for HTML, which a prompt is not."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _namespace_class() -> type[jinja2.utils.Namespace]:
    """Jinja's namespace, refusing names that start with an underscore: a template could otherwise store
    attributes the sandbox keeps it from reading."""
    import jinja2.utils

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template's namespace cannot hold {name!r}")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


@functools.cache
def _generation_extension() -> type[jinja2.ext.Extension]:
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens for training) renders
    its body: transformers knows the tag, so templates use it, and it must parse here too."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    return Generation
