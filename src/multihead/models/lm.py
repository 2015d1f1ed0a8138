"""``TransformerLM``: a decoder-only language model (GPT-2 / LLaMA / Mistral shape) and its generation loop.

    ids (B, N) -> embed (+ learned / sinusoidal positions) -> n_layers x TransformerLayer (causal,
    rotary in the attention) -> final norm (pre-LN) -> lm_head (tied to the embedding) -> logits (B, N, V)

Masking is explicit: ``mh.causal()`` (or ``mh.sliding_window(w)``, which is causal too), and-ed with the
key padding of ``attention_mask``. Both are bottom-right aligned, so the same mask serves a full
forward, a prefill into a KV cache and one-token decode steps. Positions count the real tokens of each
row (``attention_mask.cumsum(-1) - 1``, as Hugging Face does), so a left-padded row gets the positions of
the unpadded sequence; without a mask they are ``arange`` continuing from ``cache[0].position``.

Shape legend: B batch, N new tokens, P tokens seen before (cache position), T = P + N, L keys a layer
attends (T, or fewer with a sliding cache), d = d_model, V = vocab size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.masks import Mask, MaskContext, causal, sliding_window
from ..nn.kv_cache import KVCache
from ..nn.layers import TransformerLayer
from ..nn.norms import make_norm
from ..nn.positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions

__all__ = ["POSITION_KINDS", "TransformerLM", "left_pad"]

POSITION_KINDS = ("rotary", "learned", "sinusoidal", "none")


class _TrailingKeyPadding(Mask):
    """Key padding from a (B, T) real-token mask over all T tokens seen, read at the last Nk keys.

    The keys an attention call sees are the last ``Nk`` of those T positions (a dense cache holds all of
    them, a sliding cache the most recent ones), so key j is real iff ``real[b, j + T - Nk]``.
    """

    def __init__(self, real: Tensor):
        self.real = real

    def validate(self, ctx: MaskContext) -> None:
        B, T = self.real.shape
        if B != ctx.B or ctx.Nk > T:
            raise ValueError(
                f"attention_mask of shape {(B, T)} cannot cover B={ctx.B} rows and Nk={ctx.Nk} keys"
            )

    def evaluate(self, b, h, q, k, ctx):
        return self.real.to(k.device)[b, k + (self.real.shape[1] - ctx.Nk)]

    def default_size(self):
        B, T = self.real.shape
        return (B, T, T)

    def __repr__(self):
        return f"attention_mask({tuple(self.real.shape)})"


def _check_int(name: str, val: Any, low: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < low:
        raise ValueError(f"{name} must be an int >= {low}, got {val!r}")


def _as_real(attention_mask: Any, B: int, T: int, what: str) -> Tensor:
    """A (B, T) bool or 0/1 attention mask as bool (True = real token)."""
    am = attention_mask
    if not isinstance(am, Tensor) or tuple(am.shape) != (B, T):
        shape = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
        raise ValueError(f"attention_mask must have shape (B, T) = ({B}, {T}) ({what}), got {shape}")
    if am.dtype != torch.bool:
        if not bool(((am == 0) | (am == 1)).all()):
            raise ValueError("attention_mask must be bool or hold only 0 and 1 (1 = real token)")
        am = am != 0
    return am


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model; defaults are LLaMA's (RMSNorm, pre-LN, SwiGLU, RoPE).

    Args:
        vocab_size, d_model, n_layers, n_heads, d_ff: sizes; head dim is ``d_model // n_heads``.
        n_kv_heads: kv heads (GQA / MQA), default n_heads.
        max_len: longest sequence the learned / sinusoidal position tables cover.
        positions: "rotary" | "learned" | "sinusoidal" | "none".
        norm, norm_first, activation, bias, dropout: passed to every :class:`TransformerLayer`.
        tie_embeddings: share the embedding matrix with the output projection (GPT-2, small LLaMAs).
        rope_base: rotary base (10000 in RoFormer / LLaMA 2).
        sliding_window: if set, every layer attends to the last ``sliding_window`` tokens (Mistral).
        norm_eps: epsilon of every norm (GPT-2 1e-5, LLaMA / Mistral / Qwen2 1e-6).

    Raises:
        ValueError: unknown positions kind, non-dividing head counts, bad sizes, and what the layers raise.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        *,
        n_kv_heads: int | None = None,
        max_len: int = 2048,
        positions: str = "rotary",
        norm: str = "rmsnorm",
        norm_first: bool = True,
        activation: str = "swiglu",
        bias: bool = False,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
        rope_base: float = 10000.0,
        sliding_window: int | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        for name, val in (("vocab_size", vocab_size), ("n_layers", n_layers), ("max_len", max_len)):
            _check_int(name, val, 1)
        if positions not in POSITION_KINDS:
            raise ValueError(f"positions must be one of {list(POSITION_KINDS)}, got {positions!r}")
        if sliding_window is not None:
            _check_int("sliding_window", sliding_window, 1)
        _check_int("n_heads", n_heads, 1)
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}); change either")
        self.vocab_size, self.max_len, self.positions = vocab_size, max_len, positions
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = d_model // n_heads
        self.sliding_window = sliding_window
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed: nn.Module | None = None
        if positions == "learned":
            self.pos_embed = LearnedPositions(max_len, d_model)
        elif positions == "sinusoidal":
            self.pos_embed = SinusoidalPositions(d_model, max_len)
        rotary = RotaryEmbedding(self.head_dim, base=rope_base) if positions == "rotary" else None
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            TransformerLayer(
                d_model,
                n_heads,
                d_ff,
                n_kv_heads=n_kv_heads,
                norm=norm,
                norm_first=norm_first,
                activation=activation,
                dropout=dropout,
                bias=bias,
                rotary=rotary,
                norm_eps=norm_eps,
            )
            for _ in range(n_layers)
        )
        # Pre-LN leaves the residual stream un-normalised (GPT-2 ln_f, LLaMA norm); post-LN ends normed.
        self.final_norm = make_norm(norm, d_model, norm_eps) if norm_first else nn.Identity()
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases (norms keep their ones / zeros)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self, ids: Tensor, *, attention_mask: Tensor | None = None, cache: list[KVCache] | None = None
    ) -> Tensor:
        """Logits (B, N, V) for token ids (B, N).

        Args:
            ids: (B, N) integer token ids in [0, vocab_size).
            attention_mask: (B, T) bool or 0/1, 1 = real token, over every token seen: T = N without a
                cache, ``cache[0].position + N`` with one (the past tokens' mask followed by the new ones).
                Token positions count each row's real tokens, so a left-padded row gets exactly the
                positions (and, for rotary, the logits) of its unpadded sequence.
            cache: one ``KVCache`` per layer (from :meth:`make_cache`); ids are appended to it and their
                positions continue from ``cache[0].position``.

        Raises:
            ValueError: bad ids, an attention_mask of the wrong shape or values, a cache of the wrong
                length, positions past ``max_len`` for learned / sinusoidal positions.
        """
        return self.lm_head(self.hidden_states(ids, attention_mask=attention_mask, cache=cache))  # (B, N, V)

    def hidden_states(
        self, ids: Tensor, *, attention_mask: Tensor | None = None, cache: list[KVCache] | None = None
    ) -> Tensor:
        """The final-normed hidden states (B, N, d) that ``lm_head`` turns into logits; see :meth:`forward`.

        Generation calls this and projects only the last position (V x d per row instead of N x V x d).

        Raises:
            ValueError: as :meth:`forward`.
        """
        self._check_ids(ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries but the model has {len(self.layers)} layers")
        B, N = ids.shape
        past = 0 if cache is None else int(cache[0].position)
        real = None if attention_mask is None else _as_real(attention_mask, B, past + N, "T = cached + new")
        positions = None if real is None else (real.long().cumsum(-1) - 1).clamp_(min=0)[:, past:]  # (B, N)
        x = self.embed(ids)  # (B, N, d)
        if self.pos_embed is not None:
            pos = torch.arange(past, past + N, device=ids.device) if positions is None else positions
            top = int(pos.max()) + 1
            if top > self.max_len:
                raise ValueError(
                    f"positions up to {top} exceed max_len={self.max_len} of the {self.positions} "
                    "position table; build the model with a larger max_len"
                )
            x = x + self.pos_embed(pos)  # (B, N, d)
        x = self.drop(x)
        mask = self._mask(real)
        rope_pos = positions if self.positions == "rotary" else None
        for i, layer in enumerate(self.layers):
            x = layer(
                x, mask=mask, cache=None if cache is None else cache[i], positions=rope_pos
            )  # (B, N, d)
        return self.final_norm(x)  # (B, N, d)

    def _check_ids(self, ids: Any) -> None:
        integer = isinstance(ids, Tensor) and not ids.is_floating_point() and ids.dtype != torch.bool
        if not integer or ids.dim() != 2:
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"ids must be an integer tensor of shape (B, N), got {shape}; add a batch dim")
        if ids.shape[1] == 0:
            raise ValueError("ids has N=0 tokens; give at least one token")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"ids must lie in [0, vocab_size={self.vocab_size}), got min {lo} and max {hi}")

    def _mask(self, real: Tensor | None) -> Mask:
        """causal (or sliding window) & key padding of the (B, T) real-token mask, bottom-right aligned."""
        base = causal() if self.sliding_window is None else sliding_window(self.sliding_window)
        return base if real is None else base & _TrailingKeyPadding(real)

    # -- caching and generation -----------------------------------------------------------------
    def make_cache(self, batch_size: int, max_len: int, kind: str = "dense") -> list[KVCache]:
        """One ``KVCache`` per layer, on this model's device and dtype; kind "dense" | "sliding" | "int8".

        Raises:
            ValueError: ``kind="sliding"`` on a model without ``sliding_window``, and what KVCache raises.
        """
        if kind == "sliding" and self.sliding_window is None:
            raise ValueError("a 'sliding' cache needs a model built with sliding_window=...; use 'dense'")
        window = self.sliding_window if kind == "sliding" else None
        p = self.embed.weight
        return [
            KVCache(
                batch_size,
                self.n_kv_heads,
                self.head_dim,
                max_len,
                kind=kind,
                window=window,
                dtype=p.dtype,
                device=p.device,
            )
            for _ in self.layers
        ]

    @torch.no_grad()
    def generate(
        self,
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
        """Extend ids (B, N) by up to ``max_new_tokens`` tokens -> (B, N + new).

        Prefills the prompt in one pass, then feeds one token per step through the KV cache (``cache``
        names its kind, "dense" | "sliding" | "int8", preallocated for N + max_new_tokens positions; None
        recomputes the whole sequence every step). Greedy unless ``do_sample``, which samples from
        ``softmax(logits / temperature)`` restricted to the ``top_k`` best and the smallest set of
        probability >= ``top_p``. A row that emitted ``eos_token_id`` keeps emitting it; generation stops
        early once every row has. Runs in eval mode (no dropout) and restores the previous mode.

        Prompts of different lengths go in one batch left-padded: ``attention_mask`` (B, N), 0 on the pad
        tokens before each prompt (any pad id), 1 on the prompt; each row then generates exactly what its
        unpadded prompt alone would (see :func:`left_pad`).

        Raises:
            ValueError: bad ids, a negative max_new_tokens, sampling options without ``do_sample`` or
                out of range, an attention_mask that is not left padding or leaves a row empty.
        """
        self._check_ids(ids)
        _check_int("max_new_tokens", max_new_tokens, 0)
        self._check_sampling(do_sample, temperature, top_k, top_p)
        real = None if attention_mask is None else _check_left_padding(attention_mask, *ids.shape)
        was_training = self.training
        self.eval()
        try:
            sampling = (do_sample, temperature, top_k, top_p)
            return self._generate(ids, max_new_tokens, sampling, eos_token_id, cache, real)
        finally:
            self.train(was_training)

    def _generate(self, ids, max_new_tokens, sampling, eos_token_id, cache, real) -> Tensor:
        B, N = ids.shape
        total = N + max_new_tokens
        out = ids.new_empty(B, total)  # (B, N + new), preallocated and written by index
        out[:, :N] = ids
        if max_new_tokens == 0:
            return out
        am = None
        if real is not None:
            am = torch.ones(B, total, dtype=torch.bool, device=ids.device)  # (B, N + new)
            am[:, :N] = real
        caches = None if cache is None else self.make_cache(B, total, kind=cache)
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        h = self.hidden_states(ids, attention_mask=None if am is None else am[:, :N], cache=caches)  # prefill
        for t in range(N, total):
            nxt = self._pick(self.lm_head(h[:, -1]), *sampling)  # (B,) from the last position's logits
            if eos_token_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                finished |= nxt == eos_token_id
            out[:, t] = nxt
            if t == total - 1 or (eos_token_id is not None and bool(finished.all())):
                return out[:, : t + 1]
            seen = None if am is None else am[:, : t + 1]  # (B, t + 1)
            if caches is None:  # a full recompute of the sequence so far
                h = self.hidden_states(out[:, : t + 1], attention_mask=seen)  # (B, t + 1, d)
            else:  # one-token decode step on the cache
                h = self.hidden_states(out[:, t : t + 1], attention_mask=seen, cache=caches)  # (B, 1, d)
        return out

    @staticmethod
    def _check_sampling(do_sample, temperature, top_k, top_p) -> None:
        if not do_sample and (temperature != 1.0 or top_k is not None or top_p is not None):
            raise ValueError(
                f"temperature={temperature}, top_k={top_k}, top_p={top_p} only apply when sampling; "
                "pass do_sample=True or drop them for greedy decoding"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}; use do_sample=False for greedy")
        if top_k is not None:
            _check_int("top_k", top_k, 1)
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")

    @staticmethod
    def _pick(logits: Tensor, do_sample: bool, temperature: float, top_k, top_p) -> Tensor:
        """Next token per row (B,) from last-position logits (B, V)."""
        if not do_sample:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature  # (B, V)
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


def _check_left_padding(attention_mask: Any, B: int, N: int) -> Tensor | None:
    """Validate a generate() prompt mask: (B, N), every row 0s then at least one 1. None if all real."""
    real = _as_real(attention_mask, B, N, "the prompt's shape")
    if bool(real.all()):
        return None
    if not bool(real[:, -1].all()) or bool((real[:, :-1] & ~real[:, 1:]).any()):
        bad = [r for r in range(B) if not bool(real[r, -1]) or bool((real[r, :-1] & ~real[r, 1:]).any())]
        raise ValueError(
            f"attention_mask rows {bad} are not left-padded: generate() needs each row to be pad tokens "
            "(0) followed by at least one prompt token (1); pad prompts on the left (see left_pad())"
        )
    return real


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Batch prompts of different lengths for :meth:`TransformerLM.generate`: left padding.

    Returns ``ids`` (B, N) and ``attention_mask`` (B, N) bool, N the longest prompt, each row
    ``[pad_id] * (N - len) + prompt`` with mask False on the pads.

    Raises:
        ValueError: no prompts, or an empty prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        lengths = [len(p) for p in prompts]
        raise ValueError(f"left_pad needs at least one prompt and no empty prompt, got lengths {lengths}")
    N = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), N), pad_id, dtype=torch.long)  # (B, N)
    mask = torch.zeros(len(prompts), N, dtype=torch.bool)  # (B, N)
    for r, p in enumerate(prompts):
        ids[r, N - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[r, N - len(p) :] = True
    return ids, mask
