"""Linears and embeddings whose weights stay in GGUF's own blocks (llama.cpp's Q4_0, Q4_1, Q8_0 and the
k-quants Q4_K, Q6_K; :mod:`multihead.native.gguf_blocks`): what a .gguf file holds, kept as read, or what
``mh.quant.quantize(model, weights="q4_0" | "q4_1" | "q4_k")`` rounds a float model to.

A :class:`GGUFLinear` call on the CPU without gradient runs the native product on the blocks
(:mod:`multihead.native.q4`): each activation row rounded to int8 per block of 32, as the int8 path and
llama.cpp's q8 activations do, one row (a decode step) or up to 64 at once (a prompt, a batch), each row
with the bits of its one-row call. Training, another device or no native kernels: ``F.linear`` on the
blocks' weights (:meth:`GGUFLinear.dequantized`: the values ``gguf.quants.dequantize`` gives), the
activation unrounded. Q4_0, Q4_1 and Q4_K take 0.5625, 0.625 and 0.5625 bytes a weight, Q6_K 0.8203, Q8_0
1.0625.

A :class:`GGUFEmbedding` looks its rows up in the blocks and reads them back to the model's float dtype;
a head tied to it is a GGUFLinear on the same buffer.

Shape legend: I input features (a multiple of 32; of 256 for the k-quants), O output features, R bytes
of a row's blocks, V vocabulary, d embedding width, ... leading dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native
from ..native import gguf_blocks
from ..native import q4 as native_q4
from .int8_gemv_linear import native_input

__all__ = ["FALLBACK", "KINDS", "GGUFEmbedding", "GGUFLinear", "dequantize_blocks_", "quantize_blocks_"]

KINDS = tuple(gguf_blocks.KINDS)  # "q4_0", "q4_1", "q8_0", "q4_k", "q6_k"
#: the kind a linear of ``quantize_blocks_(model, kind)`` gets when its width is not a multiple of the
#: kind's block (a k-quant's 256) but is one of 32
FALLBACK = {"q4_k": "q4_1", "q6_k": "q8_0"}


class GGUFLinear(nn.Module):
    """``y = x W^T + b`` with W held in GGUF blocks of ``kind`` (see the module doc).

    Args:
        blocks: uint8 (O, R), the rows' blocks (kept, not copied).
        kind: "q4_0", "q4_1", "q8_0", "q4_k" or "q6_k".
        in_features: I, the weights a row (a multiple of the kind's block: 32, or 256).
        bias: (O,) float or None (kept in fp32).

    Raises:
        ValueError: an unknown kind, blocks that are not uint8 (O, R) of that kind for rows of I, a bias
            that is not (O,).
    """

    blocks: Tensor
    bias: Tensor | None

    def __init__(self, blocks: Tensor, kind: str, in_features: int, bias: Tensor | None = None):
        super().__init__()
        gguf_blocks.check_blocks(blocks, kind, in_features)
        if bias is not None and tuple(bias.shape) != (blocks.shape[0],):
            raise ValueError(f"GGUFLinear needs bias ({blocks.shape[0]},), got {tuple(bias.shape)}")
        self.in_features, self.out_features, self.kind = in_features, blocks.shape[0], kind
        self.register_buffer("blocks", blocks)  # (O, R) uint8
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())  # (O,)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> GGUFLinear:
        """``linear`` rounded to ``kind`` blocks by llama.cpp's rules (:func:`.gguf_blocks.quantize`).

        Raises:
            ValueError: an unknown kind, an input width that is not a multiple of 32.
        """
        blocks = gguf_blocks.quantize(linear.weight, kind)  # (O, R)
        return cls(blocks, kind, linear.in_features, linear.bias)

    @property
    def why_not_native(self) -> str | None:
        """None when calls without gradient run the native block product, else why they run F.linear."""
        reason = native.unavailable()
        if reason is not None:
            return reason
        if self.blocks.device.type != "cpu":
            return f"the blocks are on {self.blocks.device}; the kernel runs on the CPU"
        return None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the blocks stand for, (O, I) in ``dtype`` (fp32 values as gguf.quants gives them)."""
        return gguf_blocks.dequantize(self.blocks, self.kind, dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.blocks
        if native_input(x, w, self.in_features):
            lib = native.library()
            if lib is not None:
                x32 = x.reshape(-1, self.in_features).float().contiguous()  # (N, I)
                y = native_q4.run_gguf(lib, w, self.kind, x32, self.bias)  # (N, O)
                return y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # (..., O)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), b)  # (..., O)

    def extra_repr(self) -> str:
        reason = self.why_not_native
        how = f"native {self.kind} kernels" if reason is None else f"F.linear ({reason})"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} blocks, {how}"


class GGUFEmbedding(nn.Module):
    """Embedding rows held in GGUF blocks; a lookup reads its rows back to ``dtype``.

    Args:
        blocks: uint8 (V, R) of ``kind`` (a tied head's :class:`GGUFLinear` blocks: shared, not copied).
        kind: "q4_0", "q4_1" or "q8_0".
        dim: d, the width of a row (a multiple of 32).
        dtype: the float dtype of the rows a lookup returns.

    Raises:
        ValueError: as :class:`GGUFLinear`.
    """

    blocks: Tensor

    def __init__(self, blocks: Tensor, kind: str, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        gguf_blocks.check_blocks(blocks, kind, dim)
        self.num_embeddings, self.embedding_dim, self.kind, self.dtype = blocks.shape[0], dim, kind, dtype
        self.register_buffer("blocks", blocks)  # (V, R) uint8

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids.reshape(-1), self.blocks)  # (n, R)
        out = gguf_blocks.dequantize(rows, self.kind, self.dtype)  # (n, d)
        return out.view(*ids.shape, self.embedding_dim)  # (..., d)

    def native_row(self, i: int) -> Tensor | None:
        """Row ``i`` as :meth:`forward` gives it in fp32 (d,), in one native call; None without the
        kernels."""
        lib = native.library()
        if lib is None or self.blocks.device.type != "cpu":
            return None
        return native_q4.dequantize_row(lib, self.blocks, self.kind, i, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks"


def quantize_blocks_(model: nn.Module, kind: str, table_kind: str = "q8_0") -> list[str]:
    """Swap (in place) every ``nn.Linear`` of ``model`` whose input width is a multiple of 32 for a
    :class:`GGUFLinear` of ``kind``, and every ``nn.Embedding`` of such a width for a
    :class:`GGUFEmbedding` of ``table_kind`` (llama.cpp keeps the token table in 8 bits: the packaged
    SmolLM2 Q4_1 file's is Q8_0); a head tied to an embedding becomes a GGUFLinear of ``table_kind`` on
    the same blocks. A linear whose width is not a multiple of a k-quant's 256 gets :data:`FALLBACK`'s kind.
    Returns the names of the modules left in float (widths not a multiple of 32).

    Raises:
        ValueError: an unknown kind.
    """
    for k in (kind, table_kind):
        if k not in KINDS:
            raise ValueError(f"the block kind must be one of {list(KINDS)}, got {k!r}")
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Embedding)}
    swapped: dict[int, nn.Module] = {}
    kept: list[str] = []
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            where = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear) and child.in_features % gguf_blocks.BLOCK == 0:
                key = id(child.weight)
                if key not in swapped:
                    k = table_kind if key in tables else kind
                    if child.in_features % gguf_blocks.block_weights(k) != 0:
                        k = FALLBACK[k]
                    swapped[key] = GGUFLinear.from_linear(child, k)
                setattr(parent, name, swapped[key])
            elif isinstance(child, nn.Linear):
                kept.append(where)
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and child.embedding_dim % gguf_blocks.BLOCK == 0:
                head = swapped.get(id(child.weight))
                tk = table_kind
                if child.embedding_dim % gguf_blocks.block_weights(tk) != 0:
                    tk = FALLBACK[tk]
                if isinstance(head, GGUFLinear):  # tied: the head's blocks (of the same kind)
                    blocks, tk = head.blocks, head.kind
                else:
                    blocks = gguf_blocks.quantize(child.weight, tk)  # (V, R)
                dtype = child.weight.dtype
                setattr(parent, name, GGUFEmbedding(blocks, tk, child.embedding_dim, dtype))
            elif isinstance(child, nn.Embedding):
                kept.append(f"{prefix}.{name}" if prefix else name)
    return kept


def dequantize_blocks_(model: nn.Module) -> int:
    """Swap (in place) every :class:`GGUFLinear` of ``model`` for an ``nn.Linear`` and every
    :class:`GGUFEmbedding` for an ``nn.Embedding`` holding the weights the blocks stand for (fp32, or the
    embedding's dtype); a head on an embedding's blocks stays tied to it. Returns how many it swapped."""
    tables: dict[int, nn.Embedding] = {}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGUFEmbedding):
                table = nn.Embedding(child.num_embeddings, child.embedding_dim, dtype=child.dtype)
                table.weight = nn.Parameter(gguf_blocks.dequantize(child.blocks, child.kind, child.dtype))
                tables[child.blocks.data_ptr()] = table
                setattr(parent, name, table)
                swapped += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGUFLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                tied = tables.get(child.blocks.data_ptr())
                weight = tied.weight if tied is not None else nn.Parameter(child.dequantized())
                linear.weight = weight
                if child.bias is not None:
                    linear.bias = nn.Parameter(child.bias.clone())
                setattr(parent, name, linear)
                swapped += 1
    return swapped
