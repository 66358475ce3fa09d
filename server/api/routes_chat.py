"""POST /v1/chat/completions: OpenAI-compatible chat, for text models with a chat template.

The messages are rendered by the model's template (stored by `rnnserve import hf`, or given with
`rnnserve serve --chat-template`) and tokenized as the template wrote them; from there a chat is a
completion of that one prompt (routes_text.answer), its choices shaped as chat choices (chat_api.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from model.io.chat_template import ChatTemplate, ChatTemplateError
from server.api.chat_api import ChatCompletion, ChatCompletionRequest, ChatCompletionResponse
from server.api.deps import ServerState, get_server
from server.api.errors import invalid_request
from server.api.generation import engine_refusals
from server.api.responses import COMPLETION_RESPONSES
from server.api.routes_text import answer, check_accept
from server.engine.base import EngineHandle
from server.engine.validation import check_logit_bias, new_token_room

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=COMPLETION_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, server: ServerState = Depends(get_server)
) -> Response | dict[str, Any]:
    server.label_model(request, body.model)
    check_accept(request, body.stream)
    engine = server.engine_for(request, body.model, "text")
    prompt = chat_prompt(engine, server.engines.chat_templates.get(engine.name), body)
    with engine_refusals(engine):
        check_logit_bias(body.bias(), engine.name, engine.config.vocab_size)
    completion = ChatCompletion(
        body.as_completion(prompt, new_token_room(len(prompt), engine.config)),
        engine.name,
        f"chatcmpl-{uuid.uuid4().hex}",
        engine.vocabulary,
    )
    return await answer(request, engine, completion, [prompt])


def chat_prompt(engine: EngineHandle, template: ChatTemplate | None, body: ChatCompletionRequest) -> list[int]:
    """The model's tokens for the conversation: its template's text, tokenized with no special tokens added."""
    if template is None:
        raise invalid_request(
            f"model '{engine.name}' has no chat template, so it cannot chat: its file holds none (a byte model, or "
            "a Hugging Face folder imported without chat_template.jinja or tokenizer_config.json's chat_template); "
            "start the server with --chat-template FILE to give one, or use POST /v1/completions",
            "model",
            "no_chat_template",
        )
    try:
        text = template.render(body.chat())
    except ChatTemplateError as exc:
        raise invalid_request(
            f"the chat template of model '{engine.name}' failed on these messages: {exc}",
            "messages",
            "chat_template_error",
        ) from None
    return engine.vocabulary.encode(text, add_special_tokens=False)
