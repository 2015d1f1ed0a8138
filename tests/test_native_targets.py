"""Every code path the native build compiles, forced on this CPU, and the CPU kinds this machine is not.

The C sources pick their kernels by the compiler's target (``-march=native``): AVX512-VNNI, AVX-VNNI, AVX2
or portable C for the int8 products, VDPBF16PS or widening for bf16, 512- or 256-bit halves for the
attention's conversions, the AVX-512 argmax or the scalar one. A machine only ever builds its own, so
each target below is built here (where this CPU can run it) and must pass the first load's self-check,
which includes the decode layers' team step against their one-row loop (native/step_check.py), and
give a team step the bits of one thread on a small model.

torch's own products differ by CPU vendor too: MKL takes other code paths on Intel CPUs, where some
fp32 GEMMs split their sums across the threads (their last bits then depend on the thread count).
:func:`test_the_team_and_int8_tests_hold_with_mkl_s_intel_paths` runs the native tests that compare
against torch with those paths forced on any x86-64 CPU (a preloaded library answers MKL's "is this an
Intel CPU?" with yes), so a test that holds only on AMD's paths fails here, not first on a user's Xeon.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multihead import native
from multihead.native import build
from multihead.native import int8 as native_int8
from multihead.native import q4 as native_q4
from tests.native_builds import built_for
from tests.test_native_team import _model, _prefilled, _run

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")

#: (-march and extra flags, the CPU flag it needs, the int8 product's ISA, VDPBF16PS)
TARGETS = [
    ("x86-64", "sse2", "portable C", False),
    ("x86-64-v3", "avx2", "AVX2", False),
    ("x86-64-v3 -mavxvnni", "avx_vnni", "AVX-VNNI", False),
    ("x86-64-v4", "avx512bw", "AVX2", False),  # AVX-512 without VNNI: the AVX2 int8 dot products
    ("x86-64-v4 -mavx512vnni -mavx512bf16", "avx512_bf16", "AVX512-VNNI", True),
]


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize(("march", "flag", "isa", "dpbf16"), TARGETS, ids=[t[0] for t in TARGETS])
def test_each_target_passes_the_self_check_and_its_team_gives_the_bits_of_one_thread(
    march, flag, isa, dpbf16, monkeypatch
):
    with built_for(march, flag, monkeypatch):
        assert native.unavailable() is None  # the first load's check (two threads) passed
        assert native_int8.isa() == isa and native.has_dpbf16() == dpbf16
        assert native_q4.isa() == isa  # the GGUF-block products: the same instructions (self-checked)
        lib = native.library()
        before = _threads(2)
        try:
            assert native.checks.check_team_steps(lib) is None  # the team step itself, in this process
        finally:
            torch.set_num_threads(before)
        for kind in ("fp32", "int8 g32"):
            model = _model(432, 6, 3, False, kind)  # three kv heads over two threads, head dim 72
            prefilled = _prefilled(model, kind)
            one = _run(model, prefilled, 1)
            two = _run(model, prefilled, 2)
            assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True)), (march, kind)


class _Perturbed:
    """The library, but its decode step's residual stream moved by ``by`` in the runs ``when`` picks
    (seq 0: the team's step, 1: the one-row loop)."""

    def __init__(self, lib: ctypes.CDLL, when: set[int], by: float):
        self.lib, self.when, self.by = lib, when, by

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def mh_decode_batch(self, x, *args):
        status = self.lib.mh_decode_batch(x, *args)
        if args[-1] in self.when:
            cell = ctypes.c_float.from_address(x)  # the first fp32 case's first value
            cell.value += self.by
        return status


def test_the_step_check_catches_a_team_that_disagrees_and_a_consistent_error():
    lib = native.library()
    assert native.checks.check_team_steps(lib) is None
    why = native.checks.check_team_steps(_Perturbed(lib, {0}, 1e-3))  # the team's step alone
    assert why is not None and "team of threads disagrees with its one-row loop" in why and "float32" in why
    # both paths equally wrong: only the float64 comparison sees it (the final norm is its output)

    class Wrong(_Perturbed):
        def mh_decode_batch(self, x, *args):
            status = self.lib.mh_decode_batch(x, *args)
            out = args[7]
            cell = ctypes.c_float.from_address(out)
            cell.value += 0.5
            return status

    why = native.checks.check_team_steps(Wrong(lib, set(), 0.0))
    assert why is not None and "disagrees with float64 torch" in why


def _torch_has_mkl_intel_switch() -> str | None:
    """Why MKL's Intel paths cannot be forced here, or None."""
    if platform.machine() != "x86_64" or not torch.backends.mkl.is_available():
        return "torch here has no MKL on x86-64"
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        exported = hasattr(ctypes.CDLL(str(lib)), "mkl_serv_intel_cpu_true")
    except OSError as e:
        return f"{lib} cannot be opened: {e}"
    return None if exported else "this torch's MKL does not export mkl_serv_intel_cpu_true"


def test_the_team_and_int8_tests_hold_with_mkl_s_intel_paths(tmp_path):
    why = _torch_has_mkl_intel_switch()
    if why is not None:
        pytest.skip(why)
    compiler, reason = build.find_compiler()
    assert compiler is not None, reason
    shim = tmp_path / "libintel_paths.so"
    source = tmp_path / "intel_paths.c"
    source.write_text(
        "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"
    )
    subprocess.run([*compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)], check=True)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    # first: the paths are in force (MKL's Intel GEMM of 40 x 1024 -> 512 splits its sums on two threads)
    probe = (
        "import torch, torch.nn.functional as F\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(40, 1024, generator=g), torch.randn(512, 1024, generator=g)\n"
        "torch.set_num_threads(1); one = F.linear(x, w)\n"
        "torch.set_num_threads(2); two = F.linear(x, w)\n"
        "print(int(not torch.equal(one, two)))\n"
    )
    split = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    if split.stdout.strip() != "1":
        pytest.skip(
            "MKL here gives the same bits at 1 and 2 threads even on its Intel paths: nothing to force"
        )
    tests = ["tests/test_native_team.py", "tests/test_native_int8.py"]
    pick = "one_team_gives_the_bits or follow_the_eager"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests, "-k", pick],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
