"""POST /v1/chat/completions: OpenAI-compatible chat, for text models with a chat template.

The messages are rendered by the model's template (stored by `rnnserve import hf`, or given with
`rnnserve serve --chat-template`) and tokenized as the template wrote them; from there a chat is a
completion of that one prompt (completion_answer.answer), its choices shaped as chat choices
(chat_response.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.api.chat_request import ChatCompletionRequest, chat_prompt
from server.api.chat_response import ChatCompletion, ChatCompletionResponse
from server.api.completion_answer import answer
from server.api.deps import ServerState, get_server
from server.api.engine_calls import engine_refusals
from server.api.negotiation import check_accept
from server.api.responses import COMPLETION_RESPONSES
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
