"""Errors that know how to present themselves on both wire formats.

A route raises one of these; the app's error handler renders it as OpenAI's
`{"error": {...}}` or Anthropic's `{"type": "error", ...}` depending on the route.
"""

from __future__ import annotations

from typing import Any


class ButterError(Exception):
    """Base: an HTTP status plus the error type names both APIs use."""

    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}


class InvalidRequest(ButterError):
    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(ButterError):
    status = 401
    openai_type = "invalid_request_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ButterError):
    """A browser-borne request the server does not take: a Host or Origin it does not
    answer to (butter/server/access.py)."""

    status = 403
    openai_type = "invalid_request_error"
    anthropic_type = "permission_error"
    code = "forbidden"


class ModelNotFound(ButterError):
    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"
    code = "model_not_found"


class RequestTooLarge(ButterError):
    status = 413
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


class Overloaded(ButterError):
    """The wait queue is full: try again shortly."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "overloaded_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ModelReplaced(ButterError):
    """The request's model was unloaded (a swap or shutdown) while it waited or ran."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "api_error"
    code = "model_replaced"


class NoModelLoaded(ButterError):
    """No model is resident: a swap's load failed and so did reloading the old model."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "api_error"
    code = "no_model"


class Draining(ButterError):
    """The server is shutting down: it finishes the requests it has and takes no new ones.

    503 on both APIs (not Anthropic's 529): routers such as vllm-router retry a 503 on
    another replica, and both SDKs retry it too, after `Retry-After`."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "overloaded_error"
    code = "server_draining"

    def __init__(self, message: str, *, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ModelLoadError(Exception):
    """A checkpoint could not be resolved or loaded; the message is one readable line."""
