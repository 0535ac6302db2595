"""/tokenize, /detokenize and /tokenizer_info: request types and bodies (pure).

Both shapes clients use: vLLM's (`prompt` or `messages`, `add_special_tokens`, answered
with `count`, `max_model_len`, `tokens`; `/detokenize` answers `prompt`) and
llama-server's (`content`, `add_special`, `with_pieces`; `/detokenize` answers `content`).
lm-evaluation-harness's remote tokenizer reads `/tokenizer_info` (vLLM's shape).
"""

from __future__ import annotations

from typing import Any

import attrs

from butter.errors import InvalidRequest
from butter.protocol.convert import make_converter, structure_request


@attrs.frozen
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None  # vLLM
    content: str | None = None  # llama-server
    messages: list[dict[str, Any]] | None = None  # vLLM: rendered with the chat template
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM (default true)
    add_special: bool | None = None  # llama-server (default false)
    with_pieces: bool = False  # llama-server: each token with its text

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    @property
    def adds_special(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        if self.add_special is not None:
            return self.add_special
        return self.content is None  # vLLM's default, unless it is llama-server's shape


@attrs.frozen
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


_converter = make_converter()


def parse_tokenize_request(payload: Any) -> TokenizeRequest:
    request = structure_request(_converter, payload, TokenizeRequest)
    given = [name for name in ("prompt", "content", "messages")
             if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidRequest("give one of prompt (or content) and messages", param="prompt")
    return request


def parse_detokenize_request(payload: Any) -> DetokenizeRequest:
    request = structure_request(_converter, payload, DetokenizeRequest)
    if any(token < 0 for token in request.tokens):
        raise InvalidRequest("tokens must be non-negative ids", param="tokens")
    return request


def tokenize_body(tokens: list[int], max_model_len: int,
                  pieces: list[str] | None = None) -> dict[str, Any]:
    listed: list[Any] = (tokens if pieces is None else
                         [{"id": token, "piece": piece}
                          for token, piece in zip(tokens, pieces, strict=True)])
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": listed}


def detokenize_body(text: str) -> dict[str, Any]:
    return {"prompt": text, "content": text}  # vLLM's name, llama-server's name


def tokenizer_info_body(*, model: str, bos: str | None, eos: str | None, add_bos: bool,
                        chat_template: str, max_model_len: int) -> dict[str, Any]:
    return {"tokenizer_class": "GGUF", "name_or_path": model, "bos_token": bos or None,
            "eos_token": eos or None, "pad_token": None, "add_bos_token": add_bos,
            "chat_template": chat_template, "model_max_length": max_model_len}
