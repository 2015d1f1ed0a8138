"""``mh.quant.quantize``: an inference copy of a model in another weight format, and int8 keys and values.

A format names what every linear layer becomes (:data:`FORMATS`, one :class:`WeightFormat` each):

- ``"int8"``: int8 weights, one fp32 scale per output channel or per ``group_size`` inputs; the kernels of
  :data:`KERNELS`: ``"native"`` (:class:`~.int8_gemv_linear.Int8GemvLinear`: the native int8 GEMV, int8
  activations per block of 32 as llama.cpp's q8_0) or torch's own (:class:`~.int8_linear.Int8Linear`:
  fbgemm, int8pack, dequant). Embeddings become :class:`~.int8_linear.Int8Embedding` (a tied head shares
  the embedding's int8 storage).
- ``"q4_0"``, ``"q4_1"``: GGUF's 4-bit blocks of 32 by llama.cpp's rounding, ``"q4_k"``: its super-blocks
  of 256 (:class:`~.gguf_linear.GGUFLinear`, native block kernels; the token table and a tied head in
  Q8_0; a q4_k linear whose input width is not a multiple of 256 in Q4_1).
- ``"fp32"``, ``"bf16"``, ``"fp16"``: the copy cast to that dtype, its linears on a faster batch-1 kernel
  (:data:`FLOAT_KERNELS`): ``"native"`` (:class:`~.gemv_linear.GemvLinear`: the native GEMV for one to a
  few rows, ``F.linear`` for more: the decoding choice) or ``"onednn"``
  (:class:`~.packed_linear.PackedLinear` / :class:`~.packed_linear.Bf16Linear`: oneDNN's packed weight for
  every call, the encoding choice; fp32 and bf16 only).

``kernel="auto"`` takes the native kernels for a :class:`~.lm.TransformerLM` where they build (its decode
steps are one-row products; for ``fp16`` always), else torch's int8 kernels or oneDNN. A TransformerLM
copy with native kernels takes each one-token decode step as one native call for all its layers
(:mod:`.native_step`); its :attr:`~.lm.TransformerLM.cache_kind` is ``"int8"`` with ``kv="int8"`` (every
attention then rounds its keys and values to int8 per token: :class:`~.kv_int8.KVInt8`). Quantized
copies are for inference: their weights take no gradient. What each format costs in quality and speed:
BENCHMARKS.md, "Decoding on the CPU" and "A real language model".

Shape legend: I input features, O output features, ... leading dims.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import native
from ..approx.apply import apply
from ..native import hugepages
from .gemv_linear import GemvLinear
from .gguf_linear import GGUFLinear, dequantize_blocks_, quantize_blocks_
from .int8_gemv_linear import Int8GemvLinear, check_group_size
from .int8_linear import INT8_LINEAR_KERNELS, Int8Embedding, Int8Linear
from .kv_int8 import KVInt8
from .lm import TransformerLM
from .packed_linear import (
    PACKED_DTYPES,
    Bf16Linear,
    PackedLinear,
    bf16_prepack_unavailable,
    prepack_unavailable,
)

__all__ = [
    "FLOAT_KERNELS",
    "FORMATS",
    "KERNELS",
    "PACKED_DTYPES",
    "Bf16Linear",
    "GemvLinear",
    "Int8Embedding",
    "Int8GemvLinear",
    "Int8Linear",
    "KVInt8",
    "PackedLinear",
    "WeightFormat",
    "bf16_prepack_unavailable",
    "model_bytes",
    "prepack_unavailable",
    "quantize",
]

#: kernels of weights="int8": "native" (Int8GemvLinear) and Int8Linear's
KERNELS = (*INT8_LINEAR_KERNELS, "native")
#: kernels of the float formats: "native" (GemvLinear; F.linear where the kernel is missing), "onednn"
#: (PackedLinear / Bf16Linear)
FLOAT_KERNELS = ("auto", "native", "onednn")


def _pack(model: nn.Module, dtype: torch.dtype, kernel: str) -> None:
    """Swap every Linear of ``model`` (in place) for a GemvLinear (``kernel="native"``) sharing its
    tensors, or for a PackedLinear of ``dtype`` (a Bf16Linear for bf16; a tied head gets its own packed
    copy)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if kernel == "native":
                    swap: nn.Module = GemvLinear.from_linear(child)
                elif dtype == torch.bfloat16:
                    swap = Bf16Linear(child)
                else:
                    swap = PackedLinear(child, dtype)
                setattr(parent, name, swap)


