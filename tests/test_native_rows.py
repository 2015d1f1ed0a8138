"""The native float products of a few rows at once (``mh_gemv_rows``: a batch's decode step): each row
with the bits of its one-row product, GemvLinear's routing of row counts, and a batch of a native fp32 /
bf16 model generating what each sequence generates alone."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import quant
from multihead.models.gemv_linear import ROWS_NATIVE, GemvLinear
from tests.native_builds import built_for

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(5, 7), (3, 200), (70, 1024), (600, 130)])  # 600 x 130: blocks
@pytest.mark.parametrize("n", [2, 5, 16])  # the kernel takes any count; GemvLinear sends it up to ROWS_NATIVE
def test_rows_at_once_equal_the_one_row_product_bit_for_bit(dtype, rows, cols, n):
    if dtype not in native.dtypes():
        pytest.skip(f"this build has no native {dtype} kernel: {list(native.dtypes())}")
    g = torch.Generator().manual_seed(rows * 10 + n)
    w = torch.randn(rows, cols + 3, generator=g).to(dtype)[:, :cols]  # (O, I), row stride I + 3
    x = torch.randn(n, cols, generator=g).to(dtype)  # (N, I)
    b = torch.randn(rows, generator=g).to(dtype) if n % 2 else None  # (O,)
    lib = native.library()
    y = native.run_rows(lib, w, x, b)  # (N, O)
    assert y.shape == (n, rows) and y.dtype == dtype
    one = torch.stack([native.gemv(w, x[i], b) for i in range(n)])  # (N, O)
    assert torch.equal(y, one)


@needs_native
def test_an_avx2_build_s_rows_at_once_equal_its_one_row_products(monkeypatch):
    """The build for AVX2 + F16C (no AVX-512: the generic vector kernels; bf16 without VDPBF16PS, fp16
    widened once and run row by row): each row's bits those of its one-row product, as above."""
    with built_for("x86-64-v3", "avx2", monkeypatch):
        assert native.unavailable() is None and not native.has_dpbf16()
        lib = native.library()
        g = torch.Generator().manual_seed(3)
        for dtype in native.dtypes():
            w = torch.randn(70, 203, generator=g).to(dtype)  # (O, I): 128 + 64 + 11 values a row
            x = torch.randn(5, 203, generator=g).to(dtype)  # (N, I): two pairs and one row
            b = torch.randn(70, generator=g).to(dtype)  # (O,)
            one = torch.stack([native.gemv(w, x[i], b) for i in range(5)])  # (N, O)
            assert torch.equal(native.run_rows(lib, w, x, b), one), dtype


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_linear_runs_a_batch_step_natively_and_a_prompt_through_f_linear(dtype, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200).to(dtype)
    layer = GemvLinear.from_linear(lin)
    calls = []
    real = native.run_rows
    monkeypatch.setattr(native, "run_rows", lambda *a: calls.append(tuple(a[2].shape)) or real(*a))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        x = torch.randn(4, 1, 96).to(dtype)  # (B, 1, I): four sequences' step
        y = layer(x)
        assert calls == [(4, 96)] and y.shape == (4, 1, 200)
        assert torch.equal(y[2, 0], layer(x[2, 0]))  # the bits of that row's one-row call
        torch.testing.assert_close(y, lin(x), rtol=tol, atol=1e-4)
        layer(torch.randn(ROWS_NATIVE, 96).to(dtype))
        assert calls[-1] == (ROWS_NATIVE, 96)
        x = torch.randn(ROWS_NATIVE + 1, 96).to(dtype)  # a prompt: F.linear
        assert torch.equal(layer(x), lin(x)) and len(calls) == 2
        assert layer(torch.empty(0, 96).to(dtype)).shape == (0, 200) and len(calls) == 2


@needs_native
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_a_batch_generates_what_each_sequence_generates_alone(weights):
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, 64, 2, 4, 128, n_kv_heads=2).eval()
    q = quant.quantize(lm, weights=weights, kv=None)
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        both = q.generate(ids, 8)
        alone = torch.cat([q.generate(ids[i : i + 1], 8) for i in range(3)])
    assert torch.equal(both, alone)


@needs_native
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_a_flop_counter_sees_the_step_s_matrix_products(weights, monkeypatch):
    """Under a torch dispatch mode (here FlopCounterMode) the native kernels stand aside: a batch-1
    decode step of a native model runs its eager modules (no native step, no native GEMV), so the
    counted products are the step's, as mh.cost.estimate gives them."""
    from torch.utils.flop_counter import FlopCounterMode

    from multihead import cost
    from multihead.models import native_step

    torch.manual_seed(0)
    lm = mh.TransformerLM(100, 64, 2, 4, 96, n_kv_heads=2, tie_embeddings=False).eval()
    q = quant.quantize(lm, weights=weights, kv=None, group_size=32 if weights == "int8" else None)
    for m in q.modules():  # the attention as matrix products the counter sees (not a fused kernel)
        if isinstance(m, mh.MultiHeadAttention):
            m.backend = "matrix"
    steps = []
    monkeypatch.setattr(native_step, "decode_step", lambda *a: steps.append(1) / 0)
    cache = q.make_cache(1, 32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        q(torch.randint(0, 100, (1, 12)), cache=cache)  # the prompt
        before = counter.get_total_flops()
        q(torch.randint(0, 100, (1, 1)), cache=cache)  # one step
    want = cost.estimate(lm, 1, 13, phase="decode").matmul_flops
    assert not steps and abs((counter.get_total_flops() - before) - want) <= 0.01 * want
