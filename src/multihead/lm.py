"""``TransformerLM``: a decoder-only language model (GPT-2 / LLaMA / Mistral shape) and its generation loop.

    ids (B, N) -> embed (+ learned / sinusoidal positions) -> n_layers x TransformerLayer (causal,
    rotary in the attention) -> final norm (pre-LN) -> lm_head (tied to the embedding) -> logits (B, N, V)

Masking is explicit: ``mh.causal()`` (or ``mh.sliding_window(w)``, which is causal too), and-ed with the
key padding of ``attention_mask``. Both are bottom-right aligned, so the same mask serves a full
forward, a prefill into a KV cache and one-token decode steps. With a cache the positions continue from
``cache[0].position``.

Shape legend: B batch, N new tokens, P tokens seen before (cache position), T = P + N, L keys a layer
attends (T, or fewer with a sliding cache), d = d_model, V = vocab size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kv_cache import KVCache
from .layers import TransformerLayer
from .masks import Mask, MaskContext, causal, sliding_window
from .norms import make_norm
from .positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions

__all__ = ["POSITION_KINDS", "TransformerLM"]

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
            )
            for _ in range(n_layers)
        )
        # Pre-LN leaves the residual stream un-normalised (GPT-2 ln_f, LLaMA norm); post-LN ends normed.
        self.final_norm = make_norm(norm, d_model) if norm_first else nn.Identity()
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
                Positions stay ``arange``: with left padding rotary is unaffected (it is relative), learned
                and sinusoidal positions are shifted by the pad count.
            cache: one ``KVCache`` per layer (from :meth:`make_cache`); ids are appended to it and their
                positions continue from ``cache[0].position``.

        Raises:
            ValueError: bad ids, an attention_mask of the wrong shape or values, a cache of the wrong
                length, positions past ``max_len`` for learned / sinusoidal positions.
        """
        self._check_ids(ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries but the model has {len(self.layers)} layers")
        B, N = ids.shape
        past = 0 if cache is None else int(cache[0].position)
        x = self.embed(ids)  # (B, N, d)
        if self.pos_embed is not None:
            if past + N > self.max_len:
                raise ValueError(
                    f"positions up to {past + N} exceed max_len={self.max_len} of the {self.positions} "
                    "position table; build the model with a larger max_len"
                )
            x = x + self.pos_embed(torch.arange(past, past + N, device=ids.device))  # (B, N, d)
        x = self.drop(x)
        mask = self._mask(attention_mask, B, past + N)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask=mask, cache=None if cache is None else cache[i])  # (B, N, d)
        return self.lm_head(self.final_norm(x))  # (B, N, V)

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

    def _mask(self, attention_mask: Tensor | None, B: int, T: int) -> Mask:
        """causal (or sliding window) & key padding, all bottom-right aligned."""
        base = causal() if self.sliding_window is None else sliding_window(self.sliding_window)
        if attention_mask is None:
            return base
        am = attention_mask
        if not isinstance(am, Tensor) or tuple(am.shape) != (B, T):
            shape = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
            raise ValueError(
                f"attention_mask must have shape (B, T) = ({B}, {T}) (T = cached + new tokens), got {shape}"
            )
        if am.dtype != torch.bool:
            if not bool(((am == 0) | (am == 1)).all()):
                raise ValueError("attention_mask must be bool or hold only 0 and 1 (1 = real token)")
            am = am != 0
        return base & _TrailingKeyPadding(am)

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
    ) -> Tensor:
        """Extend ids (B, N) by up to ``max_new_tokens`` tokens -> (B, N + new).

        Prefills the prompt in one pass, then feeds one token per step through the KV cache (``cache``
        names its kind; None recomputes the whole sequence every step). Greedy unless ``do_sample``,
        which samples from ``softmax(logits / temperature)`` restricted to the ``top_k`` best and the
        smallest set of probability >= ``top_p``. A row that emitted ``eos_token_id`` keeps emitting
        it; generation stops early once every row has. Runs in eval mode (no dropout) and restores the
        previous mode.

        Raises:
            ValueError: bad ids, a negative max_new_tokens, sampling options without ``do_sample`` or
                out of range.
        """
        self._check_ids(ids)
        _check_int("max_new_tokens", max_new_tokens, 0)
        self._check_sampling(do_sample, temperature, top_k, top_p)
        was_training = self.training
        self.eval()
        try:
            return self._generate(
                ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, cache
            )
        finally:
            self.train(was_training)

    def _generate(self, ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, cache):
        B, N = ids.shape
        caches = None if cache is None else self.make_cache(B, N + max_new_tokens, kind=cache)
        out = ids
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        if max_new_tokens == 0:
            return out.clone()
        logits = self(ids, cache=caches)[:, -1]  # (B, V): prefill
        for step in range(max_new_tokens):
            nxt = self._pick(logits, do_sample, temperature, top_k, top_p)  # (B,)
            if eos_token_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                finished |= nxt == eos_token_id
            out = torch.cat([out, nxt[:, None].to(out.dtype)], dim=1)  # (B, N + step + 1)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            # one-token decode through the cache, or a full recompute without one
            step_logits = self(out) if caches is None else self(out[:, -1:], cache=caches)  # (B, n, V)
            logits = step_logits[:, -1]  # (B, V)
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
