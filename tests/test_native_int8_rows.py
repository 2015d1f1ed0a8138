"""The native int8 product over several activation rows at once (``gemm_q8``, a prefill or a batch):
each row equal bit for bit to the one-row GEMV (every tile edge, layout, group size and tail), float64
on the same int8 numbers, its errors, and Int8GemvLinear / the int8 model running it for prompts and
batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import native
from multihead.models import quant
from multihead.models.int8_gemv_linear import dequantize_groups, quantize_groups
from multihead.native import int8 as native_int8
from multihead.native.layout import to_blocked

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
LAYOUTS = [False, True] if REASON is None and native_int8.reads_blocked() else [False]


@needs_native
@pytest.mark.parametrize("blocked", LAYOUTS)
@pytest.mark.parametrize(
    ("cols", "group"),
    [(7, None), (96, 32), (512, 32), (1024, None), (1100, 64), (2816, 32), (1600, 192), (2048, 128)],
)
@pytest.mark.parametrize("n", [2, 4, 7, 64, 69])  # four at once and the rest; one tile of 64 and past it
def test_rows_at_once_equal_the_one_row_product_bit_for_bit(blocked, cols, group, n):
    g = torch.Generator().manual_seed(cols * 100 + n)
    rows = 5
    w8, scale = quantize_groups(torch.randn(rows, cols, generator=g), group)
    w = to_blocked(w8) if blocked else w8  # (O, I)
    x = torch.randn(n, cols, generator=g) * 2  # (N, I)
    b = torch.randn(rows, generator=g) if n % 2 else None  # (O,)
    y = native_int8.gemm_q8(w, scale, x, b, group, blocked)
    assert y.shape == (n, rows) and y.dtype == torch.float32
    one = torch.stack([native_int8.gemv_q8(w, scale, x[i], b, group, blocked) for i in range(n)])  # (N, O)
    assert torch.equal(y, one)
    xq, xs = native_int8.quantize_activations(x[-1])  # the last row against float64
    wd = dequantize_groups(w8, scale.double(), group, torch.float64)  # (O, I)
    xd = (xq.double().view(-1, 32) * xs.double()[:, None]).view(-1)[:cols]  # (I,)
    ref = wd @ xd + (0 if b is None else b.double())  # (O,)
    assert float(((y[-1].double() - ref).abs() / (wd.abs() @ xd.abs() + 1)).max()) < 1e-6


@needs_native
def test_no_rows_and_bad_inputs():
    w8, scale = quantize_groups(torch.randn(4, 64), 32)
    assert native_int8.gemm_q8(w8, scale, torch.empty(0, 64), None, 32).shape == (0, 4)
    wrong = r"gemm_q8 needs weight \(O, I\), scale .* and x \(N, I\), got .* \(64,\)"
    with pytest.raises(ValueError, match=wrong):
        native_int8.gemm_q8(w8, scale, torch.randn(64), None, 32)
    with pytest.raises(ValueError, match=r"and x \(N, I\), got .* \(3, 65\)"):
        native_int8.gemm_q8(w8, scale, torch.randn(3, 65), None, 32)
    with pytest.raises(ValueError, match=r"gemm_q8 needs bias \(O,\) = \(4,\), got \(3,\)"):
        native_int8.gemm_q8(w8, scale, torch.randn(2, 64), torch.randn(3), 32)
    with pytest.raises(ValueError, match="gemm_q8 has no backward"):
        native_int8.gemm_q8(w8, scale, torch.randn(2, 64, requires_grad=True), None, 32)


@needs_native
@pytest.mark.parametrize("group", [None, 32, 64])
def test_int8_gemv_linear_runs_prompts_and_batches_natively(group, monkeypatch):
    """Several rows (any leading shape, fp32 or bf16 input) go through run_gemm_q8, each row as its
    one-row call gives it; the result within the activation rounding of F.linear on the dequantized
    weight."""
    torch.manual_seed(0)
    layer = quant.Int8GemvLinear(torch.nn.Linear(200, 96), group)
    calls = []
    real = native_int8.run_gemm_q8
    monkeypatch.setattr(native_int8, "run_gemm_q8", lambda *a: calls.append(a[3].shape) or real(*a))
    with torch.no_grad():
        x = torch.randn(3, 5, 200)  # (B, S, I)
        y = layer(x)
        assert calls == [(15, 200)] and y.shape == (3, 5, 96)
        rows = torch.stack([layer(r.view(1, 200))[0] for r in x.view(-1, 200)])  # (15, O): one row each
        assert torch.equal(y.view(-1, 96), rows) and len(calls) == 1
        torch.testing.assert_close(y, F.linear(x, layer.dequantized(), layer.bias), rtol=0.02, atol=0.02)
        yb = layer(x.bfloat16())
        assert yb.dtype == torch.bfloat16 and len(calls) == 2


@needs_native
def test_an_int8_model_prefills_and_decodes_a_batch_through_the_rows_at_once_product(monkeypatch):
    """A prompt and a batch's steps reach the multi-row kernel (no dequantized copy of any weight); the
    model stays within the stated tolerance of fp32 (0.05 of the logit range) and a batch generates
    what each of its sequences generates alone."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(500, 64, 2, 4, 128, n_kv_heads=2).eval()
    q = quant.quantize(lm, weights="int8", kv="int8", kernel="native", group_size=32)
    deq = []
    monkeypatch.setattr(quant.Int8GemvLinear, "dequantized", lambda self, *a: deq.append(1) or 1 / 0)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = lm(ids), q(ids)
        assert float((out - ref).abs().max()) <= 0.05 * float(ref.max() - ref.min())
        both = q.generate(ids, 6)
        alone = torch.cat([q.generate(ids[i : i + 1], 6) for i in range(2)])
    assert torch.equal(both, alone) and not deq
