"""What a decode step is held to: the bytes it reads (:func:`step_bytes`), the memory's rate over as
many bytes (:func:`read_bandwidth`: the step's bandwidth limit) and its matrix-vector products alone
(:func:`kernels_alone`: the floor for its weight format and kernels). ``multihead bench decode``
(:mod:`multihead.bench.decode`) and the decode benchmarks report a step's rate against both.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import native
from ..core.checks import check_int
from ..models import quant
from ..models.gemv_linear import GemvLinear
from ..models.lm import TransformerLM
from ..native import hugepages
from . import timing

__all__ = ["kernels_alone", "read_bandwidth", "step_bytes"]


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


def kernels_alone(model: nn.Module, activations: torch.dtype, reps: int = 3) -> timing.Timing:
    """The time of one pass through every linear layer of ``model`` with one token, back to back: the
    matrix-vector products of a decode step with nothing between them (at least ``reps`` samples).

    The floor of a step for this model's weight format and kernels: what the step would take if the
    rest (norms, rotary, attention over the cache, residuals, sampling, Python) cost nothing. Inputs are
    ``(1, 1, in_features)`` of dtype ``activations``. Where every layer runs a native kernel for the call
    (``native_product``: :class:`~multihead.models.gemv_linear.GemvLinear`,
    :class:`~multihead.models.int8_gemv_linear.Int8GemvLinear`, and a plain ``nn.Linear`` of a
    TransformerLM whose decode steps run natively), the pass is one native call running them all
    (:func:`multihead.native.products`), as a native decode step calls them from C; else each layer's
    module is called (a few microseconds of Python a layer, which a native step does not pay).

    Raises:
        ValueError: a model without linear layers, or ``reps`` < 1.
    """
    check_int("reps", reps, 1)
    kinds = (nn.Linear, quant.PackedLinear, quant.Int8Linear, quant.Int8GemvLinear)  # GemvLinear: nn.Linear
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    if not layers:
        raise ValueError(f"kernels_alone needs a model with linear layers; {type(model).__name__} has none")
    xs = [torch.randn(1, 1, m.in_features).to(activations) for m in layers]  # (1, 1, I) each
    native_steps = isinstance(model, TransformerLM) and model.why_not_native_steps is None
    # the layers as the step runs them: a native step runs the native GEMV on a plain linear's weight, so
    # its floor does too (the modules' own path - bf16 through F.linear - can be many times slower than
    # the whole step, and would not be its floor)
    runs = [GemvLinear.from_linear(m) if native_steps and type(m) is nn.Linear else m for m in layers]
    bounds = []
    for m, x in zip(runs, xs):  # each layer's native product, where its forward would run one
        direct = getattr(m, "native_product", None)
        bounds.append(None if direct is None else direct(x))
    lib, ready = native.library(), [b for b in bounds if b is not None]
    if lib is not None and len(ready) == len(bounds):  # all of them in one native call
        one_pass = native.products(lib, ready)
    else:

        def one_pass() -> None:
            for m, x in zip(runs, xs):
                m(x)

    with torch.inference_mode():
        return timing.measure(one_pass, min_samples=reps)
