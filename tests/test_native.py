"""The native batch-1 GEMV (multihead.native) and GemvLinear: the products of torch, built once per
machine, F.linear wherever the kernel cannot run, and the tokens of the plain model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import native
from multihead.models import quant
from multihead.models.gemv_linear import GemvLinear

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native GEMV unavailable: {REASON}")


def _rounded_exact(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """W x + b in float64, rounded once to the inputs' dtype: the best any kernel can return."""
    ref = w.double() @ x.double()  # (O,)
    return (ref if b is None else ref + b.double()).to(w.dtype)


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 300),
    pad=st.integers(0, 5),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp32_gemv_matches_float64_for_every_shape_and_row_stride(rows, cols, pad, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols + pad, generator=g)[:, :cols]  # (O, I), row stride I + pad
    x = torch.randn(cols, generator=g)  # (I,)
    b = torch.randn(rows, generator=g) if bias else None  # (O,)
    y = native.gemv(w, x, b)
    assert y.shape == (rows,) and y.dtype == torch.float32
    ref = w.double() @ x.double() + (0 if b is None else b.double())  # (O,)
    scale = w.double().abs() @ x.double().abs() + 1  # (O,): the size of the sum's terms
    assert float(((y.double() - ref).abs() / scale).max()) < 1e-6


HALVES = [
    pytest.param(torch.bfloat16, 2**-8, id="bf16"),
    pytest.param(
        torch.float16,
        2**-11,
        id="fp16",
        marks=pytest.mark.skipif(
            torch.float16 not in native.dtypes(),
            reason="no fp16 kernel here (neither F16C nor the compiler's _Float16)",
        ),
    ),
]


