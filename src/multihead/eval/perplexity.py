"""Perplexity of a language model by the sliding-window method of transformers' guide "Perplexity of
fixed-length models".

    ppl = mh.eval.perplexity(model, texts)                  # a float
    s = mh.eval.perplexity_scores(model, texts)             # the windows' scores behind it
    s.perplexity, s.scored, s.interval()                    # 21.3, 4095, (19.8, 23.0)

The texts are joined with ``"\\n\\n"`` (as the guide joins WikiText's lines) and tokenized once with the
model's tokenizer. Windows of ``context`` tokens start every ``stride`` tokens (0, stride, 2 stride, ...;
the last one ends at the last token); each window scores only the tokens the previous window did not
reach, with the tokens before them as context (the guide's labels set to -100 over the overlap). Every
token but the first is scored exactly once (with ``stride == context`` the windows do not overlap and,
as in the guide, the first token of each window, which has no context in it, is not scored):

    tokens   0 ....................................... T-1
    window 0 [ctx ctx ctx ctx ctx ctx ctx ctx]                   scores 1 .. context-1
    window 1         [ctx ctx ctx ctx ctx ctx  s   s ]           scores the `stride` tokens after window 0
    window 2                 [ctx ctx ctx ctx ctx ctx  s   s ]   ...

The perplexity is exp of the mean negative log-likelihood over all scored tokens. (The guide's code
weights each window's mean loss by one token fewer than that window scores; here each token counts
once, so a window that scores n tokens weighs n.) A smaller stride gives each token more context and
costs about context / stride forward passes of ``context`` tokens per stride.

Shape legend: T tokens of the joined text, W windows, L a window's length, n tokens a window scores,
d model width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core.checks import check_int
from .metrics import bootstrap_ci

__all__ = ["JOIN", "PerplexityScores", "perplexity", "perplexity_scores", "windows"]

#: how the texts are joined before tokenizing (the guide's ``"\n\n".join(test["text"])``)
JOIN = "\n\n"


@dataclass(frozen=True)
class PerplexityScores:
    """The scores of :func:`perplexity_scores`, one entry per window.

    Attributes:
        nll: (W,) float64, the sum of the negative log-likelihoods (nats) of the tokens each window scored.
        tokens: (W,) int64, how many tokens each window scored (all >= 1).
        context, stride: the window length and step they were scored with.
    """

    nll: Tensor
    tokens: Tensor
    context: int
    stride: int

    @property
    def scored(self) -> int:
        """Tokens scored in all: the joined text's length minus one."""
        return int(self.tokens.sum())

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood per scored token, in nats."""
        return float(self.nll.sum() / self.tokens.sum())

    @property
    def perplexity(self) -> float:
        """exp(:attr:`mean_nll`)."""
        return math.exp(self.mean_nll)

    def __float__(self) -> float:
        return self.perplexity

    def interval(self, *, samples: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
        """Percentile bootstrap interval of the perplexity over windows: the W windows are resampled
        with replacement and exp(sum of their nll / sum of their tokens) recomputed ``samples`` times.

        Windows score disjoint tokens, but neighbouring windows read overlapping text and articles
        span several windows, so the interval is a lower bound on the uncertainty of a text's topic
        mix; it says how much the score moves with the particular windows. With one window it is
        the point itself.

        Raises:
            ValueError: samples < 1 or a level outside (0, 1).
        """
        nll, tokens = self.nll, self.tokens.double()

        def stat(idx: Tensor) -> float:
            return math.exp(float(nll[idx].sum() / tokens[idx].sum()))

        return bootstrap_ci(stat, nll.numel(), samples=samples, seed=seed, level=level)


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over ``n_tokens`` tokens as ``(begin, end, n)``: tokens [begin, end) are read and
    the last n of them scored (n = end - previous end; the first window scores all but its first token;
    a window with nothing to score, a last one of a single token when stride == context, is left out).

    This is the loop of transformers' guide: ``for begin in range(0, T, stride)``, ``end = min(begin +
    context, T)``, stopping once a window reaches the last token.

    Raises:
        ValueError: n_tokens < 2, context < 2, or a stride outside [1, context].
    """
    check_int("n_tokens", n_tokens, 2, fix="perplexity needs at least two tokens of text")
    check_int("context", context, 2, fix="a window needs a token to predict and one to predict it from")
    check_int("stride", stride, 1, context, fix=f"give a stride from 1 to context={context}")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        n = min(end - prev_end, end - begin - 1)
        if n > 0:  # a last window of one token (stride == context) has nothing to predict from
            out.append((begin, end, n))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _token_ids(texts: Any, tokenizer: Any, model: Any) -> list[int]:
    """The ids of the joined texts, with ``tokenizer`` or the model's own."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        kind = type(texts).__name__
        raise ValueError(f"texts must be a list of strings, got a {kind}; wrap a single text in a list")
    if len(texts) == 0:
        raise ValueError("texts is empty; give at least one text")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"texts[{bad}] is a {type(texts[bad]).__name__}, not a str")
    tok: Any = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if not callable(getattr(tok, "encode", None)):
        raise ValueError(
            f"{type(model).__name__} has no tokenizer; pass tokenizer=<an object with .encode(text) -> ids>"
        )
    encoded = tok.encode(JOIN.join(texts))
    return [int(i) for i in getattr(encoded, "ids", encoded)]  # tokenizers' Encoding holds .ids


def _log_probs(model: nn.Module, ids: Tensor, first: int) -> Tensor:
    """Log-probabilities (1, L - first, V), at least fp32, of the tokens after positions first .. L-2
    of ids (1, L): only the scored positions go through the output head."""
    hidden, head = getattr(model, "hidden_states", None), getattr(model, "lm_head", None)
    if callable(hidden) and isinstance(head, nn.Module):
        logits = head(hidden(ids)[:, first - 1 : -1])  # (1, n, V) from (1, n, d)
    else:
        out = model(ids)
        logits = getattr(out, "logits", out)[:, first - 1 : -1]  # (1, n, V)
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


@torch.no_grad()
def perplexity_scores(
    model: nn.Module,
    texts: Sequence[str],
    *,
    context: int = 512,
    stride: int = 256,
    tokenizer: Any = None,
    progress: Callable[[int, int], Any] | None = None,
) -> PerplexityScores:
    """The per-window scores behind :func:`perplexity` (see the module docstring for the method).

    Args:
        model: a language model: a :class:`~multihead.TransformerLM` (its ``hidden_states`` and
            ``lm_head``), or any module whose ``model(ids (1, L))`` gives logits (1, L, V) or an object
            with ``.logits``. Scored in eval mode (dropout off); every submodule's mode is restored.
        texts: the texts, joined with :data:`JOIN` into one token stream.
        context: tokens per window (>= 2; at most what the model's positions cover).
        stride: tokens between window starts, 1 <= stride <= context.
        tokenizer: an object with ``.encode(text) -> ids`` (or a ``tokenizers.Encoding``); default
            ``model.tokenizer``.
        progress: called as ``progress(done, total)`` after each window (a progress bar).

    Returns:
        :class:`PerplexityScores`; ``float()`` of it is the perplexity.

    Raises:
        ValueError: texts not a non-empty list of strings, a text that tokenizes to fewer than two
            tokens, context < 2, a stride outside [1, context], no tokenizer.
    """
    check_int("context", context, 2, fix="a window needs a token to predict and one to predict it from")
    check_int("stride", stride, 1, context, fix=f"give a stride from 1 to context={context}")
    ids = _token_ids(texts, tokenizer, model)
    if len(ids) < 2:
        raise ValueError(f"the texts tokenize to {len(ids)} token(s); perplexity needs at least two")
    param = next(iter(model.parameters()), None)
    stream = torch.tensor(ids, dtype=torch.long, device=None if param is None else param.device)  # (T,)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        nll, counts = [], []
        spans = windows(len(ids), context, stride)
        for begin, end, n in spans:
            window = stream[begin:end].unsqueeze(0)  # (1, L)
            first = end - begin - n  # the first scored position, >= 1
            logp = _log_probs(model, window, first)  # (1, n, V)
            picked = logp.gather(-1, window[:, first:].unsqueeze(-1)).squeeze(-1)  # (1, n)
            nll.append(-picked.double().sum().cpu())
            counts.append(n)
            if progress is not None:
                progress(len(counts), len(spans))
    finally:
        for m, training in modes:
            m.training = training
    return PerplexityScores(
        torch.stack(nll), torch.tensor(counts, dtype=torch.long), context=context, stride=stride
    )


def perplexity(
    model: nn.Module,
    texts: Sequence[str],
    *,
    context: int = 512,
    stride: int = 256,
    tokenizer: Any = None,
) -> float:
    """Perplexity of ``model`` on ``texts`` by transformers' sliding-window method: exp of the mean
    negative log-likelihood of every token after the first, each read with up to ``context - 1``
    tokens before it and, past the first window, at least ``context - stride`` (see the module
    docstring).

    ``perplexity_scores`` gives the same number with the tokens scored and a bootstrap interval.

    Args:
        model, texts, context, stride, tokenizer: as :func:`perplexity_scores`.

    Raises:
        ValueError: as :func:`perplexity_scores`.
    """
    return perplexity_scores(model, texts, context=context, stride=stride, tokenizer=tokenizer).perplexity
