"""``MultiHeadAttention``: the parameters of eq. 9.33-9.35 around the functional core ``mh.attention``.

    Q^i = X W_Qi,  K^i = X W_Ki,  V^i = X W_Vi                                  (seed 000, eq. 9.33)
    head_i = softmax(Q^i K^iT / sqrt(d_k)) V^i                                  (eq. 9.34)
    MultiHeadAttention(X) = (head_1 (+) ... (+) head_h) W^O                     (eq. 9.35)

The three projections are one fused ``qkv_proj`` Linear (seed 002 §4.1: one matmul instead of three).
Its output rows are ``[q | k | v]``: ``Hq*D`` query rows, then ``Hkv*D`` key rows, then ``Hkv*D`` value
rows, each block ordered head by head. Self-attention runs the whole fused matmul on ``x``;
cross-attention uses the q rows on ``x`` and the k/v rows on ``context``. State dicts with separate
``q_proj`` / ``k_proj`` / ``v_proj`` keys (Hugging Face LLaMA style) load through a pre-hook that fuses
them, and :meth:`MultiHeadAttention.split_state_dict` exports that form back.

GQA / MQA (seed 004): ``n_kv_heads`` kv heads shared by groups of ``G = Hq // Hkv`` query heads; query
head i reads kv head ``i // G``. K/V are never repeated here, the core handles the grouping.

Shape legend: B batch, N query tokens, M context tokens, L keys attended (M, N, or the cache length),
d = d_model, Hq query heads, Hkv kv heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.functional import attention
from ..core.masks import Mask
from .feed_forward import check_dropout
from .positions import RotaryEmbedding

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["MultiHeadAttention", "check_model_input"]


def check_model_input(x: Any, d_model: int, name: str = "x") -> None:
    """Raise ValueError unless ``x`` is a float tensor of shape (B, N, d_model)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of shape (B, N, d_model), got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(
            f"{name} must have 3 dims (B, N, d_model), got {x.dim()} dims {tuple(x.shape)}; "
            f"add a batch dim with {name}.unsqueeze(0)"
        )
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} has width {x.shape[-1]} but the module was built with d_model={d_model}; "
            "project the input to d_model first or build the module with the input width"
        )


