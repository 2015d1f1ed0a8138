"""A request, the state of its sequence inside the engine, and what each step reports about it.

A sequence's ``tokens`` are its prompt followed by what it generated; the paged cache holds the keys and
values of the first ``cached`` of them. The tokens still to feed are ``tokens[cached:]``: the whole
prompt at first (a prefill, perhaps in chunks), then one token per step (a decode). A preempted sequence
loses its blocks and feeds all its tokens again (recompute), its generated tokens and its sampler kept.

Text: with a tokenizer, the generated ids (a stop id left out) are decoded after each step; stop
strings cut the text before the first one found; the text streamed out holds back a tail that could
still grow into a stop string, and an incomplete UTF-8 character.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .sampling import Sampler, SamplingParams

__all__ = ["FinishReason", "Request", "RequestOutput", "Sequence"]

_ids = itertools.count()


class FinishReason(str, enum.Enum):
    """Why a request ended: OpenAI's ``finish_reason`` values, and ``abort``."""

    STOP = "stop"  # a stop id or a stop string
    LENGTH = "length"  # max_tokens (or the model's context)
    ABORT = "abort"  # Engine.abort


@dataclass
class Request:
    """What a client asks for: a prompt of token ids and how to decode it.

    Args:
        prompt: the prompt's token ids (at least one).
        params: how to sample and when to stop.
        id: a name for the request (default: ``"req-<n>"``).
    """

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass
class RequestOutput:
    """One step's news of one request.

    Attributes:
        id: the request's id.
        new_token_ids: the tokens generated this step (empty when only finishing, e.g. an abort).
        new_text: the text that became final this step (with a tokenizer; else "").
        token_ids: every token generated so far.
        text: all the final text so far.
        finished: whether the request ended this step.
        finish_reason: why (a :class:`FinishReason` value) when finished, else None.
        prompt_tokens: the prompt's length.
    """

    id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int


class Sequence:
    """The engine's state of one request (see the module docstring)."""

    def __init__(self, request: Request, stops: tuple[int, ...], tokenizer: Any, arrival: int):
        self.request, self.params = request, request.params
        self.id = request.id
        self.tokens = list(request.prompt)
        self.n_prompt = len(self.tokens)
        self.cached = 0
        self.stop_ids = frozenset(stops)
        self.sampler = Sampler(request.params)
        self.tokenizer = tokenizer
        self.arrival = arrival  # admission order: the newest is preempted first
        self.finish_reason: FinishReason | None = None
        self.text, self.shown = "", 0  # decoded text (cut at a stop string) and how much was reported
        self.reported = 0  # generated tokens reported so far

    @property
    def generated(self) -> list[int]:
        """The generated token ids."""
        return self.tokens[self.n_prompt :]

    @property
    def pending(self) -> int:
        """Tokens still to feed to the model."""
        return len(self.tokens) - self.cached

    def append(self, token: int) -> None:
        """Add a generated token; finish on a stop id, a stop string or max_tokens."""
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = FinishReason.STOP
            return
        if self.tokenizer is not None:
            self._decode()
        if self.finish_reason is None and len(self.generated) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH

    def _decode(self) -> None:
        """Decode the generated ids (a stop id excluded); cut at the first stop string."""
        text = str(self.tokenizer.decode(self.generated))
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.finish_reason = text[:cut], FinishReason.STOP
        self.text = text

    def report(self) -> RequestOutput:
        """What is new since the last report; text held back unless final (see the module docstring)."""
        gen = self.generated
        new_ids, self.reported = gen[self.reported :], len(gen)
        final = len(self.text)
        if self.finish_reason is None:
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            final = max(self.shown, len(self.text) - hold)
            while final > self.shown and self.text[final - 1] == "\ufffd":  # an incomplete character
                final -= 1
        new_text, self.shown = self.text[self.shown : final], final
        done = self.finish_reason is not None
        return RequestOutput(
            id=self.id,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=list(gen),
            text=self.text[:final],
            finished=done,
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            prompt_tokens=self.n_prompt,
        )
