"""A validated completion request as engine work: one generation per prompt (its tokens, sampling, stopping,
`best_of` or `n` samples), and the echoed prompt's scores."""

from __future__ import annotations

from server.api.completion_request import CompletionRequest
from server.api.completion_response import TextCompletion
from server.api.engine_calls import engine_refusals, score, submit
from server.engine.base import EngineHandle
from server.engine.streams import GenerationStream
from server.engine.types import GenerationRequest, PromptScores


async def start_generations(
    engine: EngineHandle, body: CompletionRequest, prompts: list[list[int]], completion: TextCompletion
) -> list[GenerationStream]:
    """Queue one generation per prompt (the engine validates each); none when max_tokens is 0,
    but each prompt must still fit. A refusal cancels those already queued."""
    streams: list[GenerationStream] = []
    try:
        for i, prompt in enumerate(prompts):
            if body.max_tokens == 0:
                with engine_refusals(engine):
                    engine.check_prompt(prompt, body.samples)
            else:
                streams.append(
                    await submit(engine, generation_request(body, prompt, f"{completion.id}-{i}"), body.stream)
                )
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def generation_request(body: CompletionRequest, prompt: list[int], request_id: str) -> GenerationRequest:
    sampling = body.sampling(
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, logit_bias=body.bias()
    )
    ranks = body.samples > body.n  # best_of ranks samples by their log-probabilities
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        max_new_tokens=body.max_tokens,
        sampling=sampling,
        n=body.samples,
        stop=body.stop_bytes(),
        logprobs=body.logprobs is not None or ranks,
        top_logprobs=body.logprobs or 0,
    )


async def prompt_scores(engine: EngineHandle, body: CompletionRequest, prompt: list[int]) -> PromptScores | None:
    """The prompt's log-probabilities (and top alternatives) when echoed with logprobs, else none."""
    if body.echo and body.logprobs is not None and prompt:
        return await score(engine, prompt, body.logprobs)
    return None
