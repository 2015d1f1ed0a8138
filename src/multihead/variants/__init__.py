"""Head designs that replace multi-head attention: routing, mixing, overlapping, sharing, gating.

Every class is a subclass of :class:`~multihead.MultiHeadAttention` and a drop-in for it: same core
constructor arguments (``d_model, n_heads, [n_kv_heads], *, bias, dropout, rotary, backend``), same
forward ``(x, context=None, *, mask, bias, cache, positions, head_mask) -> (B, N, d)``, and an
``aux_loss`` scalar set on every forward (zero when the design has none). Each overrides only the steps
of the template (:mod:`multihead.nn.attention`) that it changes::

    MixtureOfHeads      MoH: shared heads + top-k routed heads per token, load-balance loss   heads
    DynamicComposition  DCMHA: static + dynamic composition of head scores around softmax     attend
    OverlappingHeads    MOHSA: each head's q/k/v widened by its neighbours' features          attend, W^O
    CollaborativeHeads  shared W_Q/W_K with per-head mixing vectors; from_mha re-parametrises  project,
                                                                     apply_positions, attend
    TalkingHeads        Hq x Hq mixing of logits and of weights                               attend
    GatedHeads          hard-concrete head gates with an L0 penalty                           mix_heads
    OutputGatedAttention
                        a sigmoid gate from x on each head's output (Qwen3-Next)              mix_heads
    DifferentialAttention
                        difference of two softmax maps, normed per head (DiffLlama)           attend,
                                                                                              mix_heads
    LatentAttention     MLA: keys/values rebuilt from a cached low-rank latent (DeepSeek-V2)  project,
                                                         apply_positions, attend, cache

A design that cannot serve a call says why: DynamicComposition and CollaborativeHeads refuse a
``KVCache`` (ValueError); every design supports masks, biases, rotary, head_mask and cross-attention.

Whole models: :func:`build` makes one attention module by name (:data:`NAMES`), :func:`swap` returns a
copy of a model with every ``TransformerLayer.self_attn`` replaced, :func:`aux_loss` sums the auxiliary
losses to add to the task loss::

    model = variants.swap(mh.TransformerLM(64, 64, 2, 4, 128), "moh", top_k=1)
    loss = task_loss(model(ids)) + variants.aux_loss(model)
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from ..nn.layers import TransformerLayer
from .collab import CollaborativeHeads
from .dcmha import DynamicComposition
from .differential import DifferentialAttention
from .gated import GatedHeads
from .latent import LatentAttention
from .latent_cache import LatentCache
from .moh import MixtureOfHeads
from .mohsa import OverlappingHeads
from .output_gated import OutputGatedAttention
from .talking import TalkingHeads

__all__ = [
    "NAMES",
    "CollaborativeHeads",
    "DifferentialAttention",
    "DynamicComposition",
    "GatedHeads",
    "LatentAttention",
    "LatentCache",
    "MixtureOfHeads",
    "OutputGatedAttention",
    "OverlappingHeads",
    "TalkingHeads",
    "aux_loss",
    "build",
    "swap",
]

NAMES = (
    "mha",
    "gqa",
    "mqa",
    "sinks",
    "moh",
    "dcmha",
    "mohsa",
    "collab",
    "talking",
    "gated",
    "output_gated",
    "differential",
    "mla",
)

_CLASSES: dict[str, type[nn.Module]] = {
    "mha": MultiHeadAttention,
    "gqa": MultiHeadAttention,
    "mqa": MultiHeadAttention,
    "sinks": MultiHeadAttention,
    "moh": MixtureOfHeads,
    "dcmha": DynamicComposition,
    "mohsa": OverlappingHeads,
    "collab": CollaborativeHeads,
    "talking": TalkingHeads,
    "gated": GatedHeads,
    "output_gated": OutputGatedAttention,
    "differential": DifferentialAttention,
    "mla": LatentAttention,
}


def _gqa_heads(n_heads: int) -> int:
    """kv heads of "gqa": n_heads // 2 when that divides n_heads (every even count), else the largest
    divisor of n_heads below it (1 for a prime)."""
    target = max(1, n_heads // 2)
    return max(k for k in range(1, target + 1) if n_heads % k == 0)


def _check_kwargs(name: str, cls: type[nn.Module], kw: dict[str, Any]) -> None:
    params = inspect.signature(cls.__init__).parameters
    allowed = sorted(p for p in params if p not in ("self", "d_model", "n_heads"))
    if name in ("mha", "mqa", "sinks"):
        allowed.remove("n_kv_heads")  # fixed by the name
    if name == "sinks":
        allowed.remove("sinks")
    unknown = sorted(set(kw) - set(allowed))
    if unknown:
        raise ValueError(
            f"variants.build({name!r}) got unknown arguments {unknown}; {name!r} accepts {allowed}"
        )


def build(name: str, d_model: int, n_heads: int, **kw: Any) -> nn.Module:
    """One attention module of the named design, (B, N, d) -> (B, N, d).

    Args:
        name: one of :data:`NAMES`. "mha" is MultiHeadAttention with n_kv_heads = n_heads; "gqa" uses
            n_kv_heads = n_heads // 2 (for odd n_heads the largest divisor below it; pass n_kv_heads to
            choose); "mqa" uses one kv head; "sinks" is "mha" with a learned attention sink per head
            (``sinks=True``, as in gpt-oss).
        d_model, n_heads: model width and query heads.
        **kw: the design's own constructor arguments (bias, dropout, rotary, backend, top_k, overlap, ...).

    Raises:
        ValueError: an unknown name, an argument the design does not take (the message lists those it
            takes), and what the design's constructor raises.
    """
    if name not in _CLASSES:
        raise ValueError(f"unknown attention design {name!r}; choose one of {list(NAMES)}")
    cls = _CLASSES[name]
    _check_kwargs(name, cls, kw)
    if name == "mha":
        kw["n_kv_heads"] = n_heads
    elif name == "sinks":
        kw["n_kv_heads"], kw["sinks"] = n_heads, True
    elif name == "mqa":
        kw["n_kv_heads"] = 1
    elif name == "gqa":
        kw.setdefault("n_kv_heads", _gqa_heads(n_heads) if isinstance(n_heads, int) else n_heads)
    return cls(d_model, n_heads, **kw)


def swap(
    model: nn.Module, name: str, *, init: Callable[[nn.Module], None] | None = None, **kw: Any
) -> nn.Module:
    """A deep copy of ``model`` with every ``TransformerLayer.self_attn`` replaced by the named design.

    The original model is not changed. Each new module takes the old one's d_model, n_heads, rotary
    module (shared as before), backend, dropout and bias setting, and its device and dtype; ``kw`` adds
    the design's own arguments and may override those. The new modules are freshly initialised (their own
    default initialisation, then ``init`` applied to each new module's submodules when given, e.g.
    ``TransformerLM._init_weights``). A TransformerLM also gets the new ``n_kv_heads``, which sizes the
    caches of its ``generate``. Cross-attention sub-layers are kept. A design whose depth matters (a
    ``layer_idx`` argument: differential attention's lambda_init) gets each layer's index, counted in
    module order, unless ``kw`` sets it.

    Raises:
        ValueError: a model without TransformerLayer, and what :func:`build` raises.
    """
    out = copy.deepcopy(model)
    layers = [m for m in out.modules() if isinstance(m, TransformerLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} contains no multihead.TransformerLayer whose self_attn to swap"
        )
    kv_counts: set[int] = set()
    by_depth = name in _CLASSES and "layer_idx" in inspect.signature(_CLASSES[name].__init__).parameters
    for i, layer in enumerate(layers):
        old = layer.self_attn
        inherited = {
            "bias": getattr(old.o_proj, "bias", None) is not None,
            "dropout": old.dropout,
            "rotary": old.rotary,
            "backend": old.backend,
            **({"layer_idx": i} if by_depth else {}),
        }
        new = build(name, old.d_model, old.n_heads, **{**inherited, **kw})
        if init is not None:
            new.apply(init)
        p = next(old.parameters())
        layer.self_attn = new.to(device=p.device, dtype=p.dtype)  # type: ignore[assignment]
        kv_counts.add(int(getattr(new, "n_kv_heads", old.n_heads)))
    if isinstance(out, TransformerLM) and len(kv_counts) == 1:
        out.n_kv_heads = kv_counts.pop()  # make_cache() sizes its caches by it
    return out


def aux_loss(model: nn.Module) -> Tensor:
    """Sum of the ``aux_loss`` of every module in ``model`` that has one (from its last forward).

    Zero (a float32 scalar on the model's device) when there is none. Add it to the task loss.
    """
    losses: list[Tensor] = []
    for m in model.modules():
        t = getattr(m, "aux_loss", None)
        if isinstance(t, Tensor):
            losses.append(t)
    if not losses:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    total = losses[0]
    for t in losses[1:]:
        total = total + t.to(total.device)
    return total
