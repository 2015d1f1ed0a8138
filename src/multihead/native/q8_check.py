"""The int8 kernels' part of the native library's self-check (:func:`.checks.check_library`): the
int8 product against float64 torch on the same int8 numbers, in every row layout the build reads, and
the activations' rounding against torch's."""

from __future__ import annotations

import ctypes

import torch

from . import layout

__all__ = ["check_q8"]


def check_q8(lib: ctypes.CDLL, g: torch.Generator) -> str | None:
    """The int8 product against float64 torch on the same int8 numbers: per-row scales and groups of 32
    and 64, odd widths (every tail); the activations' rounding against torch.round's."""
    for rows, cols, group in ((5, 7, 200), (3, 200, 32), (4, 1000, 64), (2, 1024, 1024), (3, 1100, 32)):
        x = torch.randn(cols, generator=g)  # (I,)
        pad = (cols + 63) // 64 * 64
        xq, xs = torch.empty(pad, dtype=torch.int8), torch.empty(pad // 32)  # (I64,), (I64 / 32,)
        lib.mh_quantize_q8(x.data_ptr(), 0, cols, xq.data_ptr(), xs.data_ptr())
        blocks = torch.nn.functional.pad(x, (0, pad - cols)).view(-1, 32)  # (I64 / 32, 32)
        want_s = blocks.abs().amax(1) / 127.0  # (I64 / 32,)
        want_q = torch.round(blocks / torch.where(want_s > 0, want_s, 1.0)[:, None]).clamp(-127, 127)
        if not (torch.equal(xs, want_s) and torch.equal(xq.view(-1, 32).float(), want_q)):
            return f"the built int8 activation rounding disagrees with torch ({cols} values)"
        w = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)  # (O, I)
        n_groups = 1 if group >= cols else (cols + group - 1) // group
        ws = torch.rand(rows, n_groups, generator=g) + 0.5  # (O, groups)
        wf = w.double() * ws.double().repeat_interleave(min(group, cols), 1)[:, :cols]  # (O, I)
        xf = (xq.double().view(-1, 32) * xs.double()[:, None]).view(-1)[:cols]  # (I,)
        ref = wf @ xf  # (O,)
        for blocked in (0, 1) if lib.mh_q8_blocked() else (0,):
            y = torch.empty(rows)  # (O,)
            wl = layout.to_blocked(w) if blocked else w  # (O, I)
            args = (xq.data_ptr(), xs.data_ptr(), None, y.data_ptr(), rows, cols, cols, group, blocked)
            lib.mh_gemv_q8(wl.data_ptr(), ws.data_ptr(), *args)
            err = float(((y.double() - ref).abs() / (wf.abs() @ xf.abs() + 1)).max())
            how = f"{rows}x{cols} {'blocked' if blocked else 'in order'}, group {group}"
            if not err <= 1e-5:
                return f"the built int8 kernel disagrees with torch ({how}: error {err:.2e})"
            many = torch.cat([x[None], torch.randn(5, cols, generator=g)])  # (6, I): 4 at once, then 2
            ys = torch.empty(6, rows)  # (6, O)
            lib.mh_gemm_q8(wl.data_ptr(), ws.data_ptr(), many.data_ptr(), None, ys.data_ptr(), 6, *args[4:])
            if not torch.equal(ys[0], y):
                return f"the built int8 kernel's rows at once disagree with its one row ({how})"
            if blocked and group == 32:  # the same rows packed with their scales: the same bits
                rows_p, yp = layout.to_packed(wl, ws), torch.empty(rows)  # (O, R), (O,)
                packed = (*args[:3], yp.data_ptr(), rows, cols, rows_p.stride(0), group, 2)
                lib.mh_gemv_q8(rows_p.data_ptr(), rows_p.data_ptr(), *packed)
                if not torch.equal(yp, y):
                    return f"the built int8 kernel disagrees with itself on packed rows ({how})"
    return None
