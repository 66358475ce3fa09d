"""One typed check of what the engine is asked to do, against the model and the server's limits.

Request schemas (pydantic) check each field's own range; what depends on the
model or the server (the context length, `--max-batch`, the token range) is
checked here, once, by the engine when a request is submitted. Messages name
the API's parameters.
"""

from __future__ import annotations

from model.config import ModelConfig

from server.engine.types import GenerationRequest


class InvalidRequest(ValueError):
    """A request the engine cannot run: the message says what to change, `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def check_generation(request: GenerationRequest, model_name: str, config: ModelConfig, max_batch: int) -> None:
    if request.max_new_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1 to generate, got {request.max_new_tokens}", "max_tokens")
    check_fits(request.prompt, request.max_new_tokens, model_name, config)
    check_stopping(request, model_name, config.vocab_size)
    check_samples(request.n, max_batch)
    if request.particles is not None and not 1 <= request.rows <= max_batch:
        raise InvalidRequest(
            f"n ({request.n}) x particles ({request.particles}) = {request.rows} decode slots; "
            f"this server has {max_batch} per model (--max-batch); lower n or particles",
            "particles",
        )


def check_samples(n: int, max_batch: int) -> None:
    """n samples of one prompt fit this server's decode slots (also for a request that generates nothing)."""
    if not 1 <= n <= max_batch:
        raise InvalidRequest(
            f"n is {n}; this server decodes at most {max_batch} sequences per model at once (--max-batch, or fewer "
            "under --kv-cache-memory)",
            "n",
        )


def check_fits(prompt: list[int], max_new_tokens: int, model_name: str, config: ModelConfig) -> None:
    """The prompt's tokens are valid and, with `max_new_tokens` more, fit the model's context."""
    check_tokens(prompt, model_name, config.vocab_size)
    max_len = config.max_len
    # What the model reads: its lead (a start token), the prompt, and every new token but the last.
    lead = len(config.prompt_lead(len(prompt)))
    total = lead + len(prompt) + max_new_tokens - 1
    if total > max_len:
        at_fault = "prompt" if lead + len(prompt) > max_len else "max_tokens"  # a prompt that leaves no room
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens{' after the start token' if lead else ''}) plus max_tokens "
            f"({max_new_tokens}) needs a context of {total} tokens; model '{model_name}' handles at most {max_len}",
            at_fault,
            "context_length_exceeded",
        )


def new_token_room(prompt_length: int, config: ModelConfig) -> int:
    """The most tokens a prompt of `prompt_length` tokens leaves room for in the model's context (check_fits)."""
    return config.max_len - len(config.prompt_lead(prompt_length)) - prompt_length + 1


def check_scoring(tokens: list[int], model_name: str, config: ModelConfig) -> None:
    check_tokens(tokens, model_name, config.vocab_size)
    max_len = config.max_len
    if not 1 <= len(tokens) <= max_len:
        raise InvalidRequest(
            f"can score 1 to {max_len} tokens with model '{model_name}', got {len(tokens)}",
            "prompt",
            "context_length_exceeded" if tokens else "invalid_value",
        )


def check_tokens(tokens: list[int], model_name: str, vocab_size: int) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt holds token {bad}; model '{model_name}' has tokens 0..{vocab_size - 1}", "prompt")


def check_logit_bias(bias: dict[int, float], model_name: str, vocab_size: int) -> None:
    bad = next((t for t in bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"logit_bias names token {bad}; model '{model_name}' has tokens 0..{vocab_size - 1}", "logit_bias"
        )


def check_stopping(request: GenerationRequest, model_name: str, vocab_size: int) -> None:
    """vLLM's stop_token_ids name tokens of the model; min_tokens fits the budget (as vLLM requires)."""
    p = request.sampling
    bad = next((t for t in p.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"stop_token_ids names token {bad}; model '{model_name}' has tokens 0..{vocab_size - 1}", "stop_token_ids"
        )
    if p.min_tokens and len(set(p.stop_token_ids)) >= vocab_size:
        raise InvalidRequest(
            "stop_token_ids names every token of the model, so min_tokens would leave none to draw", "stop_token_ids"
        )
    if p.min_tokens > request.max_new_tokens:
        raise InvalidRequest(
            f"min_tokens ({p.min_tokens}) must be at most max_tokens ({request.max_new_tokens})", "min_tokens"
        )