def _fuse_split_qkv(module, state_dict, prefix, *_args) -> None:
    """load_state_dict pre-hook: replace ``q_proj/k_proj/v_proj.{weight,bias}`` by ``qkv_proj.*``."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{p}_proj.{kind}" for p in "qkv"]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


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
        rotary: a ``RotaryEmbedding`` applied to q and k in self-attention (not to cross-attention).
        backend: passed to :func:`multihead.attention`: "auto" (picks per call), a backend name, or a
            backend object such as an approximation from :mod:`multihead.approx`; one that is an
            ``nn.Module`` is the submodule ``approx``, so a learned Linformer's projections are parameters
            of this module (``approx.proj_k``). :func:`multihead.approx.apply` sets it on a whole model.

    Raises:
        ValueError: head counts that do not divide, a d_model not divisible by n_heads without an
            explicit head_dim, dropout outside [0, 1), a backend that is neither "auto", a registered
            name nor a backend object.
    """

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
        device=None,
        dtype=None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, val in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"MultiHeadAttention {name} must be an int >= 1, got {val!r}")
        if n_heads % n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); "
                "pick n_kv_heads among the divisors of n_heads (1 = MQA, n_heads = MHA)"
            )
        if head_dim is None:
            if d_model % n_heads != 0:
                raise ValueError(
                    f"d_model ({d_model}) is not divisible by n_heads ({n_heads}); "
                    "change one of them or pass head_dim explicitly"
                )
            head_dim = d_model // n_heads
        elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be an int >= 1 or None, got {head_dim!r}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.dropout = check_dropout(dropout)
        self.backend = backend  # validated by the setter; an nn.Module backend becomes ``self.approx``
        self.rotary = rotary
        fk = {"bias": bias, "device": device, "dtype": dtype}
        self.qkv_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, **fk)  # W^Q|W^K|W^V
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, **fk)  # W^O of eq. 9.35
        self.out_dropout = nn.Dropout(self.dropout)
        self.register_load_state_dict_pre_hook(_fuse_split_qkv)

    # -- the fused projection ----------------------------------------------------------------------
    def _slices(self) -> tuple[slice, slice, slice]:
        q_rows, kv_rows = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return slice(0, q_rows), slice(q_rows, q_rows + kv_rows), slice(q_rows + kv_rows, None)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """eq. 9.33 for all heads at once: q (B, N, Hq*D), k and v (B, M, Hkv*D)."""
        sq, sk, sv = self._slices()
        if context is None:
            qkv = self.qkv_proj(x)  # (B, N, (Hq + 2 Hkv) D)
            return qkv[..., sq], qkv[..., sk], qkv[..., sv]
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        q = F.linear(x, w[sq], None if b is None else b[sq])  # (B, N, Hq*D)
        kv = F.linear(context, w[sk.start :], None if b is None else b[sk.start :])  # (B, M, 2 Hkv D)
        k, v = kv.split(self.n_kv_heads * self.head_dim, dim=-1)  # 2 x (B, M, Hkv*D)
        return q, k, v

    def split_state_dict(self) -> dict[str, Tensor]:
        """This module's state dict with ``qkv_proj.*`` split into ``q_proj``, ``k_proj``, ``v_proj``.

        The inverse of the loading hook: ``other.load_state_dict(m.split_state_dict())`` round-trips, and
        the keys match separate-projection models (Hugging Face LLaMA ``self_attn.{q,k,v,o}_proj``).
        """
        sd = self.state_dict()
        for kind in ("weight", "bias"):
            fused = sd.pop(f"qkv_proj.{kind}", None)
            if fused is not None:
                for p, s in zip("qkv", self._slices()):
                    sd[f"{p}_proj.{kind}"] = fused[s].clone()
        return sd

    # -- forward -------------------------------------------------------------------------------
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

        Raises:
            ValueError: wrong ranks or widths, a cache or positions with cross-attention, positions
                without rotary, a head_mask of the wrong shape, and what :func:`multihead.attention`
                raises for masks and biases.
        """
        check_model_input(x, self.d_model, "x")
        if context is not None:
            check_model_input(context, self.d_model, "context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} differs from x batch {x.shape[0]}")
            if cache is not None:
                raise ValueError("cache is for self-attention; pass context=None or cache=None")
        if positions is not None and (self.rotary is None or context is not None):
            raise ValueError(
                "positions are only used by rotary self-attention; this call has "
                f"rotary={'set' if self.rotary is not None else 'None'}, "
                f"context={'set' if context is not None else 'None'}: drop positions"
            )
        B, N, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self._project(x, context)
        q = q.reshape(B, N, Hq, D).transpose(1, 2)  # (B, Hq, N, D)
        k = k.reshape(B, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, M or N, D)
        v = v.reshape(B, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, M or N, D)
        if self.rotary is not None and context is None:
            start = 0 if cache is None else int(cache.position)
            if isinstance(self.rotary, RotaryEmbedding):
                q, k = self.rotary.rotate_pair(q, k, positions, start)  # default: start .. start+N-1
            else:  # any module with forward(x, positions)
                if positions is None:
                    positions = torch.arange(start, start + N, device=x.device)  # (N,)
                q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, L, D) each, ending with x's positions
        a = attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )  # (B, Hq, N, D): head_i of eq. 9.34 (or its approximation)
        assert isinstance(a, Tensor)
        if head_mask is not None:
            a = a * self._head_scale(head_mask, B).to(a.dtype)  # (B, Hq, N, D)
        a = a.transpose(1, 2).reshape(B, N, Hq * D)  # (B, N, Hq*D): head_1 (+) ... (+) head_h
        return self.out_dropout(self.o_proj(a))  # (B, N, d): eq. 9.35

    def _head_scale(self, head_mask: Tensor, B: int) -> Tensor:
        """Validate a (Hq,) or (B, Hq) head mask and shape it to broadcast over (B, Hq, N, D)."""
        ok = isinstance(head_mask, Tensor) and head_mask.is_floating_point()
        if not ok or tuple(head_mask.shape) not in ((self.n_heads,), (B, self.n_heads)):
            shape = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else type(head_mask).__name__
            raise ValueError(
                f"head_mask must be a float tensor of shape (Hq,) = ({self.n_heads},) or (B, Hq) = "
                f"({B}, {self.n_heads}), got {shape}; use 1.0 to keep a head and 0.0 to prune it"
            )
        return head_mask.reshape(-1, self.n_heads, 1, 1)  # (B or 1, Hq, 1, 1)

    @property
    def backend(self) -> Any:  # str | registry.Backend; Any while callers typed for names pass it on
        """What the core call runs on: a name ("auto" picks per call) or a backend object. An
        ``nn.Module`` backend (an approximation) is kept as the submodule ``approx``, so its parameters
        train and are saved (``approx.*`` state-dict keys); assigning a new backend replaces it.

        Raises:
            ValueError: on assignment, a value that is neither "auto", a registered name nor a backend
                object.
        """
        return self._plain_backend if self.approx is None else self.approx

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
        )
