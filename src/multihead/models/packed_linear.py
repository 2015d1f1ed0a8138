"""oneDNN-prepacked linear layers: ``PackedLinear`` (fp32 or bf16) and ``Bf16Linear``.

The weight is reordered once by oneDNN for batch-1 products (``torch.ops.mkldnn._reorder_linear_weight``)
and multiplied by ``torch.ops.mkldnn._linear_pointwise``; see :mod:`multihead.models.quant` for when
``mh.quant.quantize`` builds them and what they gain. Shape legend: I input features, O output
features, ... leading dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PACKED_DTYPES", "Bf16Linear", "PackedLinear", "bf16_prepack_unavailable", "prepack_unavailable"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def prepack_unavailable(dtype: torch.dtype) -> str | None:
    """Why oneDNN's prepacked linear cannot run here for ``dtype`` (fp32 / bf16), or None when it can
    (asked on every call)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    if dtype != torch.bfloat16:
        return None
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError) as e:  # an older or stripped torch
        return f"torch cannot tell whether oneDNN supports bf16 ({e})"
    return None if supported else "oneDNN reports no bf16 support on this CPU"


def bf16_prepack_unavailable() -> str | None:
    """Why oneDNN's prepacked bf16 linear cannot run here, or None when it can (asked on every call)."""
    return prepack_unavailable(torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W (fp32 or bf16) prepacked by oneDNN for batch-1 products; see the module doc.

    ``x`` (..., I) -> (..., O), in the layer's dtype, equal to ``F.linear(x, W, b)`` on the plain weight up
    to the order of the sums (bit-identical for bf16 in our tests; within 1e-6 relative for fp32). When
    packing is impossible (:func:`prepack_unavailable`, or a weight that is not on the CPU) the layer
    keeps the plain weight as its ``weight`` buffer, runs ``F.linear`` and keeps the reason in
    ``why_not_packed`` (None when packed). ``.weight`` of a packed layer is a plain copy made on access
    (for the rare code that reads it); ``state_dict`` holds the plain ``weight``; moving or casting the
    layer off the CPU or to another dtype unpacks it (with the reason).

    Args:
        linear: the layer to pack.
        dtype: torch.float32 or torch.bfloat16 (the weight and bias are converted); None: the weight's.

    Raises:
        ValueError: a dtype other than fp32 / bf16; at call time, an input of another dtype while packed,
            or one that requires grad with grad enabled (the oneDNN op has no backward: its gradient would
            be silently missing).
    """

    bias: Tensor | None

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = linear.weight.dtype if dtype is None else dtype
        if dtype not in PACKED_DTYPES:
            raise ValueError(f"PackedLinear packs torch.float32 or torch.bfloat16 weights, got dtype {dtype}")
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        self._packed: Tensor | None = None
        self.why_not_packed: str | None = None
        self._set_weight(linear.weight.detach().to(dtype))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())

    def _set_weight(self, w: Tensor) -> None:
        """Pack the plain weight w (O, I) when possible, else keep it as the ``weight`` buffer."""
        reason = prepack_unavailable(self.dtype)
        if reason is None and (w.dtype != self.dtype or w.device.type != "cpu"):
            reason = (
                f"the weight is {w.dtype} on {w.device}; this layer packs {self.dtype} weights on the CPU"
            )
        self.why_not_packed = reason
        if reason is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                w.contiguous(), batch_size=1
            )  # opaque (O, I)
            self._buffers.pop("weight", None)
        else:
            self._packed = None
            self.register_buffer("weight", w.clone())  # (O, I)

    @property
    def packed(self) -> bool:
        """True when calls run oneDNN's prepacked kernel."""
        return self._packed is not None

    def dense_weight(self) -> Tensor:
        """The plain weight (O, I): a copy when packed."""
        if self._packed is not None:
            return self._packed.to_dense()
        w = self._buffers["weight"]
        assert w is not None
        return w

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and self.__dict__.get("_packed") is not None:
            return self.dense_weight()
        return super().__getattr__(name)

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{type(self).__name__} is inference only: x requires grad and oneDNN's packed linear has "
                "no backward; "
                "call under torch.no_grad() / torch.inference_mode(), or train the float model"
            )
        if self._packed is None:
            return F.linear(x, self._buffers["weight"], self.bias)  # type: ignore[arg-type]
        if x.dtype != self.dtype:
            raise ValueError(
                f"{type(self).__name__} needs {self.dtype} input x, got {x.dtype}; cast the model's input"
            )
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")  # (..., O)

    # -- plain weight for state_dict, copies and moves ---------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._packed is not None:
            destination[prefix + "weight"] = self._packed.to_dense()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        if self._packed is not None:
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
            elif tuple(state_dict[key].shape) != (self.out_features, self.in_features):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, "
                    f"the shape in current model is {(self.out_features, self.in_features)}."
                )
            else:
                self._set_weight(state_dict[key].detach().to(self.dtype))
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        if self._packed is not None:  # an opaque oneDNN tensor has no storage to copy or pickle
            state["_packed"], state["_plain_weight"] = None, self._packed.to_dense()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        plain = state.pop("_plain_weight", None)
        super().__setstate__(state)
        if plain is not None:
            self._set_weight(plain)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self._packed is not None:
            probe = fn(torch.empty(0, dtype=self.dtype))
            if probe.dtype != self.dtype or probe.device.type != "cpu":
                self._set_weight(fn(self._packed.to_dense()))  # unpacks, with the reason
        return self

    def extra_repr(self) -> str:
        how = "oneDNN packed" if self._packed is not None else f"F.linear ({self.why_not_packed})"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.dtype}, {how}"

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight (0 when not packed: the plain weight is an ordinary buffer)."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        return size * self.in_features * self.out_features if self._packed is not None else 0


class Bf16Linear(PackedLinear):
    """A :class:`PackedLinear` in bf16: ``Bf16Linear(linear)`` converts the weight (and bias) to bf16."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, torch.bfloat16)