@needs_native
@pytest.mark.parametrize(("dtype", "half_ulp"), HALVES)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 400), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_half_gemv_is_the_exact_product_rounded_once(dtype, half_ulp, rows, cols, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(dtype)  # (O, I)
    x = torch.randn(cols, generator=g).to(dtype)  # (I,)
    b = torch.randn(rows, generator=g).to(dtype) if bias else None  # (O,)
    y = native.gemv(w, x, b)
    assert y.dtype == dtype
    # exact half products summed in fp32: at most half an ulp of the dtype from the exact result
    # rounded once, plus the fp32 sum's error relative to the size of the terms
    exact = w.double() @ x.double() + (0 if b is None else b.double())  # (O,)
    scale = w.double().abs() @ x.double().abs() + 1
    err = (y.double() - exact).abs()
    assert bool((err <= exact.abs() * half_ulp + scale * 1e-6).all())


@needs_native
def test_gemv_agrees_with_f_linear_on_decode_shapes():
    torch.manual_seed(0)
    for rows, cols in ((2816, 1024), (1024, 2816), (512, 1024), (32000, 64)):
        w, x = torch.randn(rows, cols), torch.randn(cols)
        torch.testing.assert_close(native.gemv(w, x), F.linear(x, w), rtol=1e-5, atol=1e-4)
        for half, ulp in ((torch.bfloat16, 2**-7), (torch.float16, 2**-10)):
            if half not in native.dtypes():
                continue
            wh, xh = w.to(half), x.to(half)
            got, want = native.gemv(wh, xh).float(), F.linear(xh, wh).float()
            # both sum in fp32 and round once: they differ by at most one ulp, on few outputs
            assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= ulp, half
            assert float((got != want).float().mean()) < 0.05, half


@needs_native
def test_gemv_rejects_bad_inputs_with_the_fix():
    w, x = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(
        ValueError,
        match=r"all of one dtype of \[torch.float32, .*\], got \[torch.float32, torch.float16\]; cast them",
    ):
        native.gemv(w, x.half())
    with pytest.raises(ValueError, match=r"needs weight \(O, I\) and x \(I,\), got \(4, 8\) and \(7,\)"):
        native.gemv(w, x[:7])
    with pytest.raises(ValueError, match=r"needs bias \(O,\) = \(4,\), got \(3,\)"):
        native.gemv(w, x, torch.randn(3))
    with pytest.raises(ValueError, match=r"columns contiguous.*weight.contiguous\(\)"):
        native.gemv(torch.randn(8, 4).t(), x)
    with pytest.raises(ValueError, match="gemv has no backward"):
        native.gemv(w.requires_grad_(), x)


@needs_native
def test_the_build_is_cached_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    native.loader.load.cache_clear()
    try:
        assert native.unavailable() is None
        so = native.location()
        assert so is not None and so.parent == tmp_path and so.name.startswith("native-")
        built = so.stat()
        native.loader.load.cache_clear()
        assert native.unavailable() is None and native.location() == so
        assert so.stat().st_ino == built.st_ino and so.stat().st_mtime_ns == built.st_mtime_ns  # reused
        compiler, _ = native.build.find_compiler()
        assert compiler is not None and native.library_path(" ".join(compiler), tmp_path) == so
        monkeypatch.setattr(native.loader, "cpu_key", lambda: "another cpu")
        assert (
            native.library_path(" ".join(compiler), tmp_path) != so
        )  # one CPU's build never runs on another
    finally:
        native.loader.load.cache_clear()


def test_without_a_compiler_gemv_linear_runs_f_linear_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    native.loader.load.cache_clear()
    try:
        assert native.unavailable() == (
            "CC='no-such-compiler-here' is not an executable: no program 'no-such-compiler-here' on PATH; "
            "set CC to a C compiler (or unset it)"
        )
        lin = torch.nn.Linear(16, 8)
        layer = GemvLinear.from_linear(lin)
        assert "F.linear (CC='no-such-compiler-here' is not an executable" in repr(layer)
        x = torch.randn(1, 16)
        with torch.no_grad():
            assert torch.equal(layer(x), lin(x))
        with pytest.raises(ValueError, match="the native GEMV is unavailable: CC='no-such-compiler-here'"):
            native.gemv(lin.weight.detach(), x[0])
        monkeypatch.setenv("MULTIHEAD_NATIVE", "0")
        native.loader.load.cache_clear()
        assert native.unavailable() == "disabled by MULTIHEAD_NATIVE=0"
    finally:
        native.loader.load.cache_clear()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_linear_runs_the_kernel_for_one_row_and_f_linear_for_a_prompt(dtype, bias, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias).to(dtype)
    layer = GemvLinear.from_linear(lin)
    assert layer.weight is lin.weight and layer.why_not_native is None  # shares the tensors
    calls = []
    real_run = native.run
    monkeypatch.setattr(native, "run", lambda *a: calls.append(a) or real_run(*a))
    with torch.no_grad():
        for shape in ((96,), (1, 96), (1, 1, 96)):
            x = torch.randn(shape).to(dtype)
            y = layer(x)
            assert y.shape == (*shape[:-1], 200) and y.dtype == dtype
            torch.testing.assert_close(y, lin(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)
        assert len(calls) == 3
        for shape in ((3, 7, 96), (17, 96)):  # more rows than ROWS_NATIVE (a prompt): F.linear, bit for bit
            x = torch.randn(shape).to(dtype)
            assert torch.equal(layer(x), lin(x))
    assert len(calls) == 3
    x = torch.randn(1, 96, dtype=dtype, requires_grad=True)  # training: F.linear, with its gradient
    layer(x).sum().backward()
    assert x.grad is not None and len(calls) == 3


@needs_native
def test_quantize_native_decodes_the_tokens_of_the_plain_model():
    torch.manual_seed(0)
    lm = mh.TransformerLM(500, 64, 2, 4, 128, n_kv_heads=2).eval()
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    for weights, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain = copy.deepcopy(lm).to(dtype)
        q = quant.quantize(lm, weights=weights, kv=None)  # "auto": native where the kernel builds
        linears = [m for m in q.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, GemvLinear) for m in linears)
        assert q.lm_head.weight is q.embed.weight  # the tie stays a tie: no second copy
        assert quant.model_bytes(q) == quant.model_bytes(plain)
        with torch.no_grad():
            assert torch.equal(q.generate(ids, 16), plain.generate(ids, 16))
    assert isinstance(
        quant.quantize(lm, weights="fp32", kv=None, kernel="onednn").lm_head, quant.PackedLinear
    )
    with pytest.raises(
        ValueError,
        match=r"kernel for weights='bf16' must be one of \['auto', 'native', 'onednn'\], got 'fbgemm'",
    ):
        quant.quantize(lm, weights="bf16", kv=None, kernel="fbgemm")


@needs_native
@pytest.mark.parametrize(
    "rows", [700, 701]
)  # pairs of rows side by side; an odd count's middle row its own partner
def test_products_split_over_threads_give_the_same_bits(rows):
    """Each row is summed by one thread whichever takes it (the threads take their own parts, then what
    is left of the others'): 1-4 threads give the same bits, every row written (against torch)."""
    from multihead.models.int8_gemv_linear import dequantize_groups, quantize_groups
    from multihead.native import int8 as native_int8

    torch.manual_seed(0)
    w, x = torch.randn(rows, 512), torch.randn(512)  # above the size that wakes the threads
    w8, scale = quantize_groups(torch.randn(rows, 1024), 32)
    x8 = torch.randn(1024)

    def products() -> list[torch.Tensor]:
        got = [native.gemv(w, x), native.gemv(w.bfloat16(), x.bfloat16())]
        if torch.float16 in native.library().mh_dtypes:
            got.append(native.gemv(w.half(), x.half()))
        return [*got, native_int8.gemv_q8(w8, scale, x8, None, 32)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert native.threads() == 1
        one = products()
        many = []
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            many.append(products())
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for got in many for a, b in zip(one, got))
    torch.testing.assert_close(one[0], w @ x, rtol=1e-5, atol=1e-4)
    want8 = dequantize_groups(w8, scale, 32, torch.float32) @ x8  # (O,)
    torch.testing.assert_close(one[-1], want8, rtol=0.02, atol=0.02 * float(want8.abs().max()))


@needs_native
def test_a_compiler_without_openmp_builds_the_one_thread_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(native.loader, "OPENMP", "-fno-such-option-here")
    native.loader.load.cache_clear()
    try:
        assert native.unavailable() is None  # the build without the flag passed its self-check
        assert native.threads() == 1
        w, x = torch.randn(700, 512), torch.randn(512)
        torch.testing.assert_close(native.gemv(w, x), w @ x, rtol=1e-5, atol=1e-4)
    finally:
        native.loader.load.cache_clear()


def test_quantize_auto_picks_native_for_decoders_and_onednn_for_encoders():
    torch.manual_seed(0)
    enc = mh.Encoder(2, 64, 4, 128)
    lm = mh.TransformerLM(300, 64, 2, 4, 96)
    for weights in ("fp32", "bf16"):
        linears = list(quant.quantize(enc, weights=weights, kv=None).modules())
        assert any(isinstance(m, quant.PackedLinear) for m in linears)  # many rows per call: oneDNN
        assert not any(isinstance(m, GemvLinear) for m in linears)
        q = quant.quantize(lm, weights=weights, kv=None)
        native_here = REASON is None
        assert isinstance(q.lm_head, GemvLinear if native_here else quant.PackedLinear)
    # fp16 has no oneDNN layer: native (F.linear where the kernel cannot run) for any model
    assert isinstance(quant.quantize(enc, weights="fp16", kv=None).layers[0].ffn.linear1, GemvLinear)


@needs_native
def test_an_unwritable_cache_directory_builds_into_the_temporary_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # no directory can be made below it, not even by root
    monkeypatch.setenv("MULTIHEAD_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(native.cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    native.loader.load.cache_clear()
    try:
        assert native.unavailable() is None
        so = native.location()
        assert so is not None and so.parent == tmp_path / "tmp" / f"multihead-{os.getuid()}"
        assert oct(so.parent.stat().st_mode & 0o777) == oct(0o700)
        assert native.notes() == (
            f"not building in {blocker / 'cache'}: {blocker / 'cache'} cannot be created: Not a directory",
        )
    finally:
        native.loader.load.cache_clear()
