"""The ``triton`` backend without running a kernel: the mask as data (tile lists, bit masks), its cache,
where the backend registers, and - in a subprocess with ``TRITON_INTERPRET=1`` - the kernels themselves
(``test_triton_backend.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.backends.triton import backend as triton_backend
from multihead.backends.triton import plan as tplan
from multihead.core.problem import make_problem

ROOT = Path(__file__).resolve().parents[1]


def _problem(B, H, Nq, Nk, mask):
    q = torch.zeros(B, H, Nq, 16)
    kv = torch.zeros(B, H, Nk, 16)
    return make_problem(q, kv, kv, mask=mask)


def _dense_from_plan(pl: tplan.TilePlan, B: int, H: int, Nq: int, Nk: int) -> torch.Tensor:
    """Rebuild the (B, H, Nq, Nk) mask from the row lists, codes and bit masks, the way the kernel reads
    them (full tiles: all keys inside [0, Nk); partial tiles: their bits; everything else: nothing)."""
    bm, bn = pl.bm, pl.bn
    pad = bn  # room for the first tile starting before key 0
    out = torch.zeros(B, H, pl.nqb * bm, pad + pl.nkb * bn + bn, dtype=torch.bool)
    bits = pl.unpacked_bits().expand(B, H, -1, -1, -1)  # (B, H, P, BM, BN)
    for i in range(pl.nqb):
        for t in range(int(pl.row_ptr[i]), int(pl.row_ptr[i + 1])):
            j, code = int(pl.row_cols[t]), int(pl.row_code[t])
            k0 = pad + pl.kbase + j * bn
            if code >= 0:
                out[:, :, i * bm : (i + 1) * bm, k0 : k0 + bn] = bits[:, :, code]
            else:
                out[:, :, i * bm : (i + 1) * bm, k0 : k0 + bn] = True
    return out[:, :, :Nq, pad : pad + Nk]  # (B, H, Nq, Nk): clipped to the problem


MASKS = [
    ("none", None, 1, 1, 37, 37),
    ("causal", mh.causal(), 1, 2, 50, 50),
    ("causal Nq<Nk", mh.causal(), 1, 1, 21, 70),
    ("causal Nq>Nk", mh.causal(), 1, 1, 60, 25),
    ("window", mh.sliding_window(11), 1, 1, 64, 64),
    ("padding", mh.padding([10, 33]), 2, 1, 33, 33),
    (
        "documents per batch",
        mh.document(torch.tensor([[0] * 9 + [1] * 31, [0] * 30 + [1] * 10])),
        2,
        1,
        40,
        40,
    ),
    ("custom by head", mh.custom(lambda b, h, q, k: (q + k) % (h + 2) == 0), 1, 3, 29, 45),
    ("tensor", torch.rand(2, 1, 23, 31, generator=torch.Generator().manual_seed(0)) > 0.5, 2, 2, 23, 31),
    ("prefix | window", mh.prefix_lm(5) | mh.sliding_window(4), 1, 1, 40, 40),
]


@pytest.mark.parametrize("name,mask,B,H,Nq,Nk", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (16, 16)])
def test_plan_reproduces_the_mask(name, mask, B, H, Nq, Nk, blocks):
    p = _problem(B, H, Nq, Nk, mask)
    pl = tplan.build_plan(p, *blocks)
    want = torch.ones(B, H, Nq, Nk, dtype=torch.bool) if p.mask is None else p.mask.dense(B, H, Nq, Nk)
    assert torch.equal(_dense_from_plan(pl, B, H, Nq, Nk), want)


@pytest.mark.parametrize("name,mask,B,H,Nq,Nk", MASKS, ids=[m[0] for m in MASKS])
def test_device_classification_equals_the_library_grid(name, mask, B, H, Nq, Nk):
    """Masks without analytic tile kinds are classified in a few vectorised evaluations; the result is
    the library's own grid (classified one query block at a time)."""
    ours = tplan.tile_grid(_problem(B, H, Nq, Nk, mask), 16, 32)
    theirs = _problem(B, H, Nq, Nk, mask).grid(16, 32)
    assert ours.k_edges == theirs.k_edges and torch.equal(ours.kinds, theirs.kinds)


def test_transposed_lists_hold_the_same_tiles():
    p = _problem(1, 1, 45, 70, mh.sliding_window(13) | mh.prefix_lm(3))
    pl = tplan.build_plan(p, 16, 16)
    rows = {
        (i, int(pl.row_cols[t]), int(pl.row_code[t]))
        for i in range(pl.nqb)
        for t in range(int(pl.row_ptr[i]), int(pl.row_ptr[i + 1]))
    }
    cols = {
        (int(pl.col_rows[t]), j, int(pl.col_code[t]))
        for j in range(pl.nkb)
        for t in range(int(pl.col_ptr[j]), int(pl.col_ptr[j + 1]))
    }
    assert rows == cols and len(rows) == int(pl.row_ptr[-1])
    kinds = p.grid(16, 16).kinds
    assert len(rows) == int((kinds != 0).sum())  # every non-empty tile once, no empty one


