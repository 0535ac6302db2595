"""What one generation asks for and what it reports, whatever API it came through (pure).

Each wire format in butter/protocol turns its request into a GenerationRequest; the
pipeline (butter/pipeline) runs it and reports a FinishReason and Usage, which each wire
format encodes in its own words. The pipeline never sees a wire type.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from butter.sampling import SamplingParams


@attrs.frozen
class ImageInput:
    """An image in a chat message, as the client sent it: each wire format puts one in a
    message's content list as {"type": "image", "image": ImageInput} (a tool result's
    content too); the pipeline decodes it (butter/chat/images.py) and refuses it with a 400
    where the model sees no images."""

    data: str = attrs.field(repr=False)  # base64 of the image file's bytes
    media_type: str | None = None  # as the client named it ("image/png"), if it did
    param: str = "messages"  # where it was in the request, for error messages


IMAGE_PART = "image"  # the content part type ImageInput comes in


@attrs.frozen
class ChatPrompt:
    """Messages for the model's chat template, in the shape templates expect (text
    content, tool-call arguments as objects; images as ImageInput parts)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # offered to the template; None: none offered
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    # False: the prompt ends after the last message, with no new assistant turn.
    add_generation_prompt: bool = True
    # True: the final (assistant) message is left open, so the model continues its
    # content (needs add_generation_prompt false; HF's and vLLM's field).
    continue_final_message: bool = False

    def images(self) -> list[ImageInput]:
        """The images in the messages, in the order they appear."""
        return [part["image"] for message in self.messages
                if isinstance(message.get("content"), list)
                for part in message["content"]
                if isinstance(part, dict) and part.get("type") == IMAGE_PART]


@attrs.frozen
class TextPrompt:
    """Raw text, completed as it is: no chat template. With `suffix`, the text before a
    gap and the text after it: the model fills the gap (fill-in-the-middle)."""

    text: str
    suffix: str | None = None


@attrs.frozen
class TokenPrompt:
    """Token ids, completed as they are."""

    tokens: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@attrs.frozen
class GenerationRequest:
    prompt: Prompt
    sampling: SamplingParams  # with the output constraint (tool_choice, response_format)
    max_tokens: int | None = None  # None: as many as the context holds
    stop: tuple[str, ...] = ()
    # The tools whose calls are recovered from `<tool_call>` markup: name -> parameters.
    tool_schemas: dict[str, dict[str, Any] | None] = attrs.field(factory=dict)
    n: int = 1  # choices, each with its own seed stream, sharing the prompt's KV
    # Score the prompt: each token's logprob (after the first) with this many alternatives;
    # max_tokens may then be 0. None: not asked.
    score_prompt: int | None = None


# Why a generation ended, in OpenAI's words (the Messages API maps them to its own).
FinishReason = Literal["stop", "length", "tool_calls"]


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the cache (a prefix reused)


@attrs.frozen
class TokenLogprob:
    token: int
    piece: bytes
    logprob: float


@attrs.frozen
class Logprobs:
    """A sampled token's log-probability under the model's own distribution (the raw
    logits' softmax: before penalties, bias, filters and temperature, as llama-server and
    vLLM report it), and the most likely tokens of that distribution."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Timings:
    """How long a generation's prompt and answer took, in llama-server's terms (`timings`
    on its responses): the prompt tokens evaluated (the cached ones apart) and the answer's
    tokens, each with its milliseconds. Waiting for a session is in neither."""

    cached_tokens: int
    prompt_tokens: int  # evaluated, not cached
    prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
