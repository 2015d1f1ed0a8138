"""``MultiHeadAttention``: the parameters of eq. (3)-(5) around the functional core ``mh.attention``.

    Q^i = X W_Qi,  K^i = X W_Ki,  V^i = X W_Vi                                  (eq. (3))
    head_i = softmax(Q^i K^iT / sqrt(d_k)) V^i                                  (eq. (4))
    MultiHeadAttention(X) = (head_1 (+) ... (+) head_h) W^O                     (eq. (5))

The three projections are one fused ``qkv_proj`` Linear (one matmul instead of three). Its output rows
are ``[q | k | v]``: ``Hq*D`` query rows, then ``Hkv*D`` key rows, then ``Hkv*D`` value rows, each block
ordered head by head. Self-attention runs the whole fused matmul on ``x``; cross-attention uses the q rows
on ``x`` and the k/v rows on ``context``. State dicts with separate ``q_proj`` / ``k_proj`` / ``v_proj``
keys (Hugging Face LLaMA style) load through a pre-hook that fuses them, and
:meth:`MultiHeadAttention.split_state_dict` exports that form back (both in :mod:`multihead.nn.qkv_state`;
the argument checks are :mod:`multihead.nn.attention_checks`).

GQA / MQA: ``n_kv_heads`` kv heads shared by groups of ``G = Hq // Hkv`` query heads; query head i reads
kv head ``i // G``. K/V are never repeated here, the core handles the grouping.

Learned attention sinks (``sinks=True``; OpenAI 2025, gpt-oss model card): a parameter ``sinks`` of one
logit per query head that joins each row's softmax denominator as an extra column with value 0
(``p_j = exp(s_j) / (exp(sink_h) + sum_j exp(s_j))``), so a head can put attention "nowhere" instead of
on the first tokens (the attention-sink phenomenon of Xiao et al. 2024, "Efficient Streaming Language
Models with Attention Sinks"). :meth:`attend` passes it to the core on every call, cached decode included.

**A template of named steps.** :meth:`~MultiHeadAttention.forward` reads as the equations::

    check_call(x, context, cache, positions, head_mask)       the arguments, before any work
    heads(x, context, ...)            -> (B, Hq, N, Dv)       head_1 .. head_h, eq. (3)-(4):
        project(x, context)           -> q, k, v              eq. (3)
        apply_positions(q, k, ...)    -> q, k                 rotary (self-attention only)
        update_cache(cache, k, v)     -> k, v                 append to a KVCache, attend over all of it
        attend(q, k, v, ...)          -> (B, Hq, N, Dv)       eq. (2) / (4): ``mh.attention``
    mix_heads(a, x, head_mask)        -> (B, Hq, N, Dv)       per-head scaling before W^O (head_mask)
    output(a)                         -> (B, N, d)            merge_heads, W^O of eq. (5), dropout

A head design subclasses this module and overrides only the steps it changes (as the designs of
:mod:`multihead.variants` do)::

    attend           the scores or the weights: talking heads, DCMHA, overlapping heads, differential
                     attention (a difference of two softmax maps)
    mix_heads        a gate or a mix of the head outputs computed from x: hard-concrete head gates,
                     output-gated attention (a sigmoid gate from x on each head before W^O)
    project          other projections: collaborative heads, multi-head latent attention (with
                     update_cache for a cache of latents, apply_positions for its decoupled rotary)
    heads            which (token, head) pairs are computed at all: mixture of heads

:attr:`MultiHeadAttention.textbook` tells the tools that rewrite the textbook steps (approximations,
tensor parallelism, the cost model, attention capture) whether a module keeps them.

Shape legend: B batch, N query tokens, M context tokens, L keys attended (M, N, or the cache length),
d = d_model, Hq query heads, Hkv kv heads, G = Hq // Hkv, D head dim, Dv per-head output width (D here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.functional import attention
from ..core.masks import Mask
from .attention_checks import check_call_arguments, check_model_input, check_sinks, head_shape
from .feed_forward import check_dropout
from .positions import RotaryEmbedding
from .qkv_state import fuse_split_qkv, split_qkv

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["MultiHeadAttention", "check_model_input"]


class MultiHeadAttention(nn.Module):
    """Multi-head (MHA), grouped-query (GQA) and multi-query (MQA) attention, self or cross.

    Args:
        d_model: model width d of the input and output.
        n_heads: query heads Hq.
        n_kv_heads: key/value heads Hkv (default Hq: MHA; 1: MQA; in between: GQA). Must divide Hq.
        head_dim: per-head width D; default ``d_model // n_heads`` (which must then divide exactly).
            Given explicitly it is used as is, so ``Hq * D`` may differ from d_model.
        bias: biases on the projections (LLaMA / PaLM: none).
        dropout: attention-weight dropout and output dropout (after W^O), training only.
        rotary: a ``RotaryEmbedding(head_dim)`` applied to q and k in self-attention (not to
            cross-attention), or any module with ``forward(x, positions)``.
        backend: passed to :func:`multihead.attention`: "auto" (picks per call), a backend name, or a
            backend object such as an approximation from :mod:`multihead.approx`; one that is an
            ``nn.Module`` is the submodule ``approx``, so a learned Linformer's projections are parameters
            of this module (``approx.proj_k``). :func:`multihead.approx.apply` sets it on a whole model.
        sinks: learn attention sinks (gpt-oss): a parameter ``sinks`` of shape (n_heads,), initialised to
            zeros (pretrained values are loaded over it; state-dict key ``sinks``), passed as
            ``mh.attention(..., sinks=self.sinks)``. False (the default): ``self.sinks`` is None.

    Raises:
        ValueError: head counts that do not divide, a d_model not divisible by n_heads without an
            explicit head_dim, dropout outside [0, 1), a backend that is neither "auto", a registered
            name nor a backend object, ``sinks`` not a bool, or ``sinks=True`` on a subclass that
            overrides :meth:`attend` (it computes its own weights, with no sink term).
    """

    #: True when q, k, v come from ``qkv_proj`` and the heads are the attention of eq. (4) (only
    #: :meth:`mix_heads` may differ): tools that rewrite those steps (:func:`multihead.approx.apply`,
    #: tensor parallelism, the cost model, :func:`multihead.heads.capture_attention`) accept the module.
    textbook: ClassVar[bool] = True
    #: score scale passed to :func:`multihead.attention`; None: 1/sqrt(D) of the q that reaches it.
    score_scale: float | None = None

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
        sinks: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        owner = type(self).__name__
        check_sinks(owner, sinks, overrides_attend=type(self).attend is not MultiHeadAttention.attend)
        n_kv_heads, head_dim = head_shape(owner, d_model, n_heads, n_kv_heads, head_dim)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.dropout = check_dropout(dropout)
        self.backend = backend  # validated by the setter; an nn.Module backend becomes ``self.approx``
        if isinstance(rotary, RotaryEmbedding) and rotary.head_dim != head_dim:
            raise ValueError(
                f"{owner} rotary rotates {rotary.head_dim} features per head but head_dim is {head_dim}; "
                f"build it as RotaryEmbedding({head_dim})"
            )
        self.rotary = rotary
        fk = {"bias": bias, "device": device, "dtype": dtype}
        self.qkv_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, **fk)  # W^Q|W^K|W^V
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, **fk)  # W^O of eq. (5)
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.zeros(n_heads, device=device, dtype=dtype)) if sinks else None
        )  # (Hq,) attention-sink logits
        self.out_dropout = nn.Dropout(self.dropout)
        self.register_load_state_dict_pre_hook(fuse_split_qkv)

    # -- the fused projection ----------------------------------------------------------------------
    def _slices(self) -> tuple[slice, slice, slice]:
        q_rows, kv_rows = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return slice(0, q_rows), slice(q_rows, q_rows + kv_rows), slice(q_rows + kv_rows, None)

    def query_rows(self, heads: slice | None = None) -> tuple[Tensor, Tensor | None]:
        """W^Q rows (h*D, d) and bias (h*D,) or None of the query heads ``heads`` (default: all Hq)."""
        heads = slice(0, self.n_heads) if heads is None else heads
        rows = slice(heads.start * self.head_dim, heads.stop * self.head_dim)
        b = self.qkv_proj.bias
        return self.qkv_proj.weight[rows], None if b is None else b[rows]

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """eq. (3) for all heads at once: q (B, N, Hq*D), k and v (B, M, Hkv*D)."""
        sq, sk, sv = self._slices()
        if context is None:
            qkv = self.qkv_proj(x)  # (B, N, (Hq + 2 Hkv) D)
            return qkv[..., sq], qkv[..., sk], qkv[..., sv]
        q = F.linear(x, *self.query_rows())  # (B, N, Hq*D)
        return (q, *self._project_kv(context))

    def _project_kv(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """The k/v rows of the fused projection on src (B, M, d): k and v (B, M, Hkv*D)."""
        start, (w, b) = self._slices()[1].start, (self.qkv_proj.weight, self.qkv_proj.bias)
        kv = F.linear(src, w[start:], None if b is None else b[start:])  # (B, M, 2 Hkv D)
        k, v = kv.split(self.n_kv_heads * self.head_dim, dim=-1)  # 2 x (B, M, Hkv*D)
        return k, v

    @staticmethod
    def split_heads(t: Tensor, n_heads: int) -> Tensor:
        """(B, T, H*D) -> (B, H, T, D): the heads of a projection as a batch dim."""
        return t.reshape(t.shape[0], t.shape[1], n_heads, -1).transpose(1, 2)  # (B, H, T, D)

    def project_queries(self, x: Tensor, heads: slice | None = None) -> Tensor:
        """Q^i = X W_Qi of eq. (3) for the query heads ``heads`` (default all): (B, N, d) -> (B, h, N, D)."""
        q = F.linear(x, *self.query_rows(heads))  # (B, N, h*D)
        return self.split_heads(q, q.shape[-1] // self.head_dim)  # (B, h, N, D)

    def project_keys_values(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """K^i, V^i of eq. (3) from the keys' input src (B, M, d): k and v (B, Hkv, M, D)."""
        k, v = self._project_kv(src)  # 2 x (B, M, Hkv*D)
        return self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)

    def split_state_dict(self) -> dict[str, Tensor]:
        """This module's state dict with ``qkv_proj.*`` split into ``q_proj``, ``k_proj``, ``v_proj``.

        The inverse of the loading hook: ``other.load_state_dict(m.split_state_dict())`` round-trips, and
        the keys match separate-projection models (Hugging Face LLaMA ``self_attn.{q,k,v,o}_proj``).
        """
        return split_qkv(self.state_dict(), self._slices())

    # -- forward: the steps in the order of eq. (3)-(5) ---------------------------------------------
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """Attend from ``x`` to itself (or to ``context``) and project back: (B, N, d) -> (B, N, d).

        Args:
            x: (B, N, d) queries' input (and keys'/values' input in self-attention).
            context: (B, M, d) keys'/values' input for cross-attention; no rotary is applied then.
            mask: a :class:`Mask` or bool tensor broadcastable to (B, Hq, N, L), True = may attend.
                Nothing is implied: pass ``mh.causal()`` for a decoder (bottom-right aligned, so the same
                mask serves prefill and cached decode).
            bias: a :class:`Bias` or float tensor broadcastable to (B, Hq, N, L).
            cache: a ``KVCache``; x's keys/values are appended and attention runs over every cached
                position (self-attention only).
            positions: (N,) or (B, N) token positions for rotary; default ``arange(p, p + N)`` with
                p = ``cache.position`` (0 without a cache). Only meaningful with ``rotary``.
            head_mask: (Hq,) or (B, Hq) float multiplier on each head's output before W^O (1 keeps a
                head, 0 prunes it; Michel et al., 2019, "Are Sixteen Heads Really Better than One?").

        Returns:
            (B, N, d).

        Raises:
            ValueError: wrong ranks or widths, a cache or positions with cross-attention, positions
                without rotary, a head_mask of the wrong shape, and what :func:`multihead.attention`
                raises for masks and biases.
        """
        self.check_call(x, context, cache, positions, head_mask)
        a = self.heads(x, context, mask=mask, bias=bias, cache=cache, positions=positions)  # (B, Hq, N, Dv)
        a = self.mix_heads(a, x, head_mask)  # (B, Hq, N, Dv)
        return self.output(a)  # (B, N, d): eq. (5)

    def weight_dtype(self) -> torch.dtype | None:
        """The dtype of the output projection's weight (the input must match it), or None when the
        module holds no plain float weight there (quantised or replaced projections decide themselves)."""
        w = getattr(getattr(self, "o_proj", None), "weight", None)
        return w.dtype if isinstance(w, Tensor) and w.is_floating_point() else None

    def check_call(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
        head_mask: Tensor | None,
    ) -> None:
        """Validate the arguments of :meth:`forward` before any work is done.

        Raises:
            ValueError: x or context not float (B, N, d_model) / (B, M, d_model) with the same B, a cache
                with cross-attention, positions without rotary self-attention, a head_mask that is not
                a float (Hq,) or (B, Hq) tensor.
        """
        check_call_arguments(
            x,
            context,
            cache,
            positions,
            head_mask,
            d_model=self.d_model,
            n_heads=self.n_heads,
            dtype=self.weight_dtype(),
            has_rotary=self.rotary is not None,
        )

    def heads(
        self,
        x: Tensor,
        context: Tensor | None,
        *,
        mask: Mask | Tensor | None,
        bias: Bias | Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
    ) -> Tensor:
        """head_1 .. head_h of eq. (3)-(4) as (B, Hq, N, Dv): project, positions, cache, attend.

        Arguments as :meth:`forward` (already checked).
        """
        q, k, v = self.project(x, context)  # (B, Hq, N, D), 2 x (B, Hkv, M or N, D): eq. (3)
        if context is None:
            q, k = self.apply_positions(q, k, positions, cache)  # (B, Hq, N, D), (B, Hkv, N, D)
        if cache is not None:
            k, v = self.update_cache(cache, k, v)  # (B, Hkv, L, D) each
        return self.attend(q, k, v, mask=mask, bias=bias, x=x, context=context)  # (B, Hq, N, Dv)

    def project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """eq. (3), Q = X W^Q, K = X W^K, V = X W^V (K, V from ``context`` in cross-attention).

        Args:
            x: (B, N, d) the queries' input.
            context: (B, M, d) the keys' and values' input, or None for x.

        Returns:
            q (B, Hq, N, D), k and v (B, Hkv, M, D) (M = N in self-attention).
        """
        q, k, v = self._project(x, context)  # (B, N, Hq*D), 2 x (B, M, Hkv*D)
        Hkv = self.n_kv_heads
        return self.split_heads(q, self.n_heads), self.split_heads(k, Hkv), self.split_heads(v, Hkv)

    def token_positions(
        self, n: int, cache: KVCache | None, positions: Tensor | None, device: torch.device
    ) -> Tensor:
        """Positions of the n new tokens: ``positions`` when given, else ``arange(p, p + n)`` (N,) after
        the p = ``cache.position`` cached ones (0 without a cache)."""
        if positions is not None:
            return positions
        start = 0 if cache is None else int(cache.position)
        return torch.arange(start, start + n, device=device)  # (N,)

    def apply_positions(
        self, q: Tensor, k: Tensor, positions: Tensor | None, cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """Rotary positions on q (B, Hq, N, D) and k (B, Hkv, N, D) of a self-attention call; the
        identity without ``rotary``. Positions as :meth:`token_positions`.

        Returns:
            q and k, same shapes.
        """
        if self.rotary is None:
            return q, k
        start = 0 if cache is None else int(cache.position)
        if isinstance(self.rotary, RotaryEmbedding):
            return self.rotary.rotate_pair(q, k, positions, start)  # default: start .. start+N-1
        pos = self.token_positions(q.shape[2], cache, positions, q.device)  # (N,) or (B, N)
        return self.rotary(q, pos), self.rotary(k, pos)  # any module with forward(x, positions)

    def update_cache(self, cache: KVCache, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new keys and values (B, Hkv, N, D) to ``cache``; return every cached position's,
        (B, Hkv, L, D) each, ending with the new ones."""
        return cache.update(k, v)

    def attention_dropout(self) -> float:
        """The attention-weight dropout of this call: ``dropout`` in training, 0 in eval."""
        return self.dropout if self.training else 0.0

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        x: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """eq. (2) / (4) per head, ``softmax(q k^T * scale + bias) v`` over the keys the mask allows
        (with :attr:`sinks`, each head's sink joins every row's softmax denominator).

        Args:
            q: (B, Hq, N, D); k: (B, Hkv, L, D); v: (B, Hkv, L, Dv); GQA grouped by the core.
            mask, bias: as :meth:`forward`.
            x, context: the call's inputs (B, N, d) and (B, M, d) or None, for designs whose scores depend
                on them; the textbook layer does not read them.

        Returns:
            (B, Hq, N, Dv), with the module's backend, dropout and approximation.
        """
        a = attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            scale=self.score_scale,
            dropout_p=self.attention_dropout(),
            backend=self.backend,
            sinks=self.sinks,
        )  # (B, Hq, N, Dv): head_i of eq. (4) (or its approximation)
        assert isinstance(a, Tensor)
        return a

    def mix_heads(self, a: Tensor, x: Tensor, head_mask: Tensor | None) -> Tensor:
        """Each head's output scaled by ``head_mask`` (checked by :meth:`check_call`) before W^O.

        Args:
            a: (B, Hq, N, Dv) the heads.
            x: (B, N, d) the call's input, for designs that gate or mix heads from it.
            head_mask: (Hq,) or (B, Hq) or None (the identity).

        Returns:
            (B, Hq, N, Dv).
        """
        if head_mask is None:
            return a
        return a * head_mask.reshape(-1, self.n_heads, 1, 1).to(a.dtype)  # (B, Hq, N, Dv)

    def merge_heads(self, a: Tensor) -> Tensor:
        """head_1 (+) ... (+) head_h of eq. (5): (B, Hq, N, Dv) -> (B, N, Hq*Dv)."""
        B, H, N, Dv = a.shape
        return a.transpose(1, 2).reshape(B, N, H * Dv)  # (B, N, Hq*Dv)

    def output(self, a: Tensor) -> Tensor:
        """W^O of eq. (5) on the merged heads, then output dropout: (B, Hq, N, Dv) -> (B, N, d)."""
        return self.out_dropout(self.o_proj(self.merge_heads(a)))  # (B, N, d)

    @property
    def backend(self) -> str | registry.Backend:
        """What the core call runs on: a name ("auto" picks per call) or a backend object. An
        ``nn.Module`` backend (an approximation) is kept as the submodule ``approx``, so its parameters
        train and are saved (``approx.*`` state-dict keys); assigning a new backend replaces it.

        Raises:
            ValueError: on assignment, a value that is neither "auto", a registered name nor a backend
                object.
        """
        return self._plain_backend if self.approx is None else cast(registry.Backend, self.approx)

    @backend.setter
    def backend(self, value: str | registry.Backend) -> None:
        registry.resolve(value)  # raises for anything but "auto", a name or a backend object
        self.approx: nn.Module | None = value if isinstance(value, nn.Module) else None
        self._plain_backend = "auto" if isinstance(value, nn.Module) else value

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "backend":  # through the property: nn.Module would register a module as child "backend"
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def extra_repr(self) -> str:
        b = self.backend
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, "
            + (f"backend={b!r}" if isinstance(b, str) else f"backend={b.name}")
            + (", sinks=True" if self.sinks is not None else "")
        )