def _quantize_weights(model: nn.Module, kernel: str, group_size: int | None) -> None:
    """Swap every Linear / Embedding of ``model`` (in place) for its int8 form (an Int8GemvLinear for
    ``kernel="native"``, its rows packed with their scales where every one of them packs well); tied pairs
    share storage (a tied head's scales apart)."""
    linears: dict[int, Int8Linear | Int8GemvLinear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                key = id(child.weight)
                if key not in linears:
                    native_kernel = kernel == "native"
                    linears[key] = (
                        Int8GemvLinear(child, group_size) if native_kernel else Int8Linear(child, kernel)
                    )
                setattr(parent, name, linears[key])
    native = [m for m in linears.values() if isinstance(m, Int8GemvLinear)]
    if native and all(m.packs_well for m in native):  # one layout for all: a native layer reads one
        for m in native:
            m.set_packed(True)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                tied = linears.get(id(child.weight))
                setattr(parent, name, Int8Embedding(tied if tied is not None else child, child.weight.dtype))


def _to_float(dtype: torch.dtype) -> Callable[[nn.Module, str, int | None], None]:
    def convert(model: nn.Module, kernel: str, group_size: int | None) -> None:
        model.to(dtype).requires_grad_(False)
        _pack(model, dtype, kernel)

    return convert


def _to_blocks(kind: str) -> Callable[[nn.Module, str, int | None], None]:
    def convert(model: nn.Module, kernel: str, group_size: int | None) -> None:
        quantize_blocks_(model, kind)

    return convert


@dataclass(frozen=True)
class WeightFormat:
    """A named weight format of :func:`quantize`: the kernels it runs (the first is "auto"), what
    "auto" picks for a model that decodes natively and for one that does not, the float dtype of the copy
    (None: the model's), and the conversion of a copy in place: ``convert(copy, kernel, group_size)``."""

    kernels: tuple[str, ...]
    decoder_kernel: str  # "auto" for a TransformerLM where the native kernels build
    other_kernel: str  # "auto" otherwise
    convert: Callable[[nn.Module, str, int | None], None]
    dtype: torch.dtype | None = None

    def resolve(self, name: str, kernel: str, decodes: bool) -> str:
        """``kernel`` checked against this format's, "auto" resolved."""
        if kernel not in self.kernels:
            owners = [f"{n!r}" for n, f in FORMATS.items() if kernel in f.kernels]
            where = f" ({kernel!r} is a kernel of weights {', '.join(owners)})" if owners else ""
            raise ValueError(
                f"quantize kernel for weights={name!r} must be one of {list(self.kernels)}, got {kernel!r}"
                + where
            )
        if kernel == "auto":
            return self.decoder_kernel if decodes else self.other_kernel
        return kernel


#: every weight format of :func:`quantize`, by name (GGUF's names for the block formats)
FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat(KERNELS, "native", "auto", _quantize_weights),
    "q4_0": WeightFormat(("auto", "native"), "native", "native", _to_blocks("q4_0")),
    "q4_1": WeightFormat(("auto", "native"), "native", "native", _to_blocks("q4_1")),
    "q4_k": WeightFormat(("auto", "native"), "native", "native", _to_blocks("q4_k")),
    "fp32": WeightFormat(FLOAT_KERNELS, "native", "onednn", _to_float(torch.float32), torch.float32),
    "bf16": WeightFormat(FLOAT_KERNELS, "native", "onednn", _to_float(torch.bfloat16), torch.bfloat16),
    "fp16": WeightFormat(("auto", "native"), "native", "native", _to_float(torch.float16), torch.float16),
}


