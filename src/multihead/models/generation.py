"""Generation: prefill the prompt once, then one token per step on a preallocated KV cache.

The loop knows a model only through :class:`CausalLM` (its hidden states, its output head, its caches),
so the model does not know how it is sampled. Greedy by default; sampling from
``softmax(logits / temperature)`` restricted to the ``top_k`` best tokens and to the smallest set of
probability >= ``top_p`` (nucleus sampling, Holtzman et al., 2020).

Generation stops at the model's end-of-sequence / end-of-turn ids (``model.eos_token_ids``, set by the
loaders that know them, e.g. :func:`multihead.pretrained.from_gguf`) unless ``eos_token_id`` names
others; a ``streamer`` callback sees each new token as soon as it is picked.

Shape legend: B batch, N prompt tokens, T = N + new tokens, V vocabulary, d model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
    eos_token_id: int | Sequence[int] | None = None,
    cache: str | None = "dense",
    attention_mask: Tensor | None = None,
    streamer: Callable[[Tensor], Any] | None = None,
) -> Tensor:
    """Extend ids (B, N) by up to ``max_new_tokens`` tokens -> (B, N + new); see
    :meth:`multihead.TransformerLM.generate` for the options. Runs in eval mode and restores the mode.

    ``eos_token_id`` None stops at ``model.eos_token_ids`` (when the model has them); an id or a list of
    ids stops at those instead, and ``()`` never stops early. ``streamer(tokens)`` is called with each
    new token column (B,) as soon as it is picked.

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
    stops = stop_ids(model, eos_token_id)
    if streamer is not None and not callable(streamer):
        raise ValueError(
            f"streamer must be a callable taking the new tokens (B,), got {type(streamer).__name__}"
        )
    real = None if attention_mask is None else check_left_padding(attention_mask, *ids.shape)
    check_output_fits(ids, max_new_tokens, attention_mask is not None)
    was_training = model.training
    model.train(False)
    try:
        sampling = (do_sample, temperature, top_k, top_p)
        return _loop(model, ids, max_new_tokens, sampling, (stops, streamer), cache, real)
    finally:
        model.train(was_training)


def stop_ids(model: Any, eos_token_id: Any) -> tuple[int, ...]:
    """The ids generation stops at: ``eos_token_id`` (an id or a sequence of ids) when given, else the
    model's ``eos_token_ids`` (none for a model without them).

    Raises:
        ValueError: an id that :func:`check_eos` refuses, or a sequence that is not of ids.
    """
    if eos_token_id is None:
        return tuple(int(i) for i in getattr(model, "eos_token_ids", None) or ())
    if isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, (str, bytes)):
        for i in eos_token_id:
            check_eos(i, None)
        return tuple(eos_token_id)
    check_eos(eos_token_id, None)
    return (eos_token_id,)


def _loop(model: CausalLM, ids, max_new_tokens, sampling, stop, cache, real) -> Tensor:
    """Prefill, then one decode step per new token; stops early once every row emitted a stop id
    (``stop`` is (stop ids, streamer))."""
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
        return _steps(model, out, h, N, sampling, stop, caches, am)


def _size(model: CausalLM) -> tuple[int, int]:
    """Parameters and bytes of weights (parameters and buffers) of ``model``; (0, 0) if not a Module."""
    if not isinstance(model, nn.Module):
        return 0, 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _steps(model: CausalLM, out: Tensor, h: Tensor, N: int, sampling, stop, caches, am) -> Tensor:
    """The decode loop after the prefill: pick a token from the last hidden state, then step on it; fills
    ``out`` (B, T). A model with ``greedy_steps`` (a :class:`~multihead.TransformerLM` whose steps run
    natively) picks greedy batch-1 tokens :data:`GREEDY_CHUNK` at a time in one native call; where it
    declines (None), the step below runs. With a streamer the runs start at one token and double up to
    :data:`GREEDY_CHUNK`, so that the first token is seen right after the prefill (the tokens are the
    same for any run length). A row that emitted a stop id keeps emitting that id."""
    stops, streamer = stop
    B, total = out.shape
    finished = torch.zeros(B, dtype=torch.bool, device=out.device)
    stop_t = torch.tensor(stops, dtype=out.dtype, device=out.device)  # (S,)
    fill = out.new_zeros(B)  # the stop id each finished row repeats
    # the native run stops at one id; with several it runs its chunk and the stop is found after it
    native_eos = stops[0] if len(stops) == 1 else None
    greedy = getattr(model, "greedy_steps", None)
    if caches is None or B != 1 or sampling[0] or (am is not None and not bool(am.all())):
        greedy = None
    t, chunk = N, 1 if streamer is not None else GREEDY_CHUNK
    while t < total:
        if greedy is not None:
            n = min(chunk, total - t)
            chunk = min(2 * chunk, GREEDY_CHUNK)
            ran = greedy(h, out, t, n, t + n == total, native_eos, caches)
            if ran is not None:  # tokens out[:, t : t + picked], the caches advanced past the last one
                picked, h = ran
                new = out[0, t : t + picked].tolist()
                end = next((j + 1 for j, tok in enumerate(new) if tok in stops), None)
                for j in range(picked if end is None else end):
                    if streamer is not None:
                        streamer(out[:, t + j])
                if end is not None:
                    return out[:, : t + end]
                t += picked
                if t == total:
                    return out[:, :t]
                continue
        nxt = pick_next(model.lm_head(h[:, -1]), *sampling)  # (B,) from the last position's logits
        if stops:
            nxt = torch.where(finished, fill, nxt)
            hit = torch.isin(nxt, stop_t) & ~finished
            fill = torch.where(hit, nxt, fill)
            finished |= hit
        out[:, t] = nxt
        if streamer is not None:
            streamer(out[:, t])
        if t == total - 1 or (stops and bool(finished.all())):
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


def pick_next(
    logits: Tensor,
    do_sample: bool,
    temperature: float,
    top_k,
    top_p,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token per row (B,) from last-position logits (B, V): argmax, or a sample drawn from
    ``generator`` (torch's global generator when None)."""
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
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)  # (B,)
