"""POST /tokenize and /detokenize: a text model's tokens for a text, and the text of tokens (vLLM's routes)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.api.deps import ServerState, get_server
from server.api.errors import invalid_request, utf8_body
from server.api.responses import errors
from server.api.tokenize_api import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter(dependencies=[Depends(utf8_body)])


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 401, 404, 413, 415))
async def tokenize(body: TokenizeRequest, request: Request, server: ServerState = Depends(get_server)) -> dict:
    engine = server.engine_for(request, body.model, "text")
    vocabulary = engine.vocabulary
    tokens = vocabulary.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {
        "count": len(tokens),
        "max_model_len": engine.config.max_len,
        "tokens": tokens,
        "token_strs": [vocabulary.shown[t] for t in tokens] if body.return_token_strs else None,
    }


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 401, 404, 413, 415))
async def detokenize(body: DetokenizeRequest, request: Request, server: ServerState = Depends(get_server)) -> dict:
    engine = server.engine_for(request, body.model, "text")
    size = engine.vocabulary.size
    bad = next((t for t in body.tokens if t >= size), None)
    if bad is not None:
        raise invalid_request(f"tokens holds {bad}; model '{engine.name}' has tokens 0..{size - 1}", "tokens")
    return {"prompt": engine.vocabulary.decode(body.tokens)}
