"""POST /v1/completions: OpenAI-compatible text completion, over bytes or a model's own tokenizer.

Each prompt of a request is one engine request of `best_of` (else `n`)
samples; their events are merged in arrival order when streaming.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.api.completion_answer import answer
from server.api.completion_request import CompletionRequest
from server.api.completion_response import CompletionResponse, TextCompletion
from server.api.deps import ServerState, get_server
from server.api.engine_calls import engine_refusals
from server.api.errors import utf8_body
from server.api.negotiation import check_accept
from server.api.responses import COMPLETION_RESPONSES
from server.engine.validation import check_logit_bias

router = APIRouter(dependencies=[Depends(utf8_body)])


@router.post("/v1/completions", response_model=CompletionResponse, responses=COMPLETION_RESPONSES)
async def create_completion(
    body: CompletionRequest, request: Request, server: ServerState = Depends(get_server)
) -> Response | dict[str, Any]:
    server.label_model(request, body.model)
    check_accept(request, body.stream)
    engine = server.engine_for(request, body.model, "text")
    with engine_refusals(engine):
        check_logit_bias(body.bias(), engine.name, engine.config.vocab_size)
    completion = TextCompletion(body, engine.name, f"cmpl-{uuid.uuid4().hex}", engine.vocabulary)
    return await answer(request, engine, completion, body.prompts(engine.vocabulary))
