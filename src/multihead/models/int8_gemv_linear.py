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
column order whatever the layout in memory, so a saved model loads on any machine. With groups of 32 the
rows also hold their scales there (``packed``: each 512 weights followed by their 16 scales, one buffer
``rows_q8``; :mod:`multihead.native.layout`): a decode step then reads one stream a row instead of a
stream of weights and one of scales (~3.5% less time a token on a Zen 5 core), and ``weight_int8`` and
``scale`` are copies read out of those rows.

Shape legend: I input features, O output features, Gr = ceil(I / group_size) groups, ... leading dims.
"""

from __future__ import annotations

from typing import Any

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


def native_input(x: Tensor, w: Tensor, in_features: int) -> bool:
    """Whether a quantized linear's native kernels may take ``x`` (..., I) against weights ``w``: both on
    the CPU, x floating point of width ``in_features``, no gradient wanted, no dispatch mode watching."""
    return (
        x.dim() >= 1
        and x.shape[-1] == in_features
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.is_floating_point()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not native.watched()  # a FLOP counter or fake tensors see F.linear, not a native call
    )


class Int8GemvLinear(BlockedRows):
    """``y = x W^T + b`` with int8 W and fp32 scales per group (see the module doc).

    Args:
        linear: the float layer to quantize (rounded once, here).
        group_size: inputs per scale: 32, 64 or another multiple of 64; None for one per output channel.
        packed: keep the scales inside the blocked rows (:meth:`set_packed`; :attr:`packs_well` says
            where it pays; ``mh.quant.quantize`` packs a model's int8 linears where all of them do).

    Raises:
        ValueError: a bad ``group_size``; ``packed=True`` where it cannot be (see :meth:`set_packed`).
    """

    bias: Tensor | None

    def __init__(self, linear: nn.Linear, group_size: int | None = None, *, packed: bool = False):
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
        self.packed = False
        self.set_packed(packed)

    @property
    def packs_well(self) -> bool:
        """Whether packed rows (:meth:`set_packed`) can be had here and cost at most 2% more bytes than
        the weights and scales apart (their padding to 64 bytes: 1024 or 2816 inputs 0% and 1%; 64 inputs
        78%)."""
        I = self.in_features
        apart = I + 4 * -(-I // layout.GROUP)  # the weights' and their scales' own bytes
        return self._why_not_packed() is None and layout.packed_row_bytes(I) <= 1.02 * apart

    def _why_not_packed(self) -> str | None:
        if not self.blocked or self.group_size != layout.GROUP or self.in_features <= layout.GROUP:
            return (
                f"packed rows need blocked rows (blocked={self.blocked}), groups of {layout.GROUP} "
                f"(group_size={self.group_size}) and more than {layout.GROUP} inputs ({self.in_features})"
            )
        return None

    def set_packed(self, packed: bool) -> None:
        """Keep the scales inside the blocked rows (one buffer ``rows_q8`` (O, R) int8, R =
        :func:`multihead.native.layout.packed_row_bytes` (I)) or apart (``weight_int8`` (O, I) and
        ``scale`` (O, Gr) buffers), in place; the same numbers and outputs either way.

        Raises:
            ValueError: ``packed=True`` without blocked rows, groups of 32 and more than 32 inputs.
        """
        if packed == self.packed:
            return
        buffers = self._buffers
        if packed:
            why = self._why_not_packed()
            if why is not None:
                raise ValueError(f"set_packed(True): {why}")
            rows = layout.to_packed(self.weight_int8, self.scale.float())  # (O, R)
            bias = buffers.pop("bias")
            del buffers["weight_int8"], buffers["scale"]
            buffers["rows_q8"], buffers["bias"] = rows, bias
        else:
            w8, scale = layout.from_packed(self._buffer("rows_q8"), self.in_features)  # (O, I), (O, Gr)
            del buffers["rows_q8"]
            buffers["weight_int8"], buffers["scale"], buffers["bias"] = w8, scale, buffers.pop("bias")
        self.packed = packed

    @property
    def weight_int8(self) -> Tensor:  # type: ignore[override]
        """The int8 rows (O, I), blocked when ``blocked``: the buffer, or a copy when ``packed``."""
        return self._apart()[0]

    @property
    def scale(self) -> Tensor:
        """The fp32 scales (O, Gr), or (O,) per output channel: the buffer, or a copy when ``packed``."""
        return self._apart()[1]

    def _buffer(self, name: str) -> Tensor:
        t = self.__dict__["_buffers"].get(name)
        if t is None:  # not (yet) one of this module's buffers
            raise AttributeError(name)
        return t

    def _apart(self) -> tuple[Tensor, Tensor]:
        if self.__dict__.get("packed"):
            return layout.from_packed(self._buffer("rows_q8"), self.in_features)
        return self._buffer("weight_int8"), self._buffer("scale")

    def kernel_tensors(self) -> tuple[Tensor, Tensor, int]:
        """What the native kernels read: (rows, scales, layout), the layout one of
        :data:`multihead.native.int8.COLUMNS`, ``BLOCKED``, ``PACKED`` (then rows and scales are both the
        packed rows (O, R)); no copies."""
        if self.packed:
            rows = self._buffer("rows_q8")
            return rows, rows, native_int8.PACKED
        return self._buffer("weight_int8"), self._buffer("scale"), int(self.blocked)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:  # in column order, as unpacked rows save
            w8, scale = layout.from_packed(destination.pop(prefix + "rows_q8"), self.in_features)
            rest = {k: destination.pop(k) for k in [prefix + "bias"] if k in destination}
            destination[prefix + "weight_int8"], destination[prefix + "scale"] = (
                layout.from_blocked(w8),
                scale,
            )
            destination.update(rest)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        keys = (prefix + "weight_int8", prefix + "scale")
        if self.packed and all(k in state_dict for k in keys):
            w8, scale = (state_dict[k] for k in keys)
            state_dict = {k: v for k, v in state_dict.items() if k not in keys}
            try:
                state_dict[prefix + "rows_q8"] = layout.to_packed(layout.to_blocked(w8), scale.float())
            except ValueError as e:
                args[4].append(f"while loading {keys[0]} and {keys[1]} into packed rows: {e}")  # error_msgs
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def why_not_native(self) -> str | None:
        """None when calls without gradient run the native int8 kernels, else why they run ``F.linear``."""
        reason = native.unavailable()
        if reason is not None:
            return reason
        w = self.kernel_tensors()[0]
        if w.device.type != "cpu":
            return f"the weight is on {w.device}; the kernel runs on the CPU"
        return None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the int8 numbers stand for, (O, I) in ``dtype``."""
        w8, scale = self._apart()  # packed rows read out once for both, not once for each
        w8 = layout.from_blocked(w8) if self.blocked else w8  # (O, I) in column order
        return dequantize_groups(w8, scale, self.group_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        w, scale, how = self.kernel_tensors()
        if native_input(x, w, self.in_features):
            lib = native.library()
            if lib is not None:
                x32 = x.reshape(-1, self.in_features).float().contiguous()  # (N, I)
                # one row (a decode step): the GEMV, its scratch on the stack; several (a prefill, a
                # batch): the multi-row product, the weights read once for up to 64 rows
                one = x32.shape[0] == 1
                run = native_int8.run_q8 if one else native_int8.run_gemm_q8
                y = run(lib, w, scale, x32[0] if one else x32, self.bias, self.group_size, how)
                return y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # (..., O)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), b)  # (..., O)

    def extra_repr(self) -> str:
        groups = "per output channel" if self.group_size is None else f"group_size={self.group_size}"
        groups += ", blocked rows" if self.blocked else ""
        groups += " with their scales" if self.packed else ""
        reason = self.why_not_native
        how = "native int8 kernels" if reason is None else f"F.linear ({reason})"
        return f"in_features={self.in_features}, out_features={self.out_features}, {groups}, {how}"
