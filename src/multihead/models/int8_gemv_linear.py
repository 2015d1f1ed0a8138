"""``Int8GemvLinear``: int8 weights with a scale per group of inputs (or per output channel) whose
CPU calls without gradient run the native int8 kernels (a decode step's GEMV, a prefill's rows at once).

Weights: ``W ~ scale[o, g] * W8[o, i]`` for input i in group ``g = i // group_size`` (symmetric,
``scale = absmax(group) / 127``, ``W8 = round(W / scale)``), or one scale per output channel
(``group_size=None``). Smaller groups follow the weights more closely (a group's largest weight sets
its rounding step, so an outlier coarsens 32 or 64 weights instead of a whole row) for 4 bytes of scale
per group: 1.125 bytes a weight at 32, 1.0625 at 64, about 1 per channel.

A CPU call without gradient runs the native int8 kernel: each row of the activation is rounded to int8
per block of 32 (as llama.cpp's q8_0 does) and multiplied by int8 dot products (VNNI where the CPU has
it); one row (a decode step) through :func:`multihead.native.int8.run_q8`, several (a prefill, a batch)
through :func:`~multihead.native.int8.run_gemm_q8`, which reads the weights once for up to 64 rows and
gives each row what the one-row kernel gives it, bit for bit (a prompt's products equal those of its
rows taken one at a time). Training, another device or no native kernels: ``F.linear`` on the weight
dequantized to the input's dtype: the same weights, the activation unrounded.
``mh.quant.quantize(model, weights="int8", kernel="native", group_size=...)`` builds it.

Where the kernels are AVX512-VNNI's, the int8 rows are kept in the blocked layout they read fastest
(:mod:`multihead.native.layout`: a permutation of each row's columns within every 512); ``blocked`` says
so, :attr:`Int8GemvLinear.int8_weight` gives the rows in column order, and the state dict holds them in
column order whatever the layout in memory, so a saved model loads on any machine.

Shape legend: I input features, O output features, Gr = ceil(I / group_size) groups, ... leading dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native
from ..native import int8 as native_int8
from ..native import layout

__all__ = [
    "BlockedRows", "Int8GemvLinear", "check_group_size", "dequantize_groups", "quantize_groups",
]  # fmt: skip


def check_group_size(group_size: int | None) -> None:
    """Raises ValueError unless ``group_size`` is None, 32 or a positive multiple of 64."""
    ok = group_size is None or (
        isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0
    )
    if not ok or (group_size is not None and group_size != 32 and group_size % 64 != 0):
        raise ValueError(
            f"group_size must be 32, 64 (or another multiple of 64) or None for one scale per output "
            f"channel, got {group_size!r}"
        )


def quantize_groups(w: Tensor, group_size: int | None) -> tuple[Tensor, Tensor]:
    """w (O, I) -> int8 (O, I) and fp32 scales (O, Gr), or (O,) for ``group_size=None``.

    ``scale = absmax(group) / 127`` (computed in fp32), ``q = round(w / scale)`` clamped to [-127, 127];
    an all-zero group gets scale 0. The last group of a row may be shorter than ``group_size``.

    Raises:
        ValueError: a group size other than None, 32 or a multiple of 64.
    """
    check_group_size(group_size)
    O, I = w.shape
    wf = w.detach().float()  # (O, I)
    if group_size is None:
        scale = wf.abs().amax(1) / 127.0  # (O,)
        q = torch.round(wf / torch.where(scale > 0, scale, 1.0)[:, None])  # (O, I)
        return q.clamp_(-127, 127).to(torch.int8), scale
    n = -(-I // group_size)
    padded = F.pad(wf, (0, n * group_size - I)).view(O, n, group_size)  # (O, Gr, group)
    scale = padded.abs().amax(2) / 127.0  # (O, Gr)
    q = torch.round(padded / torch.where(scale > 0, scale, 1.0)[:, :, None])  # (O, Gr, group)
    return q.clamp_(-127, 127).to(torch.int8).view(O, -1)[:, :I].contiguous(), scale  # (O, I), (O, Gr)


def dequantize_groups(q: Tensor, scale: Tensor, group_size: int | None, dtype: torch.dtype) -> Tensor:
    """int8 (..., I) and scales (..., Gr) (or (...,) per row for ``group_size=None``) -> (..., I) in
    ``dtype``, each value ``q * scale`` in fp32 first."""
    if group_size is None:
        return (q.float() * scale[..., None]).to(dtype)  # (..., I)
    per_value = scale.repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]  # (..., I)
    return (q.float() * per_value).to(dtype)  # (..., I)


class BlockedRows(nn.Module):
    """A module whose int8 rows ``weight_int8`` (O, I) may lie in the blocked layout (``blocked``): the
    rows in column order as :attr:`int8_weight`, and a state dict in column order both ways."""

    weight_int8: Tensor
    blocked: bool = False

    @property
    def int8_weight(self) -> Tensor:
        """The int8 rows (O, I) in column order (a copy when blocked)."""
        return layout.from_blocked(self.weight_int8) if self.blocked else self.weight_int8

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.blocked and prefix + "weight_int8" in destination:
            destination[prefix + "weight_int8"] = self.int8_weight

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        key = prefix + "weight_int8"
        if self.blocked and key in state_dict:
            state_dict = {**state_dict, key: layout.to_blocked(state_dict[key])}
        super()._load_from_state_dict(state_dict, prefix, *args)


class Int8GemvLinear(BlockedRows):
    """``y = x W^T + b`` with int8 W and fp32 scales per group (see the module doc).

    Args:
        linear: the float layer to quantize (rounded once, here).
        group_size: inputs per scale: 32, 64 or another multiple of 64; None for one per output channel.

    Raises:
        ValueError: a bad ``group_size``.
    """

    weight_int8: Tensor
    scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear, group_size: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = (
            linear.in_features,
            linear.out_features,
            group_size,
        )
        w8, scale = quantize_groups(linear.weight, group_size)
        self.blocked = native_int8.reads_blocked()  # the kernels' fastest layout, where they have one
        self.register_buffer("weight_int8", layout.to_blocked(w8) if self.blocked else w8)  # (O, I) int8
        self.register_buffer("scale", scale)  # (O, Gr) or (O,) fp32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    @property
    def why_not_native(self) -> str | None:
        """None when calls without gradient run the native int8 kernels, else why they run ``F.linear``."""
        reason = native.unavailable()
        if reason is not None:
            return reason
        if self.weight_int8.device.type != "cpu":
            return f"the weight is on {self.weight_int8.device}; the kernel runs on the CPU"
        return None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the int8 numbers stand for, (O, I) in ``dtype``."""
        return dequantize_groups(self.int8_weight, self.scale, self.group_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight_int8
        if (
            x.dim() >= 1
            and x.shape[-1] == self.in_features
            and x.device.type == "cpu"
            and w.device.type == "cpu"
            and x.is_floating_point()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not native.watched()  # a FLOP counter or fake tensors see F.linear, not a native call
        ):
            lib = native.library()
            if lib is not None:
                x32 = x.reshape(-1, self.in_features).float().contiguous()  # (N, I)
                # one row (a decode step): the GEMV, its scratch on the stack; several (a prefill, a
                # batch): the multi-row product, the weights read once for up to 64 rows
                one = x32.shape[0] == 1
                run = native_int8.run_q8 if one else native_int8.run_gemm_q8
                y = run(lib, w, self.scale, x32[0] if one else x32, self.bias, self.group_size, self.blocked)
                return y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # (..., O)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), b)  # (..., O)

    def native_product(self, x: Tensor) -> native.Bound | None:
        """The one-row product on ``x`` as :func:`multihead.native.int8.bound_q8` makes it (for
        :func:`multihead.native.products`: a benchmark's floor); None where :meth:`forward` would not run
        the native kernel on it."""
        if self.why_not_native is not None or x.numel() != self.in_features:
            return None
        x32 = x.reshape(-1).float().contiguous()  # (I,)
        return native_int8.bound_q8(
            self.weight_int8, self.scale, x32, self.bias, self.group_size, self.blocked
        )

    def extra_repr(self) -> str:
        groups = "per output channel" if self.group_size is None else f"group_size={self.group_size}"
        groups += ", blocked rows" if self.blocked else ""
        reason = self.why_not_native
        how = "native int8 kernels" if reason is None else f"F.linear ({reason})"
        return f"in_features={self.in_features}, out_features={self.out_features}, {groups}, {how}"
