"""Tensor (head) parallelism: every rank of a group computes 1/W of the heads and of the FFN width.

Megatron-LM's split (Shoeybi et al. 2019: ColumnParallelLinear for W^Q, W^K, W^V,
RowParallelLinear for W^O):

    x (replicated) -> [q_r | k_r | v_r] = x W_qkv[rows of rank r]     column-parallel, no communication
                   -> heads of rank r: softmax(q_r k_r^T) v_r           local, Hq/W query, Hkv/W kv heads
                   -> sum_r  a_r W^O[:, cols of rank r]  + b^O          row-parallel: ONE all-reduce
    FFN:  sum_r act(x W1[rows r]) W2[:, cols r] + b2                    the same, ONE all-reduce

In the backward the replicated input's gradient is all-reduced once per block (Megatron's "f").

Attention is split by hand: ``qkv_proj`` is one fused Linear whose rows are ``[q | k | v]``, so a plain
column split (DTensor's ``ColwiseParallel``) would hand rank 0 all of q and part of k. Each rank instead
keeps its own head rows of each of q, k and v (query head i reads kv head i // G, so rank r's query heads
read exactly rank r's kv heads), and ``o_proj`` becomes a row-parallel Linear holding the matching input
columns, with the bias added once after the all-reduce. The module's ``n_heads`` / ``n_kv_heads`` become
the local counts, so its own forward (self or cross attention, rotary, KV cache) runs unchanged; masks and
biases that depend on the head (ALiBi, per-head tensors) are shifted to the rank's global head indices.
The feed-forward is a textbook fit and goes through torch's own tools: ``parallelize_module`` with
``ColwiseParallel`` (linear1 / w1, w3) and ``RowwiseParallel`` (linear2 / w2); its weights are DTensors.

Shape legend: B batch, N tokens, d = d_model, Hq / Hkv global heads, W world size, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.biases import Bias, TensorBias, as_bias, bias_parts
from ..core.masks import Mask, MaskContext, TensorMask, as_mask
from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from ..nn.feed_forward import FeedForward
from .comm import resolve_group

__all__ = ["tensor_parallel"]


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_r W_r^T) + b``: this rank's input columns of a Linear, the bias added once."""

    def __init__(self, full: nn.Linear, cols: slice, group: dist.ProcessGroup):
        w = full.weight
        super().__init__(
            cols.stop - cols.start, w.shape[0], bias=full.bias is not None, device=w.device, dtype=w.dtype
        )
        with torch.no_grad():
            self.weight.copy_(w[:, cols])  # (d, Hq/W * D)
            if full.bias is not None:
                self.bias.copy_(full.bias)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = _ReduceFromParallel.apply(F.linear(x, self.weight), self.group)  # (B, N, d): the one all-reduce
        return y if self.bias is None else y + self.bias


# -- masks and biases seen by a rank's heads -------------------------------------------------------
class _HeadShardMask(Mask):
    """A mask over all Hq heads, read for this rank's heads h0 .. h0 + Hq/W - 1."""

    def __init__(self, inner: Mask, h0: int, H: int):
        self.inner, self.h0, self.H = inner, h0, H
        self.is_causal = inner.is_causal  # head slicing keeps the causal structure (SDPA's fast path)

    def _ctx(self, ctx: MaskContext) -> MaskContext:
        return MaskContext(ctx.B, self.H, ctx.Nq, ctx.Nk)

    def evaluate(self, b, h, q, k, ctx):
        return self.inner.evaluate(b, h + self.h0, q, k, self._ctx(ctx))

    def validate(self, ctx):
        self.inner.validate(self._ctx(ctx))

    def __repr__(self):
        return f"{self.inner!r}[heads {self.h0}..]"


class _HeadShardBias(Bias):
    """A bias over all Hq heads (ALiBi, ...), read for this rank's heads."""

    def __init__(self, inner: Bias, h0: int, H: int):
        self.inner, self.h0, self.H = inner, h0, H
        self.is_additive = inner.is_additive

    def _ctx(self, ctx: MaskContext) -> MaskContext:
        return MaskContext(ctx.B, self.H, ctx.Nq, ctx.Nk)

    def values(self, b, h, q, k, ctx):
        return self.inner.values(b, h + self.h0, q, k, self._ctx(ctx))

    def apply(self, s, b, h, q, k, ctx):
        return self.inner.apply(s, b, h + self.h0, q, k, self._ctx(ctx))

    def validate(self, ctx):
        self.inner.validate(self._ctx(ctx))

    def __repr__(self):
        return f"{self.inner!r}[heads {self.h0}..]"