def test_the_lists_reach_the_device_as_one_int32_copy():
    """A new mask's lists are one host-to-device copy (a copy that waits for the GPU costs a new mask's
    first call its overlap with the queued work): six lists, views of one int32 storage, each aligned to
    16 bytes."""
    pl = tplan.build_plan(_problem(1, 1, 45, 70, mh.sliding_window(13)), 16, 16)
    lists = [pl.row_ptr, pl.row_cols, pl.row_code, pl.col_ptr, pl.col_rows, pl.col_code]
    assert {t.dtype for t in lists} == {torch.int32}
    assert len({t.untyped_storage().data_ptr() for t in lists}) == 1
    assert all(t.data_ptr() % 16 == 0 for t in lists)  # Triton specialises pointers on this alignment


@pytest.mark.parametrize("bn", [16, 32, 64, 128])
def test_bit_masks_pack_one_bit_per_score_and_unpack_exactly(bn):
    g = torch.Generator().manual_seed(bn)
    allowed = torch.rand(2, 3, 5, bn, generator=g) < 0.5  # (.., BN)
    allowed[..., -1] = True  # bit 31 of a 32-key word: the int32's sign bit
    words = tplan.pack_bits(allowed)
    assert words.dtype == torch.int32 and words.shape == (2, 3, 5, bn // min(32, bn))
    assert torch.equal(tplan.unpack_bits(words, bn), allowed)
    # key c is bit c % 32 of word c // 32 (what the kernels shift out)
    c = bn - 1
    assert bool((words[0, 0, 0, c // 32] >> (c % 32)) & 1) == bool(allowed[0, 0, 0, c])
    with pytest.raises(ValueError, match="BN=48"):
        tplan.pack_bits(torch.ones(4, 48, dtype=torch.bool))


def test_bit_masks_keep_only_the_dims_the_mask_depends_on():
    causal = tplan.build_plan(_problem(2, 4, 40, 40, mh.causal()), 16, 16)
    assert causal.bits.shape[:2] == (1, 1) and causal.bit_strides() == (0, 0)
    pad = tplan.build_plan(_problem(2, 4, 40, 40, mh.padding([7, 40])), 16, 16)
    assert pad.bits.shape[:2] == (2, 1) and pad.bit_strides()[1] == 0
    assert tplan.build_plan(_problem(1, 1, 40, 40, None), 16, 16).n_partial == 0


def test_plans_are_cached_per_mask_object_and_follow_in_place_changes():
    tplan.clear_cache()
    real = torch.ones(1, 40, dtype=torch.bool)
    mask = mh.key_padding(real)
    p = _problem(1, 1, 40, 40, mask)
    first = tplan.plan_for(p, 16, 16)
    assert tplan.plan_for(_problem(1, 1, 40, 40, mask), 16, 16) is first
    assert tplan.plan_for(_problem(1, 1, 40, 40, mh.key_padding(real)), 16, 16) is not first
    real[0, 30:] = False  # the user edits the tensor the mask holds: a new plan, not a stale one
    again = tplan.plan_for(_problem(1, 1, 40, 40, mask), 16, 16)
    assert again is not first and again.n_partial > 0
    window = tplan.plan_for(_problem(1, 1, 40, 40, mh.sliding_window(5) & mh.causal()), 16, 16)
    assert tplan.plan_for(_problem(1, 1, 40, 40, mh.sliding_window(5) & mh.causal()), 16, 16) is window
    assert tplan.plan_for(_problem(1, 1, 40, 40, mh.sliding_window(6) & mh.causal()), 16, 16) is not window
    named = mh.custom(lambda b, h, q, k: q >= k)
    other = mh.custom(lambda b, h, q, k: q <= k)  # the same repr, another predicate: not shared
    assert tplan.plan_for(_problem(1, 1, 40, 40, named), 16, 16) is not tplan.plan_for(
        _problem(1, 1, 40, 40, other), 16, 16
    )
    for n in range(tplan.CACHE_SIZE + 5):
        tplan.plan_for(_problem(1, 1, 20 + n, 20 + n, mh.causal()), 16, 16)
    assert len(tplan._CACHE) == tplan.CACHE_SIZE


def test_registered_only_where_the_kernels_can_run(monkeypatch):
    started_interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        assert not triton_backend.should_register()
        if not started_interpreted:
            assert "triton" not in mh.backends()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_backend.should_register() == triton_backend.triton_installed()


def test_cpu_without_interpreter_is_refused_with_the_fix(monkeypatch):
    if not triton_backend.triton_installed():
        pytest.skip("Triton is not installed: the refusal names that instead")
    loaded = sys.modules.get("multihead.backends.triton.forward")
    if loaded is not None and loaded.INTERPRETED:  # loaded to compile (test_triton_compile.py) is fine
        pytest.skip("the kernels were loaded for the interpreter in this process (their mode is fixed)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _problem(1, 1, 8, 8, None)
    assert "TRITON_INTERPRET=1" in triton_backend.BACKEND.why_not(p)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve this call"):
        triton_backend.BACKEND.run(p)


def test_auto_on_cpu_is_unchanged():
    from multihead.backends import auto

    q = torch.randn(1, 2, 40, 16)
    p = make_problem(q, q, q, mask=mh.sliding_window(8))
    assert auto.order(p) == auto.AUTO_ORDER and "triton" not in auto.AUTO_ORDER


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, test_triton_backend.py runs on the GPU")
def test_kernels_in_the_interpreter():
    """test_triton_backend.py in a fresh process with TRITON_INTERPRET=1 (Triton reads it at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(ROOT / "tests/test_triton_backend.py"),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(res.stdout[-3000:], res.stderr[-2000:])
    assert res.returncode == 0, res.stdout[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
