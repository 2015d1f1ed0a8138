"""``TransformerLM``: a decoder-only language model (GPT-2 / LLaMA / Mistral shape).

    ids (B, N) -> embed (+ learned / sinusoidal positions) -> n_layers x TransformerLayer (causal,
    rotary in the attention) -> final norm (pre-LN) -> lm_head (tied to the embedding) -> logits (B, N, V)

Masking is explicit: ``mh.causal()`` (or ``mh.sliding_window(w)``, which is causal too), and-ed with the
key padding of ``attention_mask``. Both are bottom-right aligned, so the same mask serves a full
forward, a prefill into a KV cache and one-token decode steps. Positions count the real tokens of each
row (``attention_mask.cumsum(-1) - 1``, as Hugging Face does), so a left-padded row gets the positions of
the unpadded sequence; without a mask they are ``arange`` continuing from ``cache[0].position``.
The generation loop is :mod:`multihead.models.generation`; real-token masks are :mod:`.padding`.

Shape legend: B batch, N new tokens, P tokens seen before (cache position), T = P + N, L keys a layer
attends (T, or fewer with a sliding cache), d = d_model, V = vocab size.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.checks import check_int, check_size
from ..core.limits import check_fits
from ..core.masks import Mask, causal, sliding_window
from ..nn.attention import MultiHeadAttention
from ..nn.kv_cache import KINDS, KVCache, cache_bytes
from ..nn.layers import TransformerLayer
from ..nn.norms import make_norm
from ..nn.positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions
from . import native_greedy, native_step
from .gemv_linear import GemvLinear
from .generation import generate
from .lm_config import LMConfig, check_weights_fit, config_of
from .padding import TrailingKeyPadding, as_real

__all__ = ["POSITION_KINDS", "LMConfig", "TransformerLM"]

POSITION_KINDS = ("rotary", "learned", "sinusoidal", "none")


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model; defaults are LLaMA's (RMSNorm, pre-LN, SwiGLU, RoPE).

    Takes an :class:`~multihead.models.lm_config.LMConfig` (``TransformerLM(config, attention=...)``), or
    its fields as arguments (``TransformerLM(vocab_size, d_model, n_layers, n_heads, d_ff, n_kv_heads=2)``);
    either way ``model.config`` is the LMConfig it was built from (surgery that changes every layer's kv
    heads updates its ``n_kv_heads``; one that makes layers differ, such as pruning, is recorded as steps).

    Args:
        vocab_size, d_model, n_layers, n_heads, d_ff: sizes; head dim is ``d_model // n_heads``
            (``vocab_size`` may be an LMConfig instead, then the only other argument is ``attention``).
        n_kv_heads: kv heads (GQA / MQA), default n_heads.
        max_len: longest sequence the learned / sinusoidal position tables cover.
        positions: "rotary" | "learned" | "sinusoidal" | "none".
        norm, norm_first, activation, bias, dropout: passed to every :class:`TransformerLayer`.
        tie_embeddings: share the embedding matrix with the output projection (GPT-2, small LLaMAs).
        rope_base: rotary base (10000 in RoFormer / LLaMA 2).
        sliding_window: if set, every layer attends to the last ``sliding_window`` tokens (Mistral).
        norm_eps: epsilon of every norm (GPT-2 1e-5, LLaMA / Mistral / Qwen2 1e-6).
        attention: builds layer i's self-attention, called with i = 0 .. n_layers - 1 (e.g. ``lambda i:
            mh.variants.LatentAttention(d_model, n_heads, kv_rank=64, rope_theta=1e4)``); default a
            MultiHeadAttention from the arguments above. A module with a ``make_cache(batch_size, max_len,
            *, kind, window, dtype, device)`` method builds its own layer's cache in :meth:`make_cache`.

    Raises:
        ValueError: unknown positions kind, non-dividing head counts, bad sizes, an unknown option, a
            config given with sizes or options, and what the layers raise.
    """

    def __init__(
        self,
        vocab_size: int | LMConfig,
        d_model: int | None = None,
        n_layers: int | None = None,
        n_heads: int | None = None,
        d_ff: int | None = None,
        *,
        attention: Callable[[int], MultiHeadAttention] | None = None,
        **options: Any,
    ):
        super().__init__()
        c = self.config = config_of(vocab_size, (d_model, n_layers, n_heads, d_ff), options)
        for name, val in (("vocab_size", c.vocab_size), ("n_layers", c.n_layers), ("max_len", c.max_len)):
            check_size(name, val, 1, owner="TransformerLM")
        if c.positions not in POSITION_KINDS:
            raise ValueError(f"positions must be one of {list(POSITION_KINDS)}, got {c.positions!r}")
        if c.sliding_window is not None:
            check_int("sliding_window", c.sliding_window, 1)
        check_int("n_heads", c.n_heads, 1)
        if c.d_model % c.n_heads != 0:
            raise ValueError(
                f"d_model ({c.d_model}) must be divisible by n_heads ({c.n_heads}); change either"
            )
        tables = c.max_len if c.positions in ("learned", "sinusoidal") else 0
        check_weights_fit(c.vocab_size, c.d_model, c.n_layers, c.d_ff, tables)
        self.vocab_size, self.max_len, self.positions = c.vocab_size, c.max_len, c.positions
        self.head_dim = c.d_model // c.n_heads
        self.sliding_window = c.sliding_window
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_embed: nn.Module | None = None
        if c.positions == "learned":
            self.pos_embed = LearnedPositions(c.max_len, c.d_model)
        elif c.positions == "sinusoidal":
            self.pos_embed = SinusoidalPositions(c.d_model, c.max_len)
        rotary = RotaryEmbedding(self.head_dim, base=c.rope_base) if c.positions == "rotary" else None
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            TransformerLayer(
                c.d_model,
                c.n_heads,
                c.d_ff,
                n_kv_heads=c.n_kv_heads,
                norm=c.norm,
                norm_first=c.norm_first,
                activation=c.activation,
                dropout=c.dropout,
                bias=c.bias,
                rotary=rotary,
                norm_eps=c.norm_eps,
                self_attn=None if attention is None else attention(i),
            )
            for i in range(c.n_layers)
        )
        # Pre-LN leaves the residual stream un-normalised (GPT-2 ln_f, LLaMA norm); post-LN ends normed.
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.norm_first else nn.Identity()
        # an nn.Linear whose calls of 1-4 rows (a decode step's or a small batch's logits) run the native GEMV
        self.lm_head = GemvLinear(c.d_model, c.vocab_size, bias=False)
        self.apply(self._init_weights)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def n_kv_heads(self) -> int:
        """The kv heads of every layer (what :meth:`make_cache` sizes its caches by): the config's."""
        return self.config.n_heads if self.config.n_kv_heads is None else self.config.n_kv_heads

    @n_kv_heads.setter
    def n_kv_heads(self, value: int) -> None:  # surgery that changes every layer's kv heads (to_gqa)
        self.config = dataclasses.replace(self.config, n_kv_heads=value)

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
        self.check_ids(ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} entries but the model has {len(self.layers)} layers")
        if cache is not None and self._native_step_fits(ids, attention_mask, cache):
            return native_step.decode_step(self, ids, cache)  # (B, N, d), B or N 1
        B, N = ids.shape
        past = 0 if cache is None else int(cache[0].position)
        real = None if attention_mask is None else as_real(attention_mask, B, past + N, "T = cached + new")
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

    #: one-token batch-1 decode steps run as one native call for all layers (:mod:`.native_step`) where the
    #: model and the call allow it (:attr:`why_not_native_steps`); False: always the eager layers. The
    #: first such step asks Linux to back the streamed weights with 2 MiB pages where they lie
    #: (:func:`multihead.native.hugepages.collapse`: same addresses, about 3 ms per MiB once)
    native_steps: bool = True
    #: the KV cache :meth:`make_cache` and :meth:`generate` build by default: "dense", or "int8" for a model
    #: whose attention rounds keys and values to int8 (``mh.quant.quantize(model, kv="int8")`` sets it)
    cache_kind: str = "dense"
    #: the caches' dtype; None: the input embedding's (a model whose embedding holds int8 or GGUF-block rows
    #: has no float weight to ask, so its quantizer or loader sets it)
    cache_dtype: torch.dtype | None = None
    #: the approximation every attention runs, which a native step must reproduce (``KVInt8``: exact
    #: attention on int8-rounded keys and values, the steps then on an int8 cache); None: exact attention
    kv_approx: type | None = None
    #: ids :meth:`generate` stops at by default (end of sequence, end of turn); () for a model that has
    #: none. Loaders that know them set it (:func:`multihead.pretrained.from_gguf`).
    eos_token_ids: tuple[int, ...] = ()
    #: the model's tokenizer where its loader has one (:class:`multihead.pretrained.GGUFTokenizer`:
    #: ``encode``, ``decode``, ``apply_chat_template``), else None
    tokenizer: Any = None

    @property
    def why_not_native_steps(self) -> str | None:
        """None when one-token decode steps run natively (the same numbers up to the order of the sums,
        fewer Python calls per step), else why they run the eager layers."""
        if not self.native_steps:
            return "native_steps is off for this model (mh.quant.quantize turns it on with kernel='native')"
        return native_step.why_not_model(self, self.kv_approx)

    def _native_step_fits(self, ids: Tensor, attention_mask: Tensor | None, cache: list[KVCache]) -> bool:
        """Whether this call is a native decode step. The model's structure is checked once per list
        of caches (once per generation), the call on every step (cheap)."""
        if not self.native_steps or self.training:
            return False
        memo = self.__dict__.get("_native_memo")
        if memo is None or memo[0]() is not cache[0]:
            memo = (weakref.ref(cache[0]), native_step.why_not_model(self, self.kv_approx))
            self.__dict__["_native_memo"] = memo
            if memo[1] is None:  # weights this model's steps stream: 2 MiB pages, once per storage
                native_step.huge_pages(self)
        return (
            memo[1] is None
            and native_step.why_not_call(self, ids, attention_mask, cache, self.cache_kind) is None
        )

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state, without the native step's memos (weak references to the last caches)."""
        state = dict(self.__dict__)
        for memo in ("_native_memo", "_native_caches", "_native_hugepages", "_native_plan"):
            state.pop(memo, None)
        return state

    def check_ids(self, ids: Any) -> None:
        """Raise ValueError unless ``ids`` is an integer (B, N) tensor, N >= 1, of ids in [0, vocab_size)."""
        if not isinstance(ids, Tensor):
            raise ValueError(
                f"ids must be an integer tensor of shape (B, N), got a {type(ids).__name__}; "
                "pass torch.tensor([token_ids])"
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"ids must hold integer token ids, got dtype {ids.dtype} of shape {tuple(ids.shape)}; "
                "convert them with ids.long() (token ids are indices into the vocabulary)"
            )
        if ids.dim() != 2:
            fix = "add a batch dim: ids[None]" if ids.dim() == 1 else "pass a (batch, tokens) tensor"
            raise ValueError(f"ids must have shape (B, N), got {tuple(ids.shape)}; {fix}")
        if ids.shape[1] == 0:
            raise ValueError("ids has N=0 tokens; give at least one token")
        if ids.shape[0] == 0:
            raise ValueError(f"ids of shape {tuple(ids.shape)} has B=0 rows; give at least one sequence")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"ids must lie in [0, vocab_size={self.vocab_size}), got min {lo} and max {hi}")

    def _mask(self, real: Tensor | None) -> Mask:
        """causal (or sliding window) & key padding of the (B, T) real-token mask, bottom-right aligned."""
        base = causal() if self.sliding_window is None else sliding_window(self.sliding_window)
        return base if real is None else base & TrailingKeyPadding(real)

    # -- caching and generation -----------------------------------------------------------------
    def make_cache(self, batch_size: int, max_len: int, kind: str | None = None) -> list[KVCache]:
        """One ``KVCache`` per layer, on this model's device, in :attr:`cache_dtype` (default the
        embedding's dtype); kind "dense" | "sliding" | "int8", None: the model's :attr:`cache_kind`.

        A layer whose self-attention has a ``make_cache`` method (a design with its own cache, such as
        :class:`~multihead.variants.LatentAttention`) gets the cache that method builds.

        Raises:
            ValueError: ``kind="sliding"`` on a model without ``sliding_window``, caches of all layers
                larger than the free memory, and what KVCache raises.
        """
        kind = self.cache_kind if kind is None else kind
        if kind == "sliding" and self.sliding_window is None:
            raise ValueError("a 'sliding' cache needs a model built with sliding_window=...; use 'dense'")
        window = self.sliding_window if kind == "sliding" else None
        dtype = self.embed.weight.dtype if self.cache_dtype is None else self.cache_dtype
        device = self._device()
        own = [getattr(layer.self_attn, "make_cache", None) for layer in self.layers]
        # each layer's own kv heads: head pruning can leave layers with different counts
        kv = [getattr(layer.self_attn, "n_kv_heads", 0) or self.n_kv_heads for layer in self.layers]
        plain = [n for make, n in zip(own, kv) if not callable(make)]
        if plain and kind in KINDS and isinstance(batch_size, int) and isinstance(max_len, int):
            slots = max(window if window is not None else max_len, 0)
            total = sum(
                cache_bytes(batch_size, n, self.head_dim, self.head_dim, slots, kind, dtype) for n in plain
            )
            what = f"a {kind} KV cache of {len(plain)} layers x {batch_size} rows x {slots} positions"
            check_fits(total, what, "lower max_new_tokens or the batch, or use cache='int8'", device)
        return [
            make(batch_size, max_len, kind=kind, window=window, dtype=dtype, device=device)
            if callable(make)
            else KVCache(
                batch_size,
                n_kv,
                self.head_dim,
                max_len,
                kind=kind,
                window=window,
                dtype=dtype,
                device=device,
            )
            for make, n_kv in zip(own, kv)
        ]

    def _device(self) -> torch.device:
        """The device the model runs on: its first parameter's or buffer's (int8 weights are buffers)."""
        return next(iter([*self.parameters(), *self.buffers()])).device

    def greedy_steps(
        self, h: Tensor, out: Tensor, t: int, steps: int, last: bool, eos: int | None, cache: list[KVCache]
    ) -> tuple[int, Tensor] | None:
        """Up to ``steps`` greedy batch-1 tokens in one native call (the decode loop's fast path,
        :func:`multihead.models.native_greedy.greedy_steps`): written to ``out[0, t : t + picked]``, the
        caches advanced; returns ``(picked, h)`` with h (1, 1, d) the state after the last step (none
        after ``eos`` or, when ``last``, after the last pick). None where the native run does not apply
        (:func:`~multihead.models.native_greedy.why_not_greedy`): the caller takes the step itself. The
        same tokens, caches and states as :func:`~multihead.models.generation.pick_next` on
        ``lm_head`` and one :meth:`hidden_states` call per token.

        Raises:
            ValueError: the native library cannot allocate its memory.
        """
        if h.dim() != 3 or h.shape[0] != 1 or h.dtype != self.final_norm.weight.dtype:
            return None
        if not self._native_step_fits(native_step.ONE_ID, None, cache):  # a native step would run
            return None
        if native_greedy.why_not_greedy(self) is not None:  # and the head and the embedding are native's
            return None
        return native_greedy.greedy_steps(self, h, out, t, steps, last, eos, cache)

    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        cache: str | None = "auto",
        attention_mask: Tensor | None = None,
        streamer: Callable[[Tensor], Any] | None = None,
    ) -> Tensor:
        """Extend ids (B, N) by up to ``max_new_tokens`` tokens -> (B, N + new).

        Prefills the prompt in one pass, then feeds one token per step through the KV cache (``cache``
        names its kind, "dense" | "sliding" | "int8", preallocated for N + max_new_tokens positions;
        "auto", the default, is the model's :attr:`cache_kind`; None recomputes the whole sequence every
        step). Greedy unless ``do_sample``, which samples from
        ``softmax(logits / temperature)`` restricted to the ``top_k`` best and the smallest set of
        probability >= ``top_p``. Runs in eval mode (no dropout) and restores the previous mode.

        Stops: ``eos_token_id=None`` (the default) stops at the model's :attr:`eos_token_ids` (a model
        read by :func:`multihead.pretrained.from_gguf` knows its end-of-sequence and end-of-turn ids,
        e.g. SmolLM2's ``<|im_end|>`` and ``<|endoftext|>``; other models have none and run to
        ``max_new_tokens``). An id or a list of ids given here stops at those instead; ``()`` never
        stops early. A row that emitted a stop id keeps emitting it; generation ends once every row has.

        Streaming: ``streamer(tokens)`` is called with each new token column, a (B,) tensor, as soon as
        it is picked (before the next step), e.g. ``streamer=lambda t: print(tok.decode(t.tolist()))``;
        the returned ids are the same as without it.

        Prompts of different lengths go in one batch left-padded: ``attention_mask`` (B, N), 0 on the pad
        tokens before each prompt (any pad id), 1 on the prompt; each row then generates exactly what its
        unpadded prompt alone would (see :func:`multihead.left_pad`).

        Sampling is computed from ``logits - max(logits)`` in float64, so any finite temperature > 0
        is exact: a tiny one picks the best token (ties shared), never NaN.

        Raises:
            ValueError: bad ids (an empty batch included), a negative max_new_tokens or one past the
                model's ``max_len``, sampling options without ``do_sample`` or out of range (temperature
                finite and > 0, top_k >= 1, top_p in (0, 1]), an ``eos_token_id`` that is not an id
                >= 0 or a list of them, a ``streamer`` that is not callable, an attention_mask that is
                not left padding or leaves a row empty, an output or a KV cache larger than the free
                memory (checked before anything is allocated).
        """
        return generate(
            self,
            ids,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            cache=self.cache_kind if cache == "auto" else cache,
            attention_mask=attention_mask,
            streamer=streamer,
        )
