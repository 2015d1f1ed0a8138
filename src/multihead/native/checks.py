"""The self-check every build passes before it is used: each kernel on odd shapes (every tail of its
loops) against torch in float64, the rows-at-once kernels against their one-row bits, the int8 and GGUF
block kernels (:mod:`.q8_check`, :mod:`.q4_check`), then the decode layers' step (:mod:`.step_check`).
A build that fails it is never used; the reason is what :func:`multihead.native.unavailable` reports.
"""

from __future__ import annotations

import ctypes

import torch

from . import q4_check, q8_check, step_check
from .signatures import KIND, GreedyArgs, LayerArgs

__all__ = ["check_library", "check_team_steps"]


def check_library(lib: ctypes.CDLL) -> str | None:
    """Run the kernels on odd shapes (every tail of the loops) and compare with torch, then the decode
    layers' step (:func:`check_team_steps`: on a team of threads where this process has two or more);
    a reason or None."""
    for name, mirror in (("layer", LayerArgs), ("greedy", GreedyArgs)):  # a mismatch: wrong addresses
        built = getattr(lib, f"mh_{name}_args_bytes")()
        if built != ctypes.sizeof(mirror):
            return (
                f"the built library's {name} arguments take {built} bytes, multihead.native."
                f"{mirror.__name__} {ctypes.sizeof(mirror)}: the sources and this module disagree"
            )
    g = torch.Generator().manual_seed(0)
    kernels = [(torch.float32, lib.mh_gemv_f32), (torch.bfloat16, lib.mh_gemv_bf16)]
    if lib.mh_gemv_has_f16():
        kernels.append((torch.float16, lib.mh_gemv_f16))
    for dtype, fn in kernels:
        for rows, cols in ((5, 7), (3, 200), (2, 1024)):
            w = torch.randn(rows, cols + 3, generator=g).to(dtype)[:, :cols]  # (O, I), row stride I + 3
            x = torch.randn(cols, generator=g).to(dtype)  # (I,)
            b = torch.randn(rows, generator=g).to(dtype)  # (O,)
            y = torch.empty(rows, dtype=dtype)  # (O,)
            fn(w.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), rows, cols, w.stride(0))
            ref = w.double() @ x.double() + b.double()  # (O,)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            err = float(((y.double() - ref).abs() / (ref.abs() + 1)).max())
            if not err <= tol:
                return f"the built kernel disagrees with torch ({dtype}, {rows}x{cols}: error {err:.2e})"
            xs = torch.cat([x[None], torch.randn(2, cols, generator=g).to(dtype)])  # (3, I)
            ys = torch.empty(3, rows, dtype=dtype)  # (3, O)
            pointers = (w.data_ptr(), xs.data_ptr(), b.data_ptr(), ys.data_ptr())
            lib.mh_gemv_rows(KIND[dtype], *pointers, 3, rows, cols, w.stride(0))
            if not torch.equal(ys[0], y):
                return f"the built kernel's rows at once disagree with its one row ({dtype}, {rows}x{cols})"
    return q8_check.check_q8(lib, g) or q4_check.check_gguf(lib, g) or check_team_steps(lib)


def check_team_steps(lib: ctypes.CDLL) -> str | None:
    """The decode layers' step on a team of threads against their one-row loop, and the fp32 step against
    float64 torch (:mod:`.step_check`), in every storage dtype and int8 row layout the build has."""
    layouts = (0, 1, 2) if lib.mh_q8_blocked() else (0,)
    return step_check.check_steps(lib, LayerArgs, KIND, bool(lib.mh_gemv_has_f16()), layouts)
