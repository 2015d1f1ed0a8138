"""``GemvLinear``: an ``nn.Linear`` whose one-row calls (a decode step) and few-row calls (a batch's
step) run the native GEMV.

``y = x W^T + b``. When ``x`` holds a single row (``x.numel() == in_features``: batch 1, one token), is
of the weight's dtype (fp32, bf16 or fp16), sits on the CPU and needs no gradient, the product runs
:func:`multihead.native.gemv`, which reads the weight at the memory's bandwidth; a few rows (up to
:data:`ROWS_NATIVE`: a batch's decode step) run :func:`multihead.native.run_rows`, each row with the bits
of its one-row call and the weight read once; every other call (a prefill, training, another device) is
``F.linear`` on the same weight. Results equal
``F.linear``'s up to the order of the sums (fp32 accumulation in every dtype; bf16 and fp16 round each
output once). It is an ``nn.Linear``: same parameters, ``state_dict``, copies and moves; only
``forward`` differs. ``mh.quant.quantize(lm, weights="fp32" | "bf16" | "fp16")`` builds it for a
TransformerLM (``kernel="native"``, what "auto" picks there).

Shape legend: I input features, O output features, ... leading dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native

__all__ = ["ROWS_NATIVE", "GemvLinear"]

#: Calls of up to this many rows (a batch's decode step) run the native kernels, each row as its one-row
#: call gives it, the weight read from memory once; more rows (a prefill, a larger batch) are
#: ``F.linear``'s, whose blocked matrix products do more arithmetic per byte than the row kernels (on
#: llama-155m, one Zen 5 thread, a batch's step: 2 and 4 rows 1.2-1.8x faster native, 8 mixed, 16 rows
#: 1.4-1.5x slower; BENCHMARKS.md).
ROWS_NATIVE = 4


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` (see the module doc) with the native kernel for one-row CPU calls (fp32, bf16,
    fp16 where :func:`multihead.native.dtypes` has it).

    Build it with :meth:`from_linear` (shares the layer's parameters) or as an ``nn.Linear``.
    ``why_not_native`` is None when the kernel can run here, else the reason every call is ``F.linear``.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> GemvLinear:
        """A GemvLinear holding ``linear``'s own weight and bias tensors (no copy; a tie stays a tie)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight
        out.bias = linear.bias
        return out

    @property
    def why_not_native(self) -> str | None:
        """None when calls of 1 to ROWS_NATIVE rows run the native kernels, else why they run ``F.linear``."""
        reason = native.unavailable()
        if reason is not None:
            return reason
        w = self.weight
        if w.dtype not in native.dtypes() or w.device.type != "cpu":
            return (
                f"the weight is {w.dtype} on {w.device}; the kernel takes {list(native.dtypes())} on the CPU"
            )
        if w.stride(-1) != 1 and w.shape[-1] > 1:
            return f"the weight's columns are not contiguous (strides {w.stride()})"
        return None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        n = x.numel() // self.in_features if self.in_features and x.dim() >= 1 else 0  # rows of x
        if 1 <= n <= ROWS_NATIVE and self._native_fits(x):
            lib = native.library()
            if lib is not None and w.dtype in native.dtypes():
                b = None if self.bias is None else self.bias.contiguous()
                if n == 1:  # a decode step
                    y = native.run(lib, w, x.reshape(-1).contiguous(), b)  # (O,)
                else:  # a batch's step: the weight read once for the rows
                    y = native.run_rows(lib, w, x.reshape(n, self.in_features).contiguous(), b)  # (N, O)
                return y.view(*x.shape[:-1], self.out_features)  # (..., O)
        return F.linear(x, w, self.bias)  # (..., O)

    def _native_fits(self, x: Tensor) -> bool:
        """Whether the native kernels can take this call: x of the weight's dtype, both on the CPU, no
        gradient wanted, the weight's columns contiguous, a bias (if any) of the same dtype on the CPU, no
        torch dispatch mode watching (:func:`multihead.native.watched`)."""
        w, b = self.weight, self.bias
        return (
            x.shape[-1] == self.in_features
            and x.dtype == w.dtype
            and x.device.type == "cpu"
            and w.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and (w.stride(-1) == 1 or self.in_features == 1)
            and (b is None or (b.dtype == w.dtype and b.device.type == "cpu"))
            and not native.watched()  # a FLOP counter or fake tensors see F.linear, not a native call
        )

    def extra_repr(self) -> str:
        reason = self.why_not_native
        how = f"native GEMV for 1-{ROWS_NATIVE} rows" if reason is None else f"F.linear ({reason})"
        return f"{super().extra_repr()}, {how}"
