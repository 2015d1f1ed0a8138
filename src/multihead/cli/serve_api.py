"""The request bodies of ``multihead serve``'s OpenAI-compatible endpoints, and their error objects.

Fields follow OpenAI's API reference (``/v1/completions``, ``/v1/chat/completions``); ``top_k`` is the
common extension (vLLM, llama.cpp's server). A field the server does not know is refused by name (no
catch-all that would swallow a misspelling); fields it knows but cannot honour (``n`` > 1, logprobs,
penalties) are refused when they ask for anything but the default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatBody", "CompletionBody", "Message", "error_body"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Literal[1] = 1
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)  # penalties are not implemented
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    logprobs: Literal[False, None] = None

    def stops(self) -> tuple[str, ...]:
        """The stop strings as a tuple (OpenAI takes one string or a list)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionBody(_Common):
    """``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[int]
    echo: Literal[False] = False


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Common):
    """``POST /v1/chat/completions``: a conversation rendered with the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
