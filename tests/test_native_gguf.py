"""The native products on GGUF's own blocks (gemv_q4.c, gemv_qk.c, multihead.native.q4): against the
float64 reference of the same blocks on the same rounded activations at every tile edge (blocks a row
around the kernel's quads, weight rows around its work items of 16, activation rows around its tiles of
64), each row of a many-row call with the bits of its one-row call; the block layouts against the
``gguf`` package (llama.cpp's reference rounding and decoding; its k-quant decoding); the checks at the
boundary. The other CPU kinds' builds run the same products in their first load's self-check
(tests/test_native_targets.py)."""

from __future__ import annotations

import pytest
import torch

from multihead import native
from multihead.native import gguf_blocks, q4, q4_check

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
KINDS = list(gguf_blocks.KINDS)
BY_32 = [k for k in KINDS if gguf_blocks.block_weights(k) == 32]  # Q4_0, Q4_1, Q8_0
K_QUANTS = [k for k in KINDS if gguf_blocks.block_weights(k) == 256]  # Q4_K, Q6_K


def _random_super_blocks(kind: str, rows: int, supers: int, seed: int) -> torch.Tensor:
    """Rows of ``supers`` k-quant super-blocks of random bytes (every bit of the 6-bit scales and mins,
    the high bits of Q6_K) with small random fp16 scales: (O, R)."""
    g = torch.Generator().manual_seed(seed)
    nb = gguf_blocks.block_bytes(kind)
    raw = torch.randint(0, 256, (rows, supers, nb), generator=g, dtype=torch.uint8)  # (O, Nb, bytes)
    scales = (torch.randn(rows, supers, 2, generator=g) * 0.003).half()  # (O, Nb, 2)
    if kind == "q4_k":
        raw[..., 0:4] = scales.contiguous().view(torch.uint8)  # d, dmin (a negative dmin too)
    else:
        raw[..., 208:210] = scales[..., :1].contiguous().view(torch.uint8)  # d
    raw[0, 0, :4] = 0  # a super-block with d = 0 (and dmin = 0 for Q4_K)
    return raw.reshape(rows, -1)  # (O, R)


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05  # (O, I)
    w[0, :32] = 0.0  # an all-zero block: d = 0
    if cols >= 64:
        w[-1, 32:64] += 3.0  # a block far from zero (Q4_1's m large, Q4_0's d from one outlier)
    return w


