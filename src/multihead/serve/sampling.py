"""Per-request sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

A request's draws come from a ``torch.Generator`` of its own, seeded with ``SamplingParams.seed`` (or
with fresh OS entropy when None), so the same seed gives the same text whatever else runs in the batch,
and torch's global generator is never read nor advanced. The arithmetic is
:func:`multihead.models.generation.pick_next`'s (the shift by the max logit in float64, then top-k, then
top-p), so a request decodes as ``model.generate`` would with the same options.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.checks import check_int
from ..models.generation import MAX_EOS, pick_next

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded and when it stops.

    Args:
        max_tokens: the most tokens generated (a stop id included).
        temperature: 0 for greedy (argmax, as OpenAI's API), else a finite number > 0 dividing the logits.
        top_k: keep the k best tokens (None: all); only with temperature > 0.
        top_p: keep the smallest set of probability >= top_p (None or 1.0: all); only with temperature > 0.
        seed: seeds the request's own generator (None: fresh entropy from the OS).
        stop: strings that end the generation; the text returned stops before the first one found.
        stop_token_ids: ids that end it (the id is kept in the token ids, not in the text); None: the
            model's end-of-sequence / end-of-turn ids (``model.eos_token_ids``), ``()`` none.

    Raises:
        ValueError: any value out of its range, naming it and the fix.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, 2**31, owner="SamplingParams")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            raise ValueError(
                f"SamplingParams temperature must be a finite number >= 0 (0: greedy), got {t!r}"
            )
        if t == 0 and (self.top_k is not None or self.top_p not in (None, 1.0)):
            raise ValueError(
                f"SamplingParams top_k={self.top_k}, top_p={self.top_p} only apply when sampling; give "
                "temperature > 0 or drop them for greedy decoding"
            )
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, owner="SamplingParams", fix="None keeps every token")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(
                f"SamplingParams top_p must be in (0, 1], got {p!r}; None (or 1.0) keeps every token"
            )
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1, owner="SamplingParams")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"SamplingParams stop must be a tuple of non-empty strings, got {self.stop!r}; "
                "e.g. stop=('\\n\\n',)"
            )
        for i in self.stop_token_ids or ():
            check_int("stop_token_ids", i, 0, MAX_EOS, owner="SamplingParams", fix="token ids are >= 0")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0


class Sampler:
    """The next-token choice of one request: greedy, or drawn from its own seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            seed = secrets.randbits(63) if params.seed is None else params.seed
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def pick(self, logits: Tensor) -> int:
        """The next token id from one row's logits (V,)."""
        p = self.params
        if p.greedy:
            return int(pick_next(logits[None], False, 1.0, None, None)[0])
        return int(pick_next(logits[None], True, p.temperature, p.top_k, p.top_p, self.generator)[0])