def _head_slice(t: Tensor, h0: int, hl: int, H: int, what: str) -> Tensor:
    """A (.., Hq, Nq, Nk)-broadcastable tensor cut to this rank's heads (size-1 head dims stay)."""
    if t.dim() >= 3 and t.shape[-3] == H and H > 1:
        return t.narrow(t.dim() - 3, h0, hl)
    if t.dim() >= 3 and t.shape[-3] not in (1, H):
        raise ValueError(f"{what} of shape {tuple(t.shape)} has {t.shape[-3]} heads; need 1 or Hq={H}")
    return t


def _shard_mask(mask, h0: int, hl: int, H: int) -> Mask | None:
    if mask is None:
        return None
    m = as_mask(mask)
    if isinstance(m, TensorMask):
        return TensorMask(_head_slice(m.t, h0, hl, H, "mask"))
    return _HeadShardMask(m, h0, H)


def _shard_bias(bias, h0: int, hl: int, H: int) -> Bias | None:
    if bias is None:
        return None
    b = as_bias(bias)
    parts = bias_parts(b)
    out: list[Bias] = [
        TensorBias(_head_slice(p.t, h0, hl, H, "bias"))
        if isinstance(p, TensorBias)
        else _HeadShardBias(p, h0, H)
        for p in parts
    ]  # tensor biases stay tensors so the tiled kernel still routes their gradients
    return out[0] if len(out) == 1 else as_bias(out)


# -- sharding the modules --------------------------------------------------------------------------
def _attention_hook(rank: int, H: int, hl: int, group: dist.ProcessGroup):
    """Forward pre-hook: f on x / context, masks, biases and head_mask cut to this rank's heads."""
    h0 = rank * hl

    def hook(module, args, kwargs):
        args = tuple(_CopyToParallel.apply(a, group) if isinstance(a, Tensor) else a for a in args)
        if isinstance(kwargs.get("context"), Tensor):
            kwargs["context"] = _CopyToParallel.apply(kwargs["context"], group)
        kwargs["mask"] = _shard_mask(kwargs.get("mask"), h0, hl, H)
        kwargs["bias"] = _shard_bias(kwargs.get("bias"), h0, hl, H)
        hm = kwargs.get("head_mask")
        if isinstance(hm, Tensor) and hm.shape[-1] == H:
            kwargs["head_mask"] = hm.narrow(hm.dim() - 1, h0, hl)  # (Hq/W,) or (B, Hq/W)
        return args, kwargs

    return hook


def _shard_attention(m: MultiHeadAttention, rank: int, world: int, group: dist.ProcessGroup) -> None:
    Hq, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    hq, hkv = Hq // world, Hkv // world
    q_rows = torch.arange(rank * hq * D, (rank + 1) * hq * D)  # this rank's query head rows
    k_rows = Hq * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D)
    v_rows = (Hq + Hkv) * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D)
    rows = torch.cat([q_rows, k_rows, v_rows]).to(m.qkv_proj.weight.device)  # ((hq + 2 hkv) D,)
    with torch.no_grad():
        m.qkv_proj.weight = nn.Parameter(m.qkv_proj.weight[rows].clone())  # ((hq + 2 hkv) D, d)
        if m.qkv_proj.bias is not None:
            m.qkv_proj.bias = nn.Parameter(m.qkv_proj.bias[rows].clone())
    m.qkv_proj.out_features = rows.numel()
    if m.sinks is not None:  # attention sinks: one per query head, so this rank keeps its heads' (hq,)
        m.sinks = nn.Parameter(m.sinks.detach()[rank * hq : (rank + 1) * hq].clone())
    m.o_proj = RowParallelLinear(m.o_proj, slice(rank * hq * D, (rank + 1) * hq * D), group)
    m.n_heads, m.n_kv_heads = hq, hkv
    m.register_forward_pre_hook(_attention_hook(rank, Hq, hq, group), with_kwargs=True)


