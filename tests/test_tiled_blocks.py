"""The tiled kernel's plan: tile classification, skipped tiles, the pieces, and no repeated K/V."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends.tiled import backend as tiled_backend
from multihead.backends.tiled import fused as tiled_fused
from multihead.core.masks import EMPTY, FULL, PARTIAL, MaskContext
from multihead.core.problem import make_problem
from multihead.core.tiles import classify, edges, evaluate_kinds, nonempty_fraction
from tests.numerics import max_err


def _masks(B: int, N: int) -> dict[str, mh.Mask]:
    g = torch.Generator().manual_seed(0)
    docs = torch.sort(torch.randint(0, 4, (B, N), generator=g)).values
    kp = torch.rand(B, N, generator=g) > 0.2
    return {
        "causal": mh.causal(),
        "window": mh.sliding_window(9),
        "prefix": mh.prefix_lm(7),
        "padding": mh.padding(torch.randint(1, N + 1, (B,), generator=g)),
        "key_padding": mh.key_padding(kp),
        "document": mh.document(docs),
        "doc_unsorted": mh.document(torch.randint(0, 3, (N,), generator=g)),
        "and": mh.causal() & mh.sliding_window(5),
        "or_not": mh.sliding_window(3) | ~mh.causal(),
    }


EXACT = {"causal", "window", "prefix", "padding", "key_padding", "document"}


@pytest.mark.parametrize("nq_nk", [(40, 40), (17, 40), (40, 23)], ids=["square", "nq<nk", "nq>nk"])
@pytest.mark.parametrize("blocks", [(8, 8), (5, 7), (16, 4)], ids=["8x8", "5x7", "16x4"])
@pytest.mark.parametrize("name", list(_masks(2, 40)))
def test_block_kinds_agree_with_evaluation(name, blocks, nq_nk):
    """Analytic classification is sound (never claims full/empty wrongly) and exact for simple masks."""
    Nq, Nk = nq_nk
    mask = _masks(2, Nk)[name]
    ctx = MaskContext(2, 3, Nq, Nk)
    grid = classify(mask, ctx, *blocks)
    truth = evaluate_kinds(mask, ctx, grid.q_edges, torch.tensor(grid.k_edges))
    assert grid.kinds.shape == truth.shape
    assert ((grid.kinds == FULL) <= (truth == FULL)).all()
    assert ((grid.kinds == EMPTY) <= (truth == EMPTY)).all()
    if name in EXACT:
        assert torch.equal(grid.kinds, truth)


def test_key_edges_align_the_diagonal():
    """Key tiles are shifted by (Nk - Nq) mod bk, so a square query block sits on one key block."""
    assert edges(10, 4) == [0, 4, 8, 10]
    assert edges(10, 4, 3) == [0, 3, 7, 10]
    grid = classify(mh.causal(), MaskContext(1, 1, 8, 11), 4, 4)
    assert grid.k_edges == [0, 3, 7, 11]
    assert grid.kinds.tolist() == [[FULL, PARTIAL, EMPTY], [FULL, FULL, PARTIAL]]


def _problem(N=256, Hq=4, Hkv=2, mask=None, bias=None, D=16):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, Hq, N, D, generator=g)
    k = torch.randn(1, Hkv, N, D, generator=g)
    v = torch.randn(1, Hkv, N, D, generator=g)
    return make_problem(q, k, v, mask=mask, bias=bias)


@pytest.fixture
def blocks16(monkeypatch):
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 16)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 16)


def test_plans_of_the_common_masks(blocks16):
    kinds = lambda m: [(pc.kind, pc.nb) for pc in tiled_backend.BACKEND.plan(_problem(mask=m))]  # noqa: E731
    assert kinds(None) == [("full", 1)]  # one call over everything
    assert kinds(mh.causal()) == [("causal", 1)]  # one causal call: what SDPA does
    assert kinds(mh.sliding_window(64)) == [("causal", 1), ("masked", 12)]  # the window: one band
    assert kinds(mh.prefix_lm(64)) == [("full", 1), ("full", 1), ("causal", 1)]
    docs = mh.document(torch.arange(256) // 64) & mh.causal()
    assert kinds(docs) == [("causal", 4)]  # equal documents: one batched causal call (a band)
    uneven = mh.document(torch.tensor([0] * 64 + [1] * 64 + [2] * 96 + [3] * 32)) & mh.causal()
    assert kinds(uneven) == [("causal", 2), ("causal", 1), ("causal", 1)]  # one call per length run


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("lengths", [(64, 64, 64, 64), (32, 32, 96, 32, 48, 48)], ids=["equal", "mixed"])
def test_packed_documents_as_bands_match_the_reference(blocks16, lengths, grad):
    """Causal documents bundled into bands (GQA, B=2 with different packings) equal the float64 oracle."""
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])  # (N,)
    ids = torch.stack([ids, ids.flip(0).max() - ids.flip(0)])  # (2, N): the second row packs them reversed
    mask = mh.document(ids) & mh.causal()
    N = ids.shape[1]
    q, k, v = (torch.randn(2, h, N, 16, generator=g, requires_grad=grad) for h in (4, 2, 2))
    out = mh.attention(q, k, v, mask=mask, backend="tiled")
    ref = mh.attention(*(t.detach().double().requires_grad_(grad) for t in (q, k, v)), mask=mask,
                       backend="reference")  # fmt: skip
    assert max_err(out, ref) < 1e-5
    if grad:
        dout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), dout)
        q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(mh.attention(q2, k2, v2, mask=mask, backend="reference"), (q2, k2, v2),
                                   dout.double())  # fmt: skip
        for a, b in zip(got, want, strict=True):
            assert max_err(a, b) < 1e-5


def test_empty_tiles_are_skipped(blocks16, monkeypatch):
    """The kernel computes about N * (window + block) pairs, not N^2: empty tiles never reach it."""
    calls = []
    real = tiled_fused.FLASH_FWD

    def spy(q, k, v, *args, **kw):
        calls.append(q.shape[-2] * k.shape[-2] * q.shape[-3] * q.shape[0])  # rows x keys x blocks x batch
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(tiled_fused, "FLASH_FWD", spy)
    p = _problem(N=512, Hq=2, Hkv=2, mask=mh.sliding_window(32))
    out = mh.attention(p.q, p.k, p.v, mask=p.mask, backend="tiled")
    computed = sum(calls) / 2  # per head (B*Hkv = 1*2 in a band call's batch)
    assert computed <= 512 * (32 + 16)  # necessary ~512*32 plus one block of slack per row
    assert max_err(out, mh.attention(p.q, p.k, p.v, mask=p.mask, backend="reference")) < 1e-5
    assert nonempty_fraction(p.grid(64, 64)) < 0.25


def test_loop_engine_evaluates_only_partial_tiles(blocks16, monkeypatch):
    """Soft-capping runs in the loop engine: the mask is evaluated on partial tiles only."""
    p = _problem(N=128, mask=mh.sliding_window(20), bias=mh.softcap(5.0))
    grid = tiled_backend.BACKEND.grid(p)
    seen = []
    real_block = type(p.mask).block
    monkeypatch.setattr(
        type(p.mask), "block", lambda self, *a, **kw: seen.append(a) or real_block(self, *a, **kw)
    )
    with torch.no_grad():
        mh.attention(p.q, p.k, p.v, mask=p.mask, bias=p.bias, backend="tiled")
    assert len(seen) == grid.counts()["partial"]
    assert grid.counts()["empty"] > grid.counts()["partial"]


@pytest.mark.parametrize(
    "mask",
    [None, mh.causal(), mh.sliding_window(40), mh.prefix_lm(30)],
    ids=["none", "causal", "window", "prefix"],
)
def test_gqa_never_repeats_kv(blocks16, monkeypatch, mask):
    """Every kernel call reads K and V from the caller's own storage: no repeated (or copied) K/V."""
    p = _problem(N=128, Hq=8, Hkv=2, mask=mask)
    k, v = p.k.detach().requires_grad_(True), p.v.detach().requires_grad_(True)
    ptrs = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    seen = []
    real_f, real_b = tiled_fused.FLASH_FWD, tiled_fused.FLASH_BWD
    monkeypatch.setattr(
        tiled_fused,
        "FLASH_FWD",
        lambda q, kk, vv, *a, **kw: seen.append((kk, vv)) or real_f(q, kk, vv, *a, **kw),
    )
    monkeypatch.setattr(
        tiled_fused,
        "FLASH_BWD",
        lambda do, q, kk, vv, *a, **kw: seen.append((kk, vv)) or real_b(do, q, kk, vv, *a, **kw),
    )
    out = mh.attention(p.q, k, v, mask=mask, backend="tiled")
    out.sum().backward()
    assert seen
    for kk, vv in seen:  # views of the caller's K/V (fp32: the backward needs no upcast copy either)
        assert {kk.untyped_storage().data_ptr(), vv.untyped_storage().data_ptr()} <= ptrs


