"""What a decode step is held to: the bytes it reads (:func:`step_bytes`) and the memory's rate over as
many bytes (:func:`read_bandwidth`: the step's bandwidth limit). ``multihead bench decode``
(:mod:`multihead.bench.decode`) and the decode benchmarks report a step's rate against it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.checks import check_int
from ..models import quant
from ..native import hugepages
from . import timing

__all__ = ["read_bandwidth", "step_bytes"]


def step_bytes(model: nn.Module, embedding: str) -> int:
    """Bytes one decode step reads: every parameter and buffer but the input embedding's (one row of it
    is read), each storage once; a storage the output head ``lm_head`` shares with the embedding is
    counted; the oneDNN-packed weight of a :class:`~multihead.models.quant.PackedLinear` counts its
    dtype's bytes per element.

    Args:
        model: a causal LM with an ``lm_head`` submodule.
        embedding: the input embedding's submodule path ("embed", "model.embed_tokens").
    """
    emb = model.get_submodule(embedding)
    skip = {t.untyped_storage().data_ptr() for t in [*emb.parameters(), *emb.buffers()]}
    head = model.get_submodule("lm_head")
    skip -= {t.untyped_storage().data_ptr() for t in [*head.parameters(), *head.buffers()]}
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    packed = [m.packed_bytes for m in model.modules() if isinstance(m, quant.PackedLinear)]
    return sum(seen.values()) + sum(packed)


def read_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Read bandwidth (bytes/s) over ``nbytes`` of fp32, read again and again: the faster of a sum (a
    pure streaming read) and a matrix-vector product (what decoding repeats) over the same matrix, each
    timed by :func:`multihead.bench.timing.measure_all` (the fastest sample counts: the limit is the best
    the memory system allows).

    A decode step reads its weights once per token, again and again, so the limit of a step that reads
    ``nbytes`` is this probe over ``nbytes``: from memory for a model larger than the caches, from the
    caches for a small one (a probe over 256 MiB would put a small model's rate above its limit). The
    sum sets the figure where torch's fp32 matrix-vector kernel reads slower than memory allows (on an
    AVX-512 CPU, one thread: ~43 GB/s for the sum and for oneDNN's packed products, ~29 GB/s for
    ``torch.mv``), so the limit is the memory system's, not one kernel's. The matrix lies in 2 MiB pages
    (:mod:`multihead.native.hugepages`), as the native kernels' weights do: with 4 KiB pages the TLB misses
    cost a third of the rate on some machines, and the limit would sit below what those kernels reach.

    Raises:
        ValueError: ``nbytes`` under 64 KiB, ``reps`` < 1, or the reads too short to measure.
    """
    check_int("nbytes", nbytes, 1 << 16)
    check_int("reps", reps, 1)
    n = int((nbytes // 4) ** 0.5)
    a, x = torch.ones(n, n), torch.ones(n)  # (n, n), (n,): the values do not matter, the bytes do
    hugepages.move_to_huge_pages([a])  # the best the memory allows: 2 MiB pages, as native weights
    times = timing.measure_all({"mv": lambda: torch.mv(a, x), "sum": a.sum}, min_samples=reps)
    best = [t.best for t in times.values() if t.best is not None]
    if not best:
        raise ValueError(f"reading {nbytes} bytes was too short to measure: {times['sum'].why}")
    return a.numel() * 4 / min(best)
