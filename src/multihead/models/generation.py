"""Generation: prefill the prompt once, then one token per step on a preallocated KV cache.

The loop knows a model only through :class:`CausalLM` (its hidden states, its output head, its caches),
so the model does not know how it is sampled. Greedy by default; sampling from
``softmax(logits / temperature)`` restricted to the ``top_k`` best tokens and to the smallest set of
probability >= ``top_p`` (nucleus sampling, Holtzman et al., 2020).

Shape legend: B batch, N prompt tokens, T = N + new tokens, V vocabulary, d model width.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import threads
from ..core.checks import check_int, check_size
from ..core.limits import check_fits
from ..nn.kv_cache import KVCache
from .padding import check_left_padding

__all__ = ["GREEDY_CHUNK", "CausalLM", "check_sampling", "generate", "pick_next"]

#: greedy tokens a native run picks per call (:meth:`multihead.TransformerLM.greedy_steps`): the
#: interpreter's share of a step spread over 8, and Ctrl-C still answered within 8 steps
GREEDY_CHUNK = 8


class CausalLM(Protocol):
    """What :func:`generate` needs of a model (``TransformerLM`` has it)."""

    training: bool

    @property
    def lm_head(self) -> nn.Module: ...

    def hidden_states(
        self, ids: Tensor, *, attention_mask: Tensor | None = None, cache: list[KVCache] | None = None
    ) -> Tensor: ...

    def make_cache(self, batch_size: int, max_len: int, kind: str = "dense") -> list[KVCache]: ...

    def check_ids(self, ids: Any) -> None: ...

    def train(self, mode: bool = True) -> Any: ...


@torch.no_grad()
def generate(
    model: CausalLM,
    ids: Tensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    cache: str | None = "dense",
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Extend ids (B, N) by up to ``max_new_tokens`` tokens -> (B, N + new); see
    :meth:`multihead.TransformerLM.generate` for the options. Runs in eval mode and restores the mode.

    Raises:
        ValueError: bad ids (an empty batch included), a negative max_new_tokens or one that takes the
            sequence past the model's ``max_len``, sampling options without ``do_sample`` or out of
            range, an ``eos_token_id`` that is not an int >= 0, an attention_mask that is not left
            padding or leaves a row empty, an output or a KV cache larger than the free memory. Every
            size is checked before anything is allocated.
    """
    model.check_ids(ids)
    if ids.shape[0] == 0:
        raise ValueError(f"ids of shape {tuple(ids.shape)} has B=0 rows; give at least one prompt")
    check_size("max_new_tokens", max_new_tokens, 0)
    limit = getattr(model, "max_len", None)
    if isinstance(limit, int) and ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"the prompt's {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} = "
            f"{ids.shape[1] + max_new_tokens} positions exceed the model's max_len={limit} (its "
            f"max_position_embeddings); ask for at most {max(limit - ids.shape[1], 0)} new tokens"
        )
    check_sampling(do_sample, temperature, top_k, top_p)
    check_eos(eos_token_id, getattr(model, "vocab_size", None))
    real = None if attention_mask is None else check_left_padding(attention_mask, *ids.shape)
    check_output_fits(ids, max_new_tokens, attention_mask is not None)
    was_training = model.training
    model.train(False)
    try:
        sampling = (do_sample, temperature, top_k, top_p)
        return _loop(model, ids, max_new_tokens, sampling, eos_token_id, cache, real)
    finally:
        model.train(was_training)


def _loop(model: CausalLM, ids, max_new_tokens, sampling, eos_token_id, cache, real) -> Tensor:
    """Prefill, then one decode step per new token; stops early once every row emitted ``eos_token_id``."""
    B, N = ids.shape
    total = N + max_new_tokens
    out = ids.new_empty(B, total)  # (B, T), preallocated and written by index
    out[:, :N] = ids
    if max_new_tokens == 0:
        return out
    am = None
    if real is not None:
        am = torch.ones(B, total, dtype=torch.bool, device=ids.device)  # (B, T)
        am[:, :N] = real
    caches = None if cache is None else model.make_cache(B, total, kind=cache)
    params, nbytes = _size(model)
    with threads.limited(threads.threads_for(2.0 * params * B * N, nbytes)):  # the prefill's threads
        h = model.hidden_states(ids, attention_mask=None if am is None else am[:, :N], cache=caches)
    # a decode step reads every weight for B tokens (the whole sequence without a cache): small models
    # step fastest on one thread
    step_tokens = B if caches is not None else B * total
    with threads.limited(threads.threads_for(2.0 * params * step_tokens, nbytes)):
        return _steps(model, out, h, N, sampling, eos_token_id, caches, am)


