"""KV-cache size: the dense cache of K and V for every layer, and MHA vs GQA vs MQA side by side."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVVariant", "compare_kv_heads", "kv_cache_bytes"]


def kv_cache_bytes(
    n_layers: int, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of a dense KV cache: ``2 (K and V) * n_layers * batch * seq_len * n_kv_heads * head_dim``
    elements of ``dtype``.

    Raises:
        ValueError: if a size is negative.
    """
    sizes = {
        "n_layers": n_layers,
        "batch": batch,
        "seq_len": seq_len,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
    }
    for name, val in sizes.items():
        if val < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class KVVariant:
    """One row of :func:`compare_kv_heads`."""

    name: str
    n_kv_heads: int
    bytes: int
    vs_mha: float  # bytes / bytes of the MHA cache

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


def _variant_name(n_heads: int, kv: int) -> str:
    if kv == n_heads:
        return "MHA"
    return "MQA" if kv == 1 else f"GQA-{kv}"


def compare_kv_heads(
    n_layers: int,
    batch: int,
    seq_len: int,
    n_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    kv_heads: tuple[int, ...] | None = None,
) -> list[KVVariant]:
    """KV-cache size of MHA vs GQA vs MQA for one model shape.

    ``kv_heads`` defaults to ``(n_heads, n_heads // 4, 1)`` (MHA, a GQA with groups of 4, MQA), with
    duplicates removed.

    Raises:
        ValueError: if some entry of ``kv_heads`` does not divide ``n_heads``.
    """
    if kv_heads is None:
        kv_heads = tuple(dict.fromkeys((n_heads, max(n_heads // 4, 1), 1)))
    for kv in kv_heads:
        if kv < 1 or n_heads % kv:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({kv})")
    mha = kv_cache_bytes(n_layers, batch, seq_len, n_heads, head_dim, dtype)
    rows = []
    for kv in kv_heads:
        nbytes = kv_cache_bytes(n_layers, batch, seq_len, kv, head_dim, dtype)
        rows.append(KVVariant(_variant_name(n_heads, kv), kv, nbytes, nbytes / mha if mha else 0.0))
    return rows