@needs_native
@pytest.mark.parametrize("kind", BY_32)
@pytest.mark.parametrize(
    ("rows", "blocks_a_row"), [(1, 1), (15, 2), (16, 3), (17, 4), (33, 5), (5, 9), (3, 48)]
)
def test_the_product_equals_float64_on_the_same_blocks_and_rounded_activations(kind, rows, blocks_a_row):
    cols = 32 * blocks_a_row
    blocks = gguf_blocks.quantize(_weights(rows, cols, rows + cols), kind)  # (O, R)
    g = torch.Generator().manual_seed(1)
    for n in (1, 3, 64, 65):  # one row, a few, a whole tile, a tile and one
        x = torch.randn(n, cols, generator=g) * 2  # (N, I)
        x[0, : min(cols, 40)] = 0.0  # an all-zero activation block: xs = 0
        bias = torch.randn(rows, generator=g)  # (O,)
        y = q4.gemm_gguf(blocks, kind, x, bias)  # (N, O)
        ref, size = gguf_blocks.reference_product(blocks, kind, *q4.rounded_activations(x))  # (N, O)
        err = (
            (y.double() - bias.double() - ref).abs() / (size + bias.double().abs())
        ).max()  # (s + b) rounded
        assert err <= q4_check.TOLERANCE, (kind, rows, cols, n, float(err))
        for i in {0, n // 2, n - 1}:  # each row of the many-row call: the bits of its one-row call
            assert torch.equal(q4.gemm_gguf(blocks, kind, x[i], bias), y[i])


@needs_native
@pytest.mark.parametrize("kind", K_QUANTS)
@pytest.mark.parametrize(("rows", "supers"), [(1, 1), (15, 2), (16, 1), (17, 3), (33, 1), (3, 9)])
def test_the_k_quant_product_equals_float64_on_the_same_super_blocks(kind, rows, supers):
    """Random super-blocks (every scale and min bit pattern) and ones rounded from float weights, at the
    weight-row work items' edges (16) and the activation tiles' (64)."""
    cols = 256 * supers
    g = torch.Generator().manual_seed(rows + supers)
    for blocks in (
        _random_super_blocks(kind, rows, supers, rows * supers),
        gguf_blocks.quantize(_weights(rows, cols, rows + cols), kind),
    ):
        for n in (1, 3, 64, 65):
            x = torch.randn(n, cols, generator=g) * 2  # (N, I)
            x[0, :40] = 0.0  # an all-zero activation block: xs = 0
            bias = torch.randn(rows, generator=g)  # (O,)
            y = q4.gemm_gguf(blocks, kind, x, bias)  # (N, O)
            ref, size = gguf_blocks.reference_product(blocks, kind, *q4.rounded_activations(x))  # (N, O)
            err = ((y.double() - bias.double() - ref).abs() / (size + bias.double().abs())).max()
            assert err <= q4_check.TOLERANCE, (kind, rows, cols, n, float(err))
            for i in {0, n // 2, n - 1}:
                assert torch.equal(q4.gemm_gguf(blocks, kind, x[i], bias), y[i])


@needs_native
def test_the_reference_follows_the_weights_the_blocks_stand_for():
    """The float64 reference is the plain product of the dequantized weights and the rounded x, and the
    kernel on rounded x is as close to the float product as the rounding allows (a check the reference
    itself could not make if both shared a mistake in the block fields)."""
    w = _weights(7, 256, 0)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))  # (2, I)
    xq, xs = q4.rounded_activations(x)  # (2, I64), (2, I64 / 32)
    xr = (xq.double().view(2, -1, 32) * xs.double()[..., None]).view(2, -1)[:, :256]  # (2, I)
    for kind in KINDS:
        blocks = gguf_blocks.quantize(w, kind)  # (O, R)
        ref, _ = gguf_blocks.reference_product(blocks, kind, xq, xs)  # (2, O)
        plain = xr @ gguf_blocks.dequantize(blocks, kind, torch.float64).T  # (2, O)
        torch.testing.assert_close(ref, plain, rtol=1e-12, atol=1e-12)
        near = (q4.gemm_gguf(blocks, kind, x).double() - x.double() @ w.double().T).abs().max()
        assert near < 0.05 * (x.abs() @ w.abs().T).max(), kind  # 4-bit weights: a few % at most


gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'multihead[lm]')")


@pytest.mark.parametrize("kind", BY_32)
def test_rounding_and_decoding_match_llama_cpp_s_reference_in_the_gguf_package(kind):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    qtype = T[gguf_blocks.KINDS[kind][2]]
    w = _weights(19, 160, 3)
    w[2, 64:96] = -w[2, 64:96].abs()  # a block whose largest magnitude is negative (Q4_0's signed max)
    ours = gguf_blocks.quantize(w, kind)  # (O, R)
    theirs = torch.from_numpy(quantize(w.numpy(), qtype))  # (O, R)
    assert torch.equal(ours, theirs)
    want = torch.from_numpy(dequantize(theirs.numpy(), qtype))  # (O, I) fp32
    assert torch.equal(gguf_blocks.dequantize(ours, kind), want)
    if native.unavailable() is None:
        lib = native.library()
        for i in (0, 2, 18):
            assert torch.equal(q4.dequantize_row(lib, ours, kind, i, 160), want[i])


