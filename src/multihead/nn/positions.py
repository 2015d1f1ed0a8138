"""Position information: absolute tables added to the input, and rotary embeddings applied to q and k.

Shape legend: B batch, H heads, N positions, D head dim, d model width.

- :class:`SinusoidalPositions` is the fixed table of Vaswani et al. (2017)::

      PE[pos, 2i]   = sin(pos / 10000^(2i/d))
      PE[pos, 2i+1] = cos(pos / 10000^(2i/d))

  computed once into a lookup table and gathered by position index (it does not depend on the input).
- :class:`LearnedPositions` is the same lookup over a trained table (BERT, GPT-2).
- :class:`RotaryEmbedding` (Su et al., 2021, RoFormer; LLaMA, Mistral, Qwen2) rotates each pair of
  q/k features by ``pos * theta_i`` with ``theta_i = base^(-2i/D)``, so that ``q_m . k_n`` depends on the
  positions only through ``m - n``.
- :class:`PartialRotary` rotates only some of those pairs, a chosen subset per group of heads, at their
  original frequencies (the partial RoPE of MHA2MLA, Ji et al., 2025).

The two rotary modules live in :mod:`multihead.nn.rotary` (re-exported here), the argument checks the
modules share in :mod:`multihead.nn.position_checks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .position_checks import check_in_table, check_positions, check_size
from .rotary import PartialRotary, RotaryEmbedding

__all__ = ["LearnedPositions", "PartialRotary", "RotaryEmbedding", "SinusoidalPositions", "sinusoidal_table"]


def sinusoidal_table(max_len: int, d_model: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """The (max_len, d_model) sinusoidal table, computed in float64 and cast to ``dtype``.

    With odd ``d_model`` the last column is a sine (column ``d - 1 = 2i`` is even).
    """
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(d/2),)
    angle = pos / 10000.0 ** (two_i / d_model)  # (max_len, ceil(d/2))
    pe = torch.empty(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)  # even columns, ceil(d/2) of them
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])  # odd columns, floor(d/2) of them
    return pe.to(dtype)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position encodings, precomputed once into a lookup table.

    Args:
        d_model: width d of each encoding.
        max_len: number of rows; positions must be < max_len.
        dtype: table dtype, default ``torch.get_default_dtype()``.
        device: table device.

    The table is a non-persistent buffer ``table`` of shape (max_len, d_model): it is derived, so it is not
    saved in the state dict, and it follows ``.to()``.

    Raises:
        ValueError: if ``d_model`` or ``max_len`` is not an int >= 1.
    """

    table: Tensor

    def __init__(
        self,
        d_model: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.max_len = check_size("max_len", max_len)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        table = sinusoidal_table(max_len, d_model, dtype).to(device)  # (max_len, d)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """Look up encodings: positions (N,) -> (N, d), or (B, N) -> (B, N, d).

        Raises:
            ValueError: if positions are not an integer tensor of 1 or 2 dims, or lie outside [0, max_len).
        """
        positions = check_positions(positions, "SinusoidalPositions")
        check_in_table(positions, self.max_len, "SinusoidalPositions")
        return self.table[positions.to(self.table.device)]  # (N, d) or (B, N, d)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class LearnedPositions(nn.Module):
    """A trained position table (BERT, GPT-2 ``wpe``), looked up like :class:`SinusoidalPositions`.

    Args:
        max_len: number of rows; positions must be < max_len.
        d_model: width d of each encoding.
        dtype, device: of the parameter ``weight`` (max_len, d_model), initialised N(0, 0.02^2) as GPT-2.

    Raises:
        ValueError: if ``max_len`` or ``d_model`` is not an int >= 1.
    """

    def __init__(
        self,
        max_len: int,
        d_model: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.max_len = check_size("max_len", max_len)
        self.d_model = check_size("d_model", d_model)
        self.weight = nn.Parameter(torch.empty(max_len, d_model, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    @property
    def table(self) -> Tensor:
        """The (max_len, d_model) table (the parameter itself)."""
        return self.weight

    def forward(self, positions: Tensor) -> Tensor:
        """Look up encodings: positions (N,) -> (N, d), or (B, N) -> (B, N, d).

        Raises:
            ValueError: if positions are not an integer tensor of 1 or 2 dims, or lie outside [0, max_len).
        """
        positions = check_positions(positions, "LearnedPositions")
        check_in_table(positions, self.max_len, "LearnedPositions")
        return F.embedding(positions.to(self.weight.device), self.weight)  # (N, d) or (B, N, d)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"