def quantize(
    model: nn.Module,
    weights: str | None = "int8",
    kv: str | None = "int8",
    *,
    kernel: str = "auto",
    group_size: int | None = None,
) -> nn.Module:
    """A quantized copy of ``model``: its weights in the format ``weights`` names, its keys and values
    rounded to int8 with ``kv="int8"``; the model itself is not changed.

    Args:
        model: any module (TransformerLM, Encoder, pretrained MiniLM, ...).
        weights: a name of :data:`FORMATS` ("int8", "q4_0", "q4_1", "q4_k", "fp32", "bf16", "fp16"; see the
            module doc), or None (keep the float weights). A GGUF file's kept blocks are read back to
            float first. q4_0 / q4_1 / q4_k leave linears whose input width is not a multiple of 32 in
            float; q4_k rounds those whose width is not a multiple of 256 to Q4_1 (llama.cpp falls back
            to Q5_0 there, a format without a native kernel here).
        kv: "int8" (attention on int8-rounded K/V; an int8 KV cache for ``TransformerLM.generate``) or None
            (a "dense" cache in the copy's float dtype).
        kernel: one of the format's kernels: int8 :data:`KERNELS`, the float formats
            :data:`FLOAT_KERNELS` (fp16: auto / native), q4_0 / q4_1 / q4_k auto / native; "auto" picks native
            for a TransformerLM where :func:`multihead.native.unavailable` is None (and for int8 whenever
            ``group_size`` is given), else torch's int8 kernels or oneDNN.
        group_size: ``weights="int8"`` with the native kernel: weights per scale along the input (32, 64
            or another multiple of 64), or None for one scale per output channel.

    Raises:
        ValueError: an unknown ``weights``, ``kv`` or ``kernel`` (or one of another format's); a bad
            ``group_size``, or one with another kernel than native / auto or other weights than int8;
            ``kv="int8"`` on a model without MultiHeadAttention.
    """
    if weights is not None and weights not in FORMATS:
        raise ValueError(f"quantize weights must be one of {[*FORMATS, None]}, got {weights!r}")
    if kv not in ("int8", None):
        raise ValueError(f"quantize kv must be 'int8' or None, got {kv!r}")
    fmt = None if weights is None else FORMATS[weights]
    kernel = _resolve_kernel(model, weights, kernel, group_size)
    float_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out = apply(model, KVInt8()) if kv == "int8" else copy.deepcopy(model)
    if fmt is not None:
        dequantize_blocks_(out)  # a GGUF file's kept blocks read back to float, then rounded as asked
        fmt.convert(out, kernel, group_size)
        float_dtype = fmt.dtype or float_dtype
    if kernel == "native":  # a decode step streams these weights: 2 MiB pages (see native.hugepages)
        gemvs = [m for m in out.modules() if isinstance(m, (GemvLinear, Int8GemvLinear, GGUFLinear))]
        tensors = (t for m in gemvs for t in [*m.parameters(), *m.buffers()])
        hugepages.move_to_huge_pages(tensors, min_bytes=0)  # small ones too: one arena holds them all
    if isinstance(out, TransformerLM):
        out.cache_kind = "int8" if kv == "int8" else "dense"
        out.cache_dtype = float_dtype  # its embedding may hold no float weight to ask
        out.kv_approx = KVInt8 if kv == "int8" else None
        # native steps need native kernels; float weights take them with a dense cache only
        out.native_steps = kernel == "native" and fmt is not None and (fmt.dtype is None or kv is None)
    return out


def _resolve_kernel(model: nn.Module, weights: str | None, kernel: str, group_size: int | None) -> str:
    """``kernel`` checked against ``weights``, "auto" resolved (a decoder's one-row steps: native)."""
    decodes = isinstance(model, TransformerLM) and native.unavailable() is None
    if group_size is not None:
        check_group_size(group_size)
        if weights != "int8" or kernel not in ("auto", "native"):
            raise ValueError(
                f"quantize group_size={group_size} needs weights='int8' with kernel 'native' or 'auto', got "
                f"weights={weights!r}, kernel={kernel!r}; drop group_size for one scale per output channel"
            )
        return "native"
    if weights is None:  # only the cache changes: any kernel name of the int8 format is accepted
        if kernel not in KERNELS:
            raise ValueError(f"quantize kernel must be one of {list(KERNELS)}, got {kernel!r}")
        return kernel
    return FORMATS[weights].resolve(weights, kernel, decodes)


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage counted once (tied weights share one), and
    of the oneDNN-packed weights of its :class:`PackedLinear` layers."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear))
    return sum(seen.values()) + packed
