"""OpenAI's legacy Completions (`POST /v1/completions`): raw prompts, no chat template.

What LangChain's `OpenAI` class, Continue's autocomplete, the Gateway API inference
extension and lm-evaluation-harness's `local-completions` call. Same engine, admission,
prefix reuse and cancellation as chat; the prompt is completed as it is.
"""

from __future__ import annotations

from typing import Any

import attrs

from butter.chat.request import (
    FinishReason,
    GenerationRequest,
    Logprobs,
    TextPrompt,
    TokenPrompt,
    Usage,
)
from butter.errors import InvalidRequest
from butter.protocol import openai
from butter.protocol.convert import make_converter, structure_request
from butter.sampling import MAX_SEED, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_PROMPTS = 64


@attrs.frozen
class CompletionRequest:
    prompt: Any  # a string, strings, token ids, or lists of token ids: checked below
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: openai.StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    grammar: str | None = None  # llama-server's: GBNF the completion must follow
    best_of: int | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


_converter = make_converter()


def parse_completion_request(payload: Any) -> CompletionRequest:
    request = structure_request(_converter, payload, CompletionRequest)
    prompts(request)  # (validates)
    openai.check_sampling_ranges(request)
    if request.max_tokens is not None and request.max_tokens < (0 if request.echo else 1):
        raise InvalidRequest("max_tokens must be at least 1 (0 only with echo)",
                             param="max_tokens")
    if request.n is not None and not 1 <= request.n <= openai.MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {openai.MAX_CHOICES}", param="n")
    if request.best_of not in (None, 1, request.n):
        raise InvalidRequest("best_of is not supported (use n)", param="best_of")
    if request.logprobs is not None and not 0 <= request.logprobs <= openai.MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {openai.MAX_TOP_LOGPROBS}",
                             param="logprobs")
    if request.suffix is not None and request.echo:
        raise InvalidRequest("suffix cannot be combined with echo", param="suffix")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be between 0 and {MAX_SEED}", param="seed")
    if isinstance(request.stop, list) and len(request.stop) > 16:
        raise InvalidRequest("at most 16 stop sequences are supported", param="stop")
    openai.logit_bias(request.logit_bias)  # (validates)
    return request


def prompts(request: CompletionRequest) -> list[TextPrompt | TokenPrompt]:
    """The prompts, each completed on its own (the choices of prompt i come first)."""
    prompt = request.prompt
    if request.suffix is not None and not isinstance(prompt, str):
        raise InvalidRequest("suffix needs one text prompt", param="suffix")
    if isinstance(prompt, str):
        found: list[TextPrompt | TokenPrompt] = [TextPrompt(prompt, suffix=request.suffix)]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        found = [TokenPrompt(tuple(prompt))]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        found = [TextPrompt(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        found = [TokenPrompt(tuple(p)) for p in prompt]
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token "
                             "ids or a list of such lists, none of them empty", param="prompt")
    if len(found) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return found


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def generation_requests(request: CompletionRequest) -> list[GenerationRequest]:
    """One per prompt."""
    overrides = {name: getattr(request, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repeat_penalty") if getattr(request, name) is not None}
    sampling = attrs.evolve(SamplingParams(**overrides),  # llama-server's defaults
                            logit_bias=openai.logit_bias(request.logit_bias),
                            logprobs=request.logprobs,
                            grammar=(None if request.grammar is None
                                     else openai.gbnf_constraint(request.grammar, False)))
    max_tokens = DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    score = request.logprobs if request.echo else None  # the prompt's logprobs too
    return [GenerationRequest(prompt=prompt, sampling=sampling, max_tokens=max_tokens,
                              stop=tuple(s for s in stops if s), n=request.n or 1,
                              score_prompt=score)
            for prompt in prompts(request)]


# ---------------------------------------------------------------- responses

def logprobs_body(entries: list[Logprobs], offset: int,
                  first_token: str | None = None) -> dict[str, Any]:
    """The legacy shape: tokens, their logprobs, the top alternatives as {text: logprob},
    and each token's character offset in the choice's text (from `offset`).
    `first_token`: an echoed prompt's first token, which has no logprob (null)."""
    tokens = [entry.chosen.piece.decode("utf-8", errors="replace") for entry in entries]
    token_logprobs: list[float | None] = [entry.chosen.logprob for entry in entries]
    top_logprobs: list[dict[str, float] | None] = [
        {top.piece.decode("utf-8", errors="replace"): top.logprob for top in entry.top}
        for entry in entries]
    if first_token is not None:
        tokens, token_logprobs = [first_token, *tokens], [None, *token_logprobs]
        top_logprobs = [None, *top_logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def first_token_text(prompt: str, scored: list[Logprobs]) -> str:
    """The text of an echoed prompt's first token: what the scored tokens leave of it."""
    rest = sum(len(entry.chosen.piece.decode("utf-8", errors="replace")) for entry in scored)
    return prompt[: max(0, len(prompt) - rest)]


def choice_body(index: int, text: str, finish_reason: FinishReason | None,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason,
            "logprobs": logprobs}


def completion_body(*, completion_id: str, model: str, created: int,
                    choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": completion_id, "object": "text_completion",
                            "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = openai.usage_body(usage)
    return body