@pytest.mark.parametrize("kind", K_QUANTS)
def test_k_quant_decoding_matches_the_gguf_package_and_our_rounding_is_a_valid_block(kind):
    """The gguf package has llama.cpp's k-quant decoding (not its rounding): random super-blocks decode
    to the same bits, ours and the native row's; blocks rounded by our rule decode (by the gguf package)
    to weights near the float ones."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    qtype = T[gguf_blocks.KINDS[kind][2]]
    raw = _random_super_blocks(kind, 5, 3, 7)  # (5, R)
    want = torch.from_numpy(dequantize(raw.numpy(), qtype))  # (5, 768)
    assert torch.equal(gguf_blocks.dequantize(raw, kind), want)
    if native.unavailable() is None:
        for i in (0, 4):
            assert torch.equal(q4.dequantize_row(native.library(), raw, kind, i, 768), want[i])
    w = _weights(9, 512, 5)
    blocks = gguf_blocks.quantize(w, kind)  # (9, R)
    back = torch.from_numpy(dequantize(blocks.numpy(), qtype))  # (9, 512)
    assert torch.equal(back, gguf_blocks.dequantize(blocks, kind))
    rel = float((back - w).norm() / w.norm())
    assert rel < {"q4_k": 0.1, "q6_k": 0.03}[kind], rel  # 4-bit and 6-bit weights


@needs_native
def test_bad_arguments_are_refused_with_the_values_and_the_fix():
    blocks = gguf_blocks.quantize(torch.randn(4, 64), "q4_1")  # (4, 40)
    with pytest.raises(ValueError, match=r"uint8 \(O, 40\), got torch.uint8 \(4, 40\)|block kind"):
        q4.gemm_gguf(blocks, "q4_2", torch.randn(64))
    with pytest.raises(ValueError, match=r"q4_0 blocks for rows of 64 weights are uint8 \(O, 36\), got"):
        q4.gemm_gguf(blocks, "q4_0", torch.randn(64))
    with pytest.raises(ValueError, match="positive multiple of 32 weights, got 48"):
        q4.gemm_gguf(blocks, "q4_1", torch.randn(48))
    with pytest.raises(ValueError, match=r"needs x fp32 \(N, I\) or \(I,\), got torch.float64"):
        q4.gemm_gguf(blocks, "q4_1", torch.randn(64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias fp32 \(4,\), got torch.float32 \(3,\)"):
        q4.gemm_gguf(blocks, "q4_1", torch.randn(64), torch.randn(3))
    with pytest.raises(ValueError, match="no backward"):
        q4.gemm_gguf(blocks, "q4_1", torch.randn(64, requires_grad=True))
    with pytest.raises(ValueError, match=r"I a positive multiple of 32, got \(3, 50\); pad its inputs"):
        gguf_blocks.quantize(torch.randn(3, 50), "q4_0")
    with pytest.raises(ValueError, match="q4_k blocks for rows of 256 weights are uint8 \\(O, 144\\)"):
        q4.gemm_gguf(blocks, "q4_k", torch.randn(256))
    with pytest.raises(ValueError, match="positive multiple of 256 weights, got 64"):
        q4.gemm_gguf(blocks, "q6_k", torch.randn(64))
    with pytest.raises(ValueError, match=r"I a positive multiple of 256, got \(3, 576\); pad its inputs"):
        gguf_blocks.quantize(torch.randn(3, 576), "q4_k")
    with pytest.raises(IndexError, match="index 4 is out of range for an embedding of 4 rows"):
        q4.dequantize_row(native.library(), blocks, "q4_1", 4, 64)


def test_the_self_check_catches_a_wrong_product():
    """The first load's check fails on a kernel whose outputs are off by one part in 10^5."""
    if REASON is not None:
        pytest.skip(REASON)
    lib = native.library()
    assert q4_check.check_gguf(lib, torch.Generator().manual_seed(0)) is None

    class Off:
        def __getattr__(self, name):
            return getattr(lib, name)

        def mh_gemm_gguf(self, kind, w, ldw, x, b, y, n, rows, cols):
            status = lib.mh_gemm_gguf(kind, w, ldw, x, b, y, n, rows, cols)
            out = torch.frombuffer((torch.ctypes.c_float * (n * rows)).from_address(y), dtype=torch.float32)
            out.mul_(1 + 1e-5)
            return status

    why = q4_check.check_gguf(Off(), torch.Generator().manual_seed(0))
    assert why is not None and "disagrees with float64" in why
