"""Loading the served models and holding their engines: which engine a model name stands for.

A name that stands for none raises a `ModelLookupError`; server/api/ tells the client (404 or 400)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from model.io.chat_template import ChatTemplate, ChatTemplateError
from model.config import BYTE_VOCAB, ModelConfig
from model.transformer import Transformer
from model.io.vocabulary import Vocabulary, byte_vocabulary, vocabulary_for
from model.io.weights import load_model, read_chat_template, read_metadata, read_tokenizer

from server.engine.base import EngineHandle
from server.settings import Settings, SettingsError

log = logging.getLogger("rnnserve.registry")


@dataclass
class LoadedModel:
    name: str  # what requests pass as `model`: the file stem, or its --served-model-name
    path: Path
    model: Transformer
    info: dict[str, Any]
    vocabulary: Vocabulary = field(default_factory=byte_vocabulary)  # a text model's tokens
    chat_template: ChatTemplate | None = None  # how a chat's messages become a text model's prompt


def check_model_files(settings: Settings) -> list[Path]:
    """Resolve the files to serve and read their headers, so a bad file fails fast."""
    vocabularies = checked_vocabularies(settings)
    checked_chat_templates(settings, vocabularies)
    return list(vocabularies)


def checked_chat_templates(settings: Settings, vocabularies: dict[Path, Vocabulary]) -> dict[Path, ChatTemplate]:
    """The chat template of each text model that has one: --chat-template's for all of them when given, else the
    one stored in its file. Raises SettingsError for a --chat-template that cannot be read or does not parse."""
    override = settings.chat_template_text()
    templates = {}
    for path, vocabulary in vocabularies.items():
        config, _ = read_metadata(path)
        if config.task != "text":
            continue
        try:
            stored = read_chat_template(path)
            own = ChatTemplate.from_json(stored) if stored is not None else None
        except ChatTemplateError as exc:
            raise SettingsError(f"{path}: {exc}") from exc
        chosen = own if override is None else with_special_tokens(override, own, config, vocabulary)
        if chosen is not None:
            templates[path] = chosen
    if override is not None:
        check_override(settings, override)
    return templates


def check_override(settings: Settings, template: str) -> None:
    """A template given at start-up that does not parse stops start-up (one a model file holds answers 400)."""
    try:
        ChatTemplate(template).check()
    except ChatTemplateError as exc:
        raise SettingsError(f"--chat-template {settings.chat_template}: {exc}") from exc


def with_special_tokens(
    template: str, own: ChatTemplate | None, config: ModelConfig, vocabulary: Vocabulary
) -> ChatTemplate:
    """`template` with the special tokens' text its model's own template came with, else the names of its
    start and end tokens (GPT-2's <|endoftext|>); a byte model has none."""
    if own is not None:
        return ChatTemplate(template, own.bos_token, own.eos_token)
    if vocabulary.is_bytes:
        return ChatTemplate(template)
    name = {t: vocabulary.shown[t] for t in (config.bos_token, config.eos_token) if 0 <= t < vocabulary.size}
    return ChatTemplate(template, name.get(config.bos_token), name.get(config.eos_token))


def checked_vocabularies(settings: Settings) -> dict[Path, Vocabulary]:
    """Each file to serve with its vocabulary, read from its header once; raises SettingsError for a bad file."""
    vocabularies: dict[Path, Vocabulary] = {}
    names: dict[str, Path] = {}
    for path in settings.model_paths():
        config, _ = read_metadata(path)  # raises WeightsError naming the file and the problem
        tokenizer = read_tokenizer(path)
        try:
            vocabularies[path] = vocabulary_for(config, tokenizer)
        except ValueError as exc:  # a stored tokenizer that cannot be served
            raise SettingsError(f"{path}: {exc}") from exc
        if config.task == "text" and config.vocab_size != BYTE_VOCAB and tokenizer is None:
            raise SettingsError(
                f"{path}: a text model with a {config.vocab_size}-token vocabulary but no tokenizer in the file; "
                f"expected a byte model ({BYTE_VOCAB} tokens) or one imported with its tokenizer (rnnserve import hf)"
            )
        if path.stem in names:
            raise SettingsError(
                f"two model files are both named '{path.stem}': {names[path.stem]} and {path}; "
                "model names come from file names, so rename one (or give it a --served-model-name STEM=NAME)"
            )
        names[path.stem] = path
    served_names(settings.served_model_name, list(vocabularies))
    return vocabularies


def served_names(given: list[str], paths: list[Path]) -> dict[Path, str]:
    """The name each file is served under (--served-model-name, vLLM's flag): a bare NAME when one model is served,
    else STEM=NAME for any of them (the others keep their file stem). Raises SettingsError naming what is wrong."""
    by_stem = {path.stem: path for path in paths}
    names = {path: path.stem for path in paths}
    for entry in given:
        stem, equals, name = entry.rpartition("=")
        if not equals:
            if len(paths) != 1:
                raise SettingsError(
                    f"--served-model-name {entry!r}: {len(paths)} models are served ({', '.join(by_stem)}); "
                    "name each as STEM=NAME"
                )
            stem = paths[0].stem
        if stem not in by_stem:
            raise SettingsError(
                f"--served-model-name {entry!r}: no model file is named '{stem}'; served: {', '.join(by_stem)}"
            )
        if not name.strip():
            raise SettingsError(f"--served-model-name {entry!r}: the name is empty")
        names[by_stem[stem]] = name
    clash = next((n for n in names.values() if list(names.values()).count(n) > 1), None)
    if clash is not None:
        raise SettingsError(f"two models would both be served as '{clash}'; give each its own --served-model-name")
    return names


def load_models(settings: Settings) -> list[LoadedModel]:
    device = settings.torch_device()
    dtype = settings.torch_dtype(device)
    loaded = []
    vocabularies = checked_vocabularies(settings)
    chat_templates = checked_chat_templates(settings, vocabularies)
    names = served_names(settings.served_model_name, list(vocabularies))
    for path, vocabulary in vocabularies.items():
        model, info = load_model(path, device=device, dtype=dtype)
        model.kv_cache_dtype = settings.torch_kv_cache_dtype()
        if settings.max_model_len is not None and model.config.task == "text":
            model.limit_context(settings.max_model_len)
        warn_about_cache_dtype(path, model, settings, device)
        log.info(
            "loaded %s as %s (%s %s, %d parameters, vocabulary %s, context %d) on %s in %s, "
            "keys and values cached in %s",
            path,
            names[path],
            model.config.attention,
            model.config.task,
            model.num_parameters(),
            vocabulary.name,
            model.config.max_len,
            device,
            dtype,
            model.cache_dtype() or "its own dtypes",
        )
        loaded.append(LoadedModel(names[path], path, model, info, vocabulary, chat_templates.get(path)))
    return loaded


def warn_about_cache_dtype(path: Path, model: Transformer, settings: Settings, device: str) -> None:
    """A cache dtype other than the model's helps only where the CPU decode kernel reads it (compiled CPU steps)
    and only when narrower: say so at start-up rather than serve slower or larger without a word."""
    cached = model.cache_dtype()
    if cached is None or cached == model.dtype:
        return
    if cached.itemsize > model.dtype.itemsize:
        log.warning(
            "%s: keys and values cached in %s hold %s numbers in more bytes: more memory for nothing; "
            "leave --kv-cache-dtype auto",
            path,
            cached,
            model.dtype,
        )
    elif device != "cpu" or not settings.compile_decode:
        log.warning(
            "%s: keys and values cached in %s are widened to %s by every step outside the CPU decode kernel "
            "(it runs in compiled CPU steps only): smaller, but slower than --kv-cache-dtype auto",
            path,
            cached,
            model.dtype,
        )


def eval_metrics(info: dict[str, Any]) -> dict[str, Any]:
    evaluation = info.get("eval", info.get("metrics", {}))
    return data_by_file_name(evaluation) if isinstance(evaluation, dict) else {}


def data_by_file_name(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics with each evaluation data set named by its file name: the stored path is the one on the
    machine that ran the evaluation (e.g. ../shared/data/mnist/t10k-images-idx3-ubyte.gz), not the server's."""
    return {
        key: Path(value).name
        if key == "data" and isinstance(value, str)
        else data_by_file_name(value)
        if isinstance(value, dict)
        else value
        for key, value in metrics.items()
    }


class ModelLookupError(LookupError):
    """No loaded engine fits what a request asked for; the message says what is loaded."""


class ModelNotLoaded(ModelLookupError):
    """The named model, or any model of the task, is not loaded."""


class WrongModelTask(ModelLookupError):
    """The named model is loaded but serves another task."""


class ModelRequired(ModelLookupError):
    """No model named, and several of the task are loaded."""


class EngineRegistry:
    """The engines by model name, in load order."""

    def __init__(
        self,
        engines: list[EngineHandle],
        created: dict[str, int] | None = None,
        chat_templates: dict[str, ChatTemplate] | None = None,
    ):
        self.engines = {e.name: e for e in engines}
        self.created = created or {}  # unix time of each weights file
        self.chat_templates = chat_templates or {}  # by model name: the text models that can chat

    def __iter__(self) -> Iterator[EngineHandle]:
        return iter(self.engines.values())

    def find(self, name: object) -> EngineHandle | None:
        """The engine of a model name, if one is loaded under it (anything else: None)."""
        return self.engines.get(name) if isinstance(name, str) else None

    def get(self, name: str | None, task: str) -> EngineHandle:
        """The named engine, or the task's only one when no name is given; a ModelLookupError with the choices
        otherwise."""
        if not name:
            return self.only(task)
        engine = self.engines.get(name)
        if engine is None:
            raise ModelNotLoaded(f"model '{name}' is not loaded; loaded models: {self._names()}")
        if engine.config.task != task:
            raise WrongModelTask(
                f"model '{name}' is a {engine.config.task} model and cannot serve {task} requests; "
                f"{task} models loaded: {self._names(task)}"
            )
        return engine

    def only(self, task: str) -> EngineHandle:
        """A request without `model`: the one loaded model of the task, else a ModelLookupError listing the
        choices."""
        candidates = [e for e in self.engines.values() if e.config.task == task]
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            raise ModelNotLoaded(f"no {task} model is loaded; loaded models: {self._names()}")
        raise ModelRequired(f"`model` is required: {len(candidates)} {task} models are loaded: {self._names(task)}")

    def _names(self, task: str | None = None) -> str:
        names = [n for n, e in self.engines.items() if task is None or e.config.task == task]
        return ", ".join(names) or "none"

    def not_ready(self) -> list[str]:
        return [name for name, engine in self.engines.items() if not engine.ready]