def _shard_ffn(f: FeedForward, mesh) -> None:
    # imported here: torch.distributed.tensor costs seconds to import, and ring attention never needs it
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if f.activation == "swiglu":
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    else:
        plan = {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}
    parallelize_module(f, mesh, plan)
    f.d_ff //= mesh.size()


def _check(module: nn.Module, world: int) -> tuple[list[MultiHeadAttention], list[FeedForward]]:
    """Everything that can refuse, checked before anything is changed."""
    attns = [m for m in module.modules() if isinstance(m, MultiHeadAttention) and m.textbook]
    ffns = [m for m in module.modules() if isinstance(m, FeedForward)]
    if any(getattr(m, "_mh_tensor_parallel", False) for m in [*attns, *ffns]):
        raise ValueError("this module is already tensor-parallel; call tensor_parallel once per model")
    if not attns and not ffns:
        raise ValueError(
            f"{type(module).__name__} holds no MultiHeadAttention or FeedForward to shard; pass a multihead "
            "module (MultiHeadAttention, TransformerLayer, Encoder, Decoder, TransformerLM)"
        )
    for a in attns:
        if a.n_heads % world or a.n_kv_heads % world:
            raise ValueError(
                f"n_heads ({a.n_heads}) and n_kv_heads ({a.n_kv_heads}) must both be divisible by the world "
                f"size ({world}) to shard heads evenly; pick a world size that divides {a.n_kv_heads}"
            )
    for f in ffns:
        if f.d_ff % world:
            raise ValueError(f"FeedForward d_ff ({f.d_ff}) must be divisible by the world size ({world})")
    dropping = sorted(
        {f"{type(m).__name__}(p={m.p})" for m in module.modules() if isinstance(m, nn.Dropout) and m.p > 0}
    )
    dropping += [f"MultiHeadAttention(dropout={a.dropout})" for a in attns if a.dropout > 0]
    if dropping:
        raise ValueError(
            f"tensor_parallel needs dropout=0, found {dropping}: each rank would draw its own dropout mask "
            "on the replicated activations and the replicas would drift apart; build it with dropout=0.0"
        )
    return attns, ffns


def tensor_parallel(module: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard a multihead model's heads and FFN width across the ranks of ``group``, in place.

    Every ``MultiHeadAttention`` keeps Hq/W query and Hkv/W kv heads (column-parallel q/k/v, row-parallel
    W^O, one all-reduce) and every ``FeedForward`` d_ff/W hidden units (DTensor ``ColwiseParallel`` /
    ``RowwiseParallel``, one all-reduce). Everything else (embeddings, norms, lm_head) stays replicated.
    Call it on every rank with identical weights (same seed or a broadcast state dict); then feed every
    rank the same input: each returns the full output, and gradients of replicated parameters are equal on
    all ranks. A ``TransformerLM``'s ``make_cache`` then builds caches of the local kv heads. The state
    dict holds this rank's shards: plain tensors for the attention (its q, k, v head rows, its W^O
    columns), DTensors for the FFN (``.full_tensor()`` gathers one).

    Args:
        module: a ``MultiHeadAttention``, ``FeedForward``, ``TransformerLayer``, ``Encoder``, ``Decoder``,
            ``TransformerLM`` or any module holding them.
        group: the process group (default: the whole world).

    Returns:
        ``module`` itself, sharded.

    Raises:
        ValueError: heads or d_ff not divisible by the world size, dropout > 0, no shardable submodule,
            a module sharded twice.
        RuntimeError: torch.distributed is not initialised.
    """
    pg, rank, world = resolve_group(group)
    attns, ffns = _check(module, world)
    for a in attns:
        _shard_attention(a, rank, world, pg)
    if ffns:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(pg, next(ffns[0].parameters()).device.type)
        for f in ffns:
            _shard_ffn(f, mesh)
    if isinstance(module, TransformerLM):
        module.n_kv_heads //= world
    for m in [*attns, *ffns]:
        m._mh_tensor_parallel = True  # type: ignore[assignment]
    return module
