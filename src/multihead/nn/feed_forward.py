"""The position-wise feed-forward network FFN of the Transformer block (docs/equations.md, eq. (11)).

The same two-layer network is applied to each of the N rows of the packed input independently:

    FFN(x) = W2 act(W1 x + b1) + b2                     relu | gelu | gelu_tanh | silu
    FFN(x) = w2(silu(w1 x) * w3 x)                      swiglu (Shazeer 2020; LLaMA, Mistral, Qwen2)

Parameter names: ``linear1`` / ``linear2`` for the plain activations (the names of
``torch.nn.TransformerEncoderLayer``), ``w1`` / ``w2`` / ``w3`` for SwiGLU (the names of Meta's LLaMA:
w1 = gate, w3 = up, w2 = down).

Dropout (training only) is applied to the hidden activation and to the output, the two places
``torch.nn.TransformerEncoderLayer`` drops (its ``dropout`` and ``dropout2``), so a layer built from
this module needs no extra dropout on the FFN residual branch.

Shape legend: B batch, N tokens, d = d_model, F = d_ff. Input ``(..., d)``, output ``(..., d)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "FeedForward"]

_PLAIN: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
ACTIVATIONS = (*_PLAIN, "swiglu")


def check_dropout(dropout: float, name: str = "dropout") -> float:
    """Return ``dropout`` as a float after checking it is in [0, 1)."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {dropout!r}; use 0.0 to disable it")
    return float(dropout)


class FeedForward(nn.Module):
    """Position-wise FFN ``(..., d_model) -> (..., d_model)`` with hidden width ``d_ff``.

    Args:
        d_model: input and output width d.
        d_ff: hidden width F (LLaMA uses about 8/3 d for SwiGLU, the original Transformer 4 d).
        activation: "relu" | "gelu" | "gelu_tanh" | "silu" | "swiglu".
        bias: biases on the linear layers (LLaMA / PaLM: none).
        dropout: dropout probability on the hidden activation and the output, training only.

    Raises:
        ValueError: unknown activation, non-positive widths, dropout outside [0, 1), or an input whose
            last dim is not d_model.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "relu",
        bias: bool = True,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, val in (("d_model", d_model), ("d_ff", d_ff)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"FeedForward {name} must be an int >= 1, got {val!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.dropout = check_dropout(dropout)
        fk = {"bias": bias, "device": device, "dtype": dtype}
        if activation == "swiglu":
            self.w1 = nn.Linear(d_model, d_ff, **fk)  # gate
            self.w3 = nn.Linear(d_model, d_ff, **fk)  # up
            self.w2 = nn.Linear(d_ff, d_model, **fk)  # down
        else:
            self.linear1 = nn.Linear(d_model, d_ff, **fk)
            self.linear2 = nn.Linear(d_ff, d_model, **fk)
        self.hidden_dropout = nn.Dropout(self.dropout)
        self.out_dropout = nn.Dropout(self.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"FeedForward input must have last dim d_model={self.d_model}, got shape {tuple(x.shape)}"
            )
        if self.activation == "swiglu":
            h = F.silu(self.w1(x)) * self.w3(x)  # (..., F)
            return self.out_dropout(self.w2(self.hidden_dropout(h)))
        h = _PLAIN[self.activation](self.linear1(x))  # (..., F)
        return self.out_dropout(self.linear2(self.hidden_dropout(h)))

    def extra_repr(self) -> str:
        act = self.activation
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={act!r}, dropout={self.dropout}"
