"""Request -> prompt tokens, fitted to the context and checked against the backend.

Blocking work (template rendering, tokenizing, compiling a grammar): the server calls it
on a worker thread, so long prompts and big tool schemas never stall other streams.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import attrs

from butter.backends.base import BackendError, PromptImage
from butter.chat.images import DecodedImage, check_image_count
from butter.chat.markup import THINK_CLOSE, THINK_OPEN
from butter.chat.request import ChatPrompt, GenerationRequest, TokenPrompt
from butter.chat.template import final_message_content
from butter.chat.tool_calls import TOOL_CALL, CallSyntax
from butter.errors import ContextLengthExceeded, InvalidRequest, ModelReplaced
from butter.pipeline.resident import ResidentModel
from butter.sampling import MAX_SEED, SamplingParams

# How an image shows in a prompt's text (`__verbose.prompt`, `starts_in_reasoning`):
# libmtmd's default marker, as llama-server writes it.
IMAGE_TEXT = "<__media__>"


@attrs.frozen
class PreparedGeneration:
    request: GenerationRequest
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None  # the request's, clamped to what the context still holds
    starts_in_reasoning: bool  # the template opened a <think> block in the prompt
    # A token prompt's text (what `echo` returns); None for a text or chat prompt.
    token_prompt_text: str | None = None
    # The template writes calls as bare JSON, so the model may answer one that way.
    bare_json_calls: bool = False
    # How the model writes tool calls: `<tool_call>`, and its family's markup.
    call_syntaxes: tuple[CallSyntax, ...] = (TOOL_CALL,)
    # Where messages start in a chat prompt, for a model checkpointed there (engine).
    checkpoint_hints: tuple[int, ...] = ()
    # Where the prompt holds images (their positions hold image_token_ids).
    images: tuple[PromptImage, ...] = ()


def prepare(resident: ResidentModel, request: GenerationRequest) -> PreparedGeneration:
    """Render (chat) or take (text) the prompt, tokenize, fit, check the sampling."""
    try:
        if isinstance(request.prompt, ChatPrompt):
            text, tokens, images = chat_prompt(resident, request.prompt)
            prepared = prepare_tokens(resident, request, tokens,
                                      starts_in_reasoning=starts_in_reasoning(
                                          request.prompt, text))
            return attrs.evolve(prepared, bare_json_calls=(
                resident.template.capabilities.bare_json_calls
                and resident.template.renders_tools),
                call_syntaxes=resident.template.call_syntaxes,
                checkpoint_hints=checkpoint_hints(resident, prepared.prompt),
                images=tuple(images))
        if isinstance(request.prompt, TokenPrompt):
            tokens = checked_tokens(request.prompt.tokens, resident.backend.info.n_vocab)
            return attrs.evolve(prepare_tokens(resident, request, tokens),
                                token_prompt_text=resident.backend.detokenize(tokens))
        if request.prompt.suffix is not None:
            return prepare_tokens(resident, request, fill_in_the_middle(
                resident, request.prompt.text, request.prompt.suffix))
        return prepare_tokens(resident, request, resident.tokenize_prompt(request.prompt.text))
    except BackendError as exc:  # a swap unloaded this model while the request was prepared
        raise ModelReplaced(str(exc)) from None


# Message starts hinted for checkpoints: the last two (the final message and the answer's
# header, where a returning turn or a regenerated answer diverges), and earlier ones at
# least this many tokens apart (an edited earlier message), at most MAX_HINTS in all.
HINT_SPACING = 1024
MAX_HINTS = 8


def checkpoint_hints(resident: ResidentModel, prompt: list[int]) -> tuple[int, ...]:
    """Where messages start in `prompt`, for a model whose cached prompts are cut back
    only at checkpoints (none for other models: they need no hints)."""
    marker = resident.turn_marker_tokens
    if not marker or not resident.engine.cache.checkpoints_on:
        return ()
    return spaced_starts(occurrences(prompt, marker))


def occurrences(tokens: list[int], marker: tuple[int, ...]) -> list[int]:
    """The positions where `marker` starts in `tokens`."""
    first, width = marker[0], len(marker)
    return [i for i, token in enumerate(tokens)
            if token == first and tuple(tokens[i:i + width]) == marker]


def spaced_starts(starts: list[int]) -> tuple[int, ...]:
    """The last two starts, then earlier ones HINT_SPACING apart, MAX_HINTS at most."""
    kept = starts[-2:]
    for start in reversed(starts[:-2]):
        if len(kept) >= MAX_HINTS:
            break
        if kept[0] - start >= HINT_SPACING:
            kept.insert(0, start)
    return tuple(kept)


def fill_in_the_middle(resident: ResidentModel, prefix: str, suffix: str) -> list[int]:
    """The prefix-suffix-middle layout llama-server uses: [BOS] <PRE> prefix <SUF> suffix
    <MID>; the model continues with the middle."""
    info = resident.backend.info
    if info.fim_tokens is None:
        raise InvalidRequest("suffix needs a model with fill-in-the-middle tokens, and "
                             f"{info.description} has none", param="suffix")
    pre, suf, mid = info.fim_tokens
    bos = resident.backend.tokenize("", add_bos=info.add_bos)  # [BOS], or nothing
    text = resident.backend.tokenize
    return [*bos, pre, *text(prefix, add_bos=False), suf, *text(suffix, add_bos=False), mid]


def tokenize(resident: ResidentModel, text: str | None, messages: list[dict[str, Any]] | None,
             *, add_special: bool, with_pieces: bool) -> tuple[list[int], list[str] | None]:
    """A /tokenize request's tokens, of text or of chat messages through the template
    (and each token's text, where asked); blocking."""
    if messages is not None:
        tokens = resident.tokenize_prompt(render(resident, ChatPrompt(messages)))
    elif add_special:
        tokens = resident.tokenize_prompt(text or "")
    else:
        tokens = resident.backend.tokenize(text or "", add_bos=False)
    if not with_pieces:
        return tokens, None
    return tokens, [resident.backend.detokenize([token]) for token in tokens]


def chat_tokens(resident: ResidentModel, prompt: ChatPrompt) -> list[int]:
    """A chat prompt's tokens, as a generation would have them but not fitted to the
    context (a token count; an image counts its positions); blocking."""
    try:
        return chat_prompt(resident, prompt)[1]
    except BackendError as exc:
        raise ModelReplaced(str(exc)) from None


def chat_prompt(resident: ResidentModel, prompt: ChatPrompt
                ) -> tuple[str, list[int], list[PromptImage]]:
    """The rendered prompt, its ids and where its images sit. Images are decoded, the
    prompt rendered with a marker for each (one no client can send: it is drawn anew
    for every request) and split there, and the pieces and images tokenized together
    by the projector (Backend.tokenize_media)."""
    decoded = decode_images(resident, prompt)
    if not decoded:
        text = render(resident, prompt)
        return text, resident.tokenize_prompt(text), []
    marker = f"<__butter_image_{secrets.token_hex(8)}__>"
    text = render(resident, prompt, image_marker=marker)
    pieces = text.split(marker)
    if len(pieces) != len(decoded) + 1:
        raise InvalidRequest(
            f"the chat template rendered {len(pieces) - 1} of the {len(decoded)} images (it "
            "drops or repeats message content), so they cannot be placed in the prompt",
            param="messages")
    tokens, images = resident.tokenize_media(pieces, decoded)
    return text.replace(marker, IMAGE_TEXT), tokens, images


def prompt_text(resident: ResidentModel, tokens: list[int]) -> str:
    """A prompt as the model sees it: its tokens' text, special tokens written out
    (llama-server's `__verbose.prompt`), images as IMAGE_TEXT; blocking."""
    try:
        return "".join(IMAGE_TEXT if image else resident.backend.detokenize(list(run))
                       for image, run in itertools.groupby(tokens, key=lambda t: t < 0))
    except BackendError as exc:
        raise ModelReplaced(str(exc)) from None


def checked_tokens(tokens: tuple[int, ...], n_vocab: int) -> list[int]:
    if any(token >= n_vocab for token in tokens):
        raise InvalidRequest(f"the prompt has token ids beyond the vocabulary's {n_vocab}",
                             param="prompt")
    return list(tokens)


def render(resident: ResidentModel, prompt: ChatPrompt, image_marker: str | None = None
           ) -> str:
    return resident.template.render(
        prompt.messages, tools=prompt.tools,
        add_generation_prompt=prompt.add_generation_prompt,
        continue_final_message=prompt.continue_final_message,
        template_kwargs={**resident.template_defaults, **prompt.template_kwargs},
        image_marker=image_marker,
    )


def starts_in_reasoning(prompt: ChatPrompt, text: str) -> bool:
    """Whether the answer starts inside a <think> block: the template opened one at the
    end of the prompt, or the continued final message is inside one (it opened a block
    it has not closed), so the model's continuation is reasoning until it closes it."""
    if prompt.continue_final_message:
        content = final_message_content(prompt.messages, prompt.add_generation_prompt)
        return content.rfind(THINK_OPEN) > content.rfind(THINK_CLOSE)
    return text.rstrip().endswith(THINK_OPEN)


def prepare_tokens(
    resident: ResidentModel, request: GenerationRequest, prompt: list[int],
    *, starts_in_reasoning: bool = False,
) -> PreparedGeneration:
    if not prompt:  # (refused here, before a stream's headers and naming the field; the engine
        # refuses it too, for callers that skip this)
        raise InvalidRequest(
            "the prompt is empty: it renders to no tokens, so there is nothing to continue",
            param="messages" if isinstance(request.prompt, ChatPrompt) else "prompt")
    max_tokens = fit_completion(len(prompt), request.max_tokens, resident.max_context,
                                strict=resident.strict_max_tokens)
    check_choices(request.n, resident.engine.admission.slots)
    params = constrained_after_reasoning(request.sampling, starts_in_reasoning)
    check_logit_bias(params, resident.backend.info.n_vocab)
    try:
        resident.backend.check_sampling(params)
    except ValueError as exc:
        raise InvalidRequest(f"cannot serve this request: {exc}") from None
    return PreparedGeneration(request=request, prompt=prompt, params=params,
                              max_tokens=max_tokens, starts_in_reasoning=starts_in_reasoning)


def constrained_after_reasoning(params: SamplingParams, starts_in_reasoning: bool
                                ) -> SamplingParams:
    """A forced call or JSON output where the answer starts inside a reasoning block the
    prompt opened (Qwen3's and Qwen3.5's `<think>\\n`, thinking on): the grammar lets the
    model finish its reasoning and close the block first, then holds it to the call or
    the JSON, which the output reader finds after `</think>` (a call, or content; the
    reasoning before it is reasoning), as vLLM applies structured output only after the
    reasoning ends. Constrained from the first token instead, the call or the JSON would
    be written inside the block, and read as reasoning."""
    if not starts_in_reasoning or params.grammar is None:
        return params
    return attrs.evolve(params, grammar=params.grammar.after_open_reasoning())


def check_choices(n: int, sessions: int) -> None:
    """Every choice decodes in a session of its own, all at once."""
    if n > sessions:
        raise InvalidRequest(
            f"n={n} choices need {n} sessions, and this server runs {sessions} "
            f"(--parallel)", param="n")


def check_logit_bias(params: SamplingParams, n_vocab: int) -> None:
    for token, _ in params.logit_bias:
        if token >= n_vocab:
            raise InvalidRequest(f"logit_bias names token {token}, but the vocabulary has "
                                 f"{n_vocab} tokens", param="logit_bias")


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's sampling: the same, but its own seed stream (seed, seed + 1, ...), so
    a seeded request is reproducible choice by choice."""
    return [attrs.evolve(params, seed=(params.seed + index) % (MAX_SEED + 1))
            for index in range(n)]


def fit_completion(
    prompt_tokens: int, max_tokens: int | None, max_context: int, *, strict: bool
) -> int | None:
    """The completion budget: `max_tokens`, or what the context still holds if that is
    less (unless `strict`). Only a prompt that leaves no room for one token is refused.

    Clamping follows llama-server: clients such as Claude Code ask for a fixed 32000
    tokens whatever the model's context, and the answer simply ends with `length`."""
    room = max_context - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_tokens} tokens, which leaves no room for a completion "
            f"in the maximum context of {max_context} tokens", param="messages")
    if max_tokens is None or max_tokens <= room:
        return max_tokens
    if strict:
        raise ContextLengthExceeded(
            f"this request needs {prompt_tokens} prompt tokens + {max_tokens} completion "
            f"tokens = {prompt_tokens + max_tokens}, but the maximum context is "
            f"{max_context} tokens (--strict-max-tokens)", param="max_tokens")
    return room


def decode_images(resident: ResidentModel, prompt: ChatPrompt) -> list[DecodedImage]:
    """The prompt's images decoded, in the order they appear (ChatPrompt.images()), within
    the server's limits (--max-images, --max-image-bytes, --max-image-pixels); blocking
    (Pillow, on the prepare worker thread). A model without a projector takes none: the
    first image is refused, naming the flag that gives it one."""
    images = prompt.images()
    if not images:
        return []
    if not resident.backend.vision:
        raise InvalidRequest(
            f"this model ({resident.model_id}) takes no images: start butter with --mmproj "
            "<projector.gguf> (the vision projector GGUF published beside the model, "
            "llama-server's --mmproj) to send it images", param=images[0].param)
    limits = resident.image_limits
    check_image_count(len(images), limits)
    return [resident.recent_images.decode(image, limits) for image in images]
