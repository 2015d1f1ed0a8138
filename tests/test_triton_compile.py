"""The ``triton`` backend's kernels compiled for a Hopper GPU (sm_90) on this CPU, with Triton's own
compiler and the ``ptxas`` its wheel carries: no GPU needed.

Triton's interpreter (``test_triton_backend.py``) runs the kernels' Python, which accepts code the
compiler refuses (an atomic on the wrong pointer type, a shape a matrix instruction cannot take); here
every kernel and feature set compiles as a launch on CUDA would compile it, fits an H100's shared memory,
and reads its K/V tiles with wide loads (the specialisation that gives Triton the alignment: without it
every element was a 2-byte load, 2.3x slower on an H200).
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)"
)

H100_SHARED_BYTES = 232448  # the most shared memory one block can use on sm_90 (227 KiB)
TENSORS = ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")  # pointers to the inputs' dtype
INT32_DATA = ("BITS", "ROW_PTR", "ROW_COLS", "ROW_CODE", "COL_PTR", "COL_ROWS", "COL_CODE")


def _kernels():
    from multihead.backends.triton import backward, forward

    kernels = {"forward": forward._forward_kernel, "dkdv": backward._dkdv_kernel, "dq": backward._dq_kernel}
    if any(type(k).__name__ != "JITFunction" for k in kernels.values()):
        pytest.skip("the kernels were loaded for Triton's interpreter in this process (TRITON_INTERPRET=1)")
    return kernels


def _compile(kernel, dtype: str, constexprs: dict, warps: int, stages: int):
    """Compile ``kernel`` for sm_90 as a launch with aligned tensors and strides would (pointers and the
    specialised ints divisible by 16; the ints the kernel leaves unspecialised plain)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from multihead.backends.triton.launch import UNSPECIALISED

    names = kernel.arg_names
    first_int = names.index("sqb")
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif i < first_int:
            signature[name] = f"*{dtype}" if name in TENSORS else "*i32" if name in INT32_DATA else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in ("scale", "cap") else "i32"
            if name not in UNSPECIALISED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs
    )
    try:
        return triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
        )
    except (FileNotFoundError, RuntimeError) as e:  # a Triton build without NVIDIA's assembler
        if isinstance(e, RuntimeError) and "ptxas" not in str(e):
            raise
        pytest.skip(f"this Triton has no ptxas to compile for a GPU: {e}")


FEATURES = {
    "plain": dict(HAS_BIAS=False, HAS_ALIBI=False, SOFTCAP=False, BIAS_AFTER_CAP=False),
    "every modifier": dict(HAS_BIAS=True, HAS_ALIBI=True, SOFTCAP=True, BIAS_AFTER_CAP=False),
    "cap, then bias": dict(HAS_BIAS=True, HAS_ALIBI=False, SOFTCAP=True, BIAS_AFTER_CAP=True),
}


@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("name", ["forward", "dkdv", "dq"])
def test_kernels_compile_for_hopper_with_wide_loads(name, features):
    from multihead.backends.triton.launch import _blocks

    kernel = _kernels()[name]
    s = _blocks(128, False, False)  # the settings a bf16 call with head dim 128 launches with
    blocks = {"forward": s["fwd_blocks"], "dkdv": s["dkdv_blocks"], "dq": s["dq_blocks"]}[name]
    warps, stages = (
        (s["fwd_warps"], s["fwd_stages"]) if name == "forward" else (s["bwd_warps"], s["bwd_stages"])
    )
    constexprs = dict(BM=blocks[0], BN=blocks[1], BD=128, BDV=128, PRECISION="tf32", EVEN_D=True)
    constexprs.update(FEATURES[features])
    params = inspect.signature(kernel.fn).parameters
    if "HAS_SINKS" in params:
        constexprs["HAS_SINKS"] = features != "plain"
    if "BIAS_GRAD" in params:
        constexprs["BIAS_GRAD"] = FEATURES[features]["HAS_BIAS"]
    compiled = _compile(kernel, "bf16", constexprs, warps, stages)
    assert compiled.metadata.shared <= H100_SHARED_BYTES, compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    assert "ld.global.b16" not in ptx, "K/V read one 2-byte element at a time"
    wide = re.findall(r"cp\.async\.c[ga]\.shared\.global[^;]*, 0x10", ptx) + re.findall(
        r"ld\.global[.\w]*\.v4", ptx
    )
    assert wide, "no 16-byte loads in the kernel"
    assert "mma" in ptx  # the products on the tensor cores (wgmma on sm_90)
    if constexprs.get("BIAS_GRAD"):
        assert re.search(r"red\.global[.\w]*add\.f32", ptx), "the bias's gradient is added with fp32 atomics"
