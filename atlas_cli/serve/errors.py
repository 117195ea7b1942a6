"""HTTP errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) and in
Anthropic's (`{"type": "error", "error": {"type", "message"}}`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Anthropic's error type for each status code (docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by atlas serve", code="unsupported", param=param)


def check_fits(prompt_tokens: int, context: int) -> None:
    """400 when the prompt leaves no room for a generated token."""
    if prompt_tokens >= context:
        raise APIError(
            400,
            f"the prompt is {prompt_tokens:,} tokens but the context holds {context:,} "
            "(including at least one generated token); shorten the messages or restart the "
            "server with a larger --ctx-size",
            code="context_length_exceeded",
            param="messages",
        )


def check_text_fits(text: str, fewest_tokens: int, context: int) -> None:
    """400 for a prompt whose text alone needs more tokens than the context holds, known
    before tokenising it (seconds of work for a 10 MB body)."""
    if fewest_tokens >= context:
        raise APIError(
            400,
            f"the prompt is {len(text):,} characters, more than the {context:,}-token context "
            "holds; shorten the messages or restart the server with a larger --ctx-size",
            code="context_length_exceeded",
            param="messages",
        )