def _size(model: CausalLM) -> tuple[int, int]:
    """Parameters and bytes of weights (parameters and buffers) of ``model``; (0, 0) if not a Module."""
    if not isinstance(model, nn.Module):
        return 0, 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _steps(model: CausalLM, out: Tensor, h: Tensor, N: int, sampling, eos_token_id, caches, am) -> Tensor:
    """The decode loop after the prefill: pick a token from the last hidden state, then step on it; fills
    ``out`` (B, T). A model with ``greedy_steps`` (a :class:`~multihead.TransformerLM` whose steps run
    natively) picks greedy batch-1 tokens :data:`GREEDY_CHUNK` at a time in one native call; where it
    declines (None), the step below runs."""
    B, total = out.shape
    finished = torch.zeros(B, dtype=torch.bool, device=out.device)
    greedy = getattr(model, "greedy_steps", None)
    if caches is None or B != 1 or sampling[0] or (am is not None and not bool(am.all())):
        greedy = None
    t = N
    while t < total:
        if greedy is not None:
            n = min(GREEDY_CHUNK, total - t)
            ran = greedy(h, out, t, n, t + n == total, eos_token_id, caches)
            if ran is not None:  # tokens out[:, t : t + picked], the caches advanced past the last one
                picked, h = ran
                t += picked
                if t == total or (eos_token_id is not None and int(out[0, t - 1]) == eos_token_id):
                    return out[:, :t]
                continue
        nxt = pick_next(model.lm_head(h[:, -1]), *sampling)  # (B,) from the last position's logits
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
            finished |= nxt == eos_token_id
        out[:, t] = nxt
        if t == total - 1 or (eos_token_id is not None and bool(finished.all())):
            return out[:, : t + 1]
        seen = None if am is None else am[:, : t + 1]  # (B, t + 1)
        if caches is None:  # a full recompute of the sequence so far
            h = model.hidden_states(out[:, : t + 1], attention_mask=seen)  # (B, t + 1, d)
        else:  # one-token decode step on the cache
            h = model.hidden_states(out[:, t : t + 1], attention_mask=seen, cache=caches)  # (B, 1, d)
        t += 1
    return out


def check_output_fits(ids: Tensor, max_new_tokens: int, masked: bool) -> None:
    """Raise before allocating unless the (B, N + max_new_tokens) output (and its real-token mask) fit in
    the free memory of ids' device. The KV cache is checked when it is built (``make_cache``).

    Raises:
        ValueError: naming the sizes, the bytes and the fix.
    """
    B, N = ids.shape
    total = N + max_new_tokens
    nbytes = B * total * (ids.element_size() + (1 if masked else 0))
    what = f"the generated ids (B, N + max_new_tokens) = ({B}, {total})"
    check_fits(nbytes, what, "lower max_new_tokens or the batch", ids.device)


#: the largest id ``eos_token_id`` may be (the native greedy run compares it as a 64-bit integer)
MAX_EOS = 2**62


def check_eos(eos_token_id: Any, vocab_size: int | None) -> None:
    """Raise ValueError unless ``eos_token_id`` is None or an int in [0, 2**62]. An id past the vocabulary
    (``vocab_size`` is accepted for the callers' symmetry) is allowed, as transformers allows it: it is
    never picked, so the run goes on to ``max_new_tokens``."""
    del vocab_size
    if eos_token_id is None:
        return
    check_int(
        "eos_token_id", eos_token_id, 0, MAX_EOS, fix="pass the id of the end-of-sequence token, or None"
    )


def check_sampling(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for sampling options given without ``do_sample`` or out of range: ``do_sample``
    a bool, ``temperature`` a finite number > 0, ``top_k`` an int >= 1, ``top_p`` a number in (0, 1]."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if not do_sample and (temperature != 1.0 or top_k is not None or top_p is not None):
        raise ValueError(
            f"temperature={temperature}, top_k={top_k}, top_p={top_p} only apply when sampling; "
            "pass do_sample=True or drop them for greedy decoding"
        )
    number = not isinstance(temperature, bool) and isinstance(temperature, (int, float))
    if not (number and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(
            f"temperature must be > 0, got {temperature!r}; it must be a finite number (do_sample=False "
            "for greedy)"
        )
    if top_k is not None:
        check_int("top_k", top_k, 1, fix="None keeps every token")
    number = not isinstance(top_p, bool) and isinstance(top_p, (int, float))
    if top_p is not None and not (number and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}; None (or 1.0) keeps every token")


def pick_next(logits: Tensor, do_sample: bool, temperature: float, top_k, top_p) -> Tensor:
    """Next token per row (B,) from last-position logits (B, V): argmax, or a sample."""
    if not do_sample:  # torch's argmax over bf16 / fp16 is scalar code: widen first (exact, same ties)
        return (logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits).argmax(dim=-1)
    # Shifted so the best token scores 0, then divided in float64 (where every positive float is a
    # nonzero divisor): finite for any temperature > 0. A tiny one sends the others to -inf (greedy, ties
    # shared) instead of giving inf / inf = NaN.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # (B, V), max 0
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)  # (B, V)
    return torch.multinomial(F.softmax(logits, dim=-1), 1).squeeze(-1)  # (B,)