@pytest.mark.parametrize(
    "mask", [mh.sliding_window(6), mh.causal(), mh.prefix_lm(5)], ids=["window", "causal", "prefix"]
)
def test_band_and_stair_gradcheck_gqa(monkeypatch, mask):
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 4)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 4)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 14, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(1, 2, 14, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(1, 2, 14, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    pieces = tiled_backend.BACKEND.plan(make_problem(q, k, v, mask=mask, bias=mh.alibi(4)))
    assert len(pieces) < 14 // 4 + 2 or not mask.shift_invariant  # shift-invariant masks run as bands

    def fn(q, k, v):
        return mh.attention(q, k, v, mask=mask, bias=mh.alibi(4), backend="tiled")

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


def test_band_backward_in_sub_bands_is_exact(monkeypatch):
    """A long band's backward runs in pieces of a few blocks (bounded memory) with the same gradients."""
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 8)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 96, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(1, 2, 96, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(1, 2, 96, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = mh.sliding_window(20)
    ref = torch.autograd.grad(mh.attention(q, k, v, mask=mask, backend="reference").sum(), (q, k, v))
    monkeypatch.setattr(tiled_fused, "BAND_GRAD_BYTES", 1)  # one block per sub-band
    got = torch.autograd.grad(mh.attention(q, k, v, mask=mask, backend="tiled").sum(), (q, k, v))
    for a, b in zip(got, ref):
        assert max_err(a, b) < 1e-12


@pytest.mark.parametrize(("nq", "nk"), [(16, 16), (12, 20), (8, 24)], ids=["square", "offset", "offset2"])
def test_causal_alibi_runs_as_diagonal_bands(monkeypatch, nq, nk):
    """Causal + ALiBi: one band per diagonal of b x b tiles, forward and gradients equal the oracle."""
    from multihead.backends.tiled import plan as tiled_plan

    monkeypatch.setattr(tiled_plan, "DIAGONAL_BLOCKS", (4,))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, nq, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(1, 2, nk, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(1, 2, nk, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    bias = mh.alibi(4)
    pieces = tiled_backend.BACKEND.plan(make_problem(q, k, v, mask=mh.causal(), bias=bias))
    assert len(pieces) == nk // 4 and all(pc.bq == 4 and pc.k1 - pc.k0 == 4 for pc in pieces)
    assert sum(pc.nb for pc in pieces) * 16 <= nq * nk  # the tiles of the lower triangle only

    def run(backend):
        return mh.attention(q, k, v, mask=mh.causal(), bias=bias, backend=backend, return_lse=True)

    got, ref = run("tiled"), run("reference")
    assert max_err(got.out, ref.out) < 1e-12 and max_err(got.lse, ref.lse) < 1e-12
    assert torch.autograd.gradcheck(
        lambda q, k, v: mh.attention(q, k, v, mask=mh.causal(), bias=bias, backend="tiled"),
        (q, k, v),
        eps=1e-6,
        atol=1e-7,
        fast_mode=True,
    )


def test_diagonal_bands_only_for_causal_with_a_shift_invariant_bias():
    from multihead.backends.tiled.plan import diagonal_bands

    ctx = make_problem(*(torch.randn(1, 2, 512, 8) for _ in range(3)), mask=mh.causal()).ctx
    assert diagonal_bands(mh.causal(), None, ctx) is None  # no bias: the stair plan is better
    assert diagonal_bands(mh.sliding_window(64), mh.alibi(2), ctx) is None  # the window has its own bands
    tb = mh.custom_bias(lambda b, h, q, k: (q - k).float())
    assert diagonal_bands(mh.causal(), tb, ctx) is None  # not known to be shift-invariant
    bands = diagonal_bands(mh.causal(), mh.alibi(2), ctx)
    assert bands is not None and len(bands) == 2 and bands[0].nb == 2 and bands[1].nb == 1  # 256-blocks


@pytest.mark.parametrize("nq_nk", [(40, 40), (17, 40), (40, 23)], ids=["square", "nq<nk", "nq>nk"])
@pytest.mark.parametrize("blocks", [(8, 8), (5, 7), (16, 4)], ids=["8x8", "5x7", "16x4"])
@pytest.mark.parametrize("window,n_global", [(9, 0), (9, 5), (1, 0), (7, 40)])
def test_local_patterns_classify_analytically(window, n_global, blocks, nq_nk):
    """local / local_global tile kinds: exact for the band alone, sound with global tokens."""
    from multihead.approx import local, local_global

    mask = local(window) if n_global == 0 else local_global(window, n_global)
    ctx = MaskContext(2, 3, *nq_nk)
    grid = classify(mask, ctx, *blocks)
    truth = evaluate_kinds(mask, ctx, grid.q_edges, torch.tensor(grid.k_edges))
    assert ((grid.kinds == FULL) <= (truth == FULL)).all()
    assert ((grid.kinds == EMPTY) <= (truth == EMPTY)).all()
    if n_global == 0:
        assert torch.equal(grid.kinds, truth)


def test_rows_with_gaps_become_one_piece_per_run(blocks16):
    """Global tokens + a band: each block row far from the start has two runs of tiles (the global
    column and the band), run as two pieces merged by log-sum-exp - not one span over the whole gap."""
    from multihead.approx import local, local_global

    plan = tiled_backend.BACKEND.plan(_problem(mask=local(32)))
    assert ("masked", 12) in [(pc.kind, pc.nb) for pc in plan]  # the band is one batched call
    plan = tiled_backend.BACKEND.plan(_problem(mask=local_global(16, 4)))
    computed = sum(pc.nb * pc.bq * (pc.k1 - pc.k0) for pc in plan)
    assert computed < 256 * 256 / 3  # nowhere near the dense 256 x 256
    assert any(pc.k0 == 0 and pc.k1 == 16 and pc.r0 >= 32 for pc in plan)  # the global key column


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_gapped_rows_match_the_reference(blocks16, causal, grad):
    """Several pieces per row (global column + band), GQA, against the float64 oracle."""
    from multihead.approx import local_global

    mask = local_global(20, 5) & mh.causal() if causal else local_global(20, 5)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 150, 16, generator=g, requires_grad=grad) for h in (4, 2, 2))
    out = mh.attention(q, k, v, mask=mask, backend="tiled")
    q2, k2, v2 = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
    ref = mh.attention(q2, k2, v2, mask=mask, backend="reference")
    assert max_err(out, ref) < 1e-5
    if grad:
        dout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), dout)
        want = torch.autograd.grad(ref, (q2, k2, v2), dout.double())
        for a, b in zip(got, want, strict=True):
            assert max_err(a, b) < 1e-5


def test_a_long_causal_square_is_checked_in_strips_not_all_at_once():
    """A mask without tile kinds (here a custom causal predicate) has its diagonal squares checked by
    evaluation. At N=2048 that check once built the whole 2048 x 2048 square: the largest allocation of a
    ring attention rank, more than the attention it planned. Now no evaluation is larger than one block
    row of the grid."""
    sizes: list[int] = []

    def lower(b, h, q, k):
        out = q >= k
        sizes.append(out.numel())
        return out

    n = 2048
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    out = mh.attention(q, k, v, mask=mh.custom(lower), backend="tiled")
    assert max_err(out, mh.attention(q, k, v, mask=mh.causal(), backend="tiled")) < 1e-5
    assert sizes and max(sizes) <= 64 * n, max(sizes)  # one 64-row block row; the square is n * n
