"""Masks (True = may attend): each one against an independent dense construction written here.

The expected masks are built with plain Python loops or ``torch.tril`` from the conventions in DESIGN.md,
never with the library's own predicates. Shape legend: B batch, H heads, Nq queries, Nk keys.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.core.masks import MaskContext, as_mask
from tests.numerics import TOL

# (Nq, Nk): Nq < Nk (decode / chunked prefill), Nq == Nk, Nq > Nk (first rows see nothing).
SIZES = [(1, 1), (1, 6), (3, 7), (6, 6), (7, 3), (5, 1)]


def loop_mask(Nq: int, Nk: int, allowed) -> torch.Tensor:
    """A (Nq, Nk) bool tensor from a plain Python predicate ``allowed(i, j)``."""
    return torch.tensor([[bool(allowed(i, j)) for j in range(Nk)] for i in range(Nq)], dtype=torch.bool)


def assert_mask_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bool
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    assert torch.equal(got, want), f"\ngot:\n{got.int()}\nwant:\n{want.int()}"


# -- causal -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("Nq", "Nk"), SIZES)
def test_causal_is_bottom_right_aligned(Nq, Nk):
    # Query row i sits at absolute position i + (Nk - Nq); it sees keys up to and including that position.
    want = loop_mask(Nq, Nk, lambda i, j: j <= i + (Nk - Nq))
    assert_mask_equal(mh.causal().dense(2, 3, Nq, Nk), want.expand(2, 3, Nq, Nk))
    # the same picture with torch.tril: the diagonal moves right by Nk - Nq
    assert_mask_equal(mh.causal().dense(1, 1, Nq, Nk)[0, 0], torch.ones(Nq, Nk).tril(Nk - Nq).bool())


def test_causal_last_row_sees_every_key_and_nq_gt_nk_empties_first_rows():
    for Nq, Nk in SIZES:
        m = mh.causal().dense(1, 1, Nq, Nk)[0, 0]
        assert bool(m[-1].all()), (Nq, Nk)
    m = mh.causal().dense(1, 1, 7, 3)[0, 0]
    assert not bool(m[:4].any())  # rows 0..3 sit before key 0: empty
    assert m.sum(dim=-1).tolist() == [0, 0, 0, 0, 1, 2, 3]


def test_causal_flags():
    assert mh.causal().is_causal
    for m in (mh.causal() & mh.padding([3]), ~mh.causal(), mh.sliding_window(3), mh.prefix_lm(2)):
        assert not m.is_causal, m


# -- sliding window -----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
@pytest.mark.parametrize(("Nq", "Nk"), SIZES)
def test_sliding_window(size, Nq, Nk):
    # Mistral: query at position p sees keys p - size + 1 .. p.
    def allowed(i, j):
        p = i + (Nk - Nq)
        return p - size < j <= p

    want = loop_mask(Nq, Nk, allowed)
    assert_mask_equal(mh.sliding_window(size).dense(1, 2, Nq, Nk)[0, 1], want)


def test_sliding_window_one_sees_only_itself_and_large_window_is_causal():
    assert_mask_equal(mh.sliding_window(1).dense(1, 1, 5, 5)[0, 0], torch.eye(5, dtype=torch.bool))
    # a window of size w has exactly min(w, p + 1) keys in row p
    assert mh.sliding_window(3).dense(1, 1, 6, 6)[0, 0].sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert_mask_equal(mh.sliding_window(50).dense(1, 1, 4, 9), mh.causal().dense(1, 1, 4, 9))


# -- padding / key padding ----------------------------------------------------------------------------
@pytest.mark.parametrize(("Nq", "Nk"), [(4, 5), (5, 5), (1, 5), (7, 5)])
def test_padding_right_pads_each_batch_row(Nq, Nk):
    lengths = [0, 3, 5]
    got = mh.padding(lengths).dense(3, 2, Nq, Nk)
    for b, n in enumerate(lengths):
        want = loop_mask(Nq, Nk, lambda i, j, n=n: j < n)
        for h in range(2):
            assert_mask_equal(got[b, h], want)
    # a tensor of lengths works the same
    assert_mask_equal(mh.padding(torch.tensor(lengths)).dense(3, 2, Nq, Nk), got)


def test_key_padding_hides_padded_keys_from_every_query():
    g = torch.Generator().manual_seed(0)
    real = torch.rand(3, 6, generator=g) > 0.4  # (B, Nk), True = real token
    got = mh.key_padding(real).dense(3, 2, 4, 6)
    for b in range(3):
        want = loop_mask(4, 6, lambda i, j, b=b: bool(real[b, j]))
        assert_mask_equal(got[b, 0], want)
        assert_mask_equal(got[b, 1], want)


def test_padding_equals_key_padding_of_the_same_lengths():
    lengths = [2, 6, 4]
    real = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]  # (B, Nk)
    assert_mask_equal(mh.padding(lengths).dense(3, 1, 6, 6), mh.key_padding(real).dense(3, 1, 6, 6))


# -- document ------------------------------------------------------------------------------------------
def test_document_1d_ids_same_document_only():
    ids = [0, 0, 1, 1, 1, 2]
    want = loop_mask(6, 6, lambda i, j: ids[i] == ids[j])
    got = mh.document(ids).dense(2, 3, 6, 6)
    assert_mask_equal(got, want.expand(2, 3, 6, 6))
    # packed decoder training: document & causal is block-diagonal lower-triangular
    want_c = loop_mask(6, 6, lambda i, j: ids[i] == ids[j] and j <= i)
    assert_mask_equal((mh.document(ids) & mh.causal()).dense(1, 1, 6, 6)[0, 0], want_c)


def test_document_batched_ids():
    ids = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 2]])  # (B, N)
    got = mh.document(ids).dense(2, 2, 5, 5)
    for b in range(2):
        want = loop_mask(5, 5, lambda i, j, b=b: int(ids[b, i]) == int(ids[b, j]))
        assert_mask_equal(got[b, 0], want)
        assert_mask_equal(got[b, 1], want)


@pytest.mark.parametrize("Nq", [1, 2, 4])
def test_document_bottom_right_for_nq_lt_nk(Nq):
    # Queries are the last Nq positions of the packed sequence: row i carries the id at i + Nk - Nq.
    ids = [0, 0, 1, 1, 2, 2, 2]
    Nk = len(ids)
    want = loop_mask(Nq, Nk, lambda i, j: ids[i + Nk - Nq] == ids[j])
    assert_mask_equal(mh.document(ids).dense(1, 1, Nq, Nk)[0, 0], want)


def test_document_nq_gt_nk_first_rows_are_empty():
    # Rows at negative absolute positions belong to no document (as with causal); they must not wrap
    # around to the ids at the end of the sequence.
    ids = [0, 1]
    got = mh.document(ids).dense(1, 1, 4, 2)[0, 0]
    want = loop_mask(4, 2, lambda i, j: i - 2 >= 0 and ids[i - 2] == ids[j])
    assert_mask_equal(got, want)


# -- prefix LM / custom --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 6, 9])
@pytest.mark.parametrize(("Nq", "Nk"), [(6, 6), (2, 6), (1, 6)])
def test_prefix_lm(n, Nq, Nk):
    # Every query sees the first n keys (bidirectional prefix); after it, causal.
    want = loop_mask(Nq, Nk, lambda i, j: j < n or j <= i + (Nk - Nq))
    assert_mask_equal(mh.prefix_lm(n).dense(1, 1, Nq, Nk)[0, 0], want)


def test_prefix_lm_zero_is_causal():
    assert_mask_equal(mh.prefix_lm(0).dense(2, 2, 5, 7), mh.causal().dense(2, 2, 5, 7))


def test_custom_predicate_uses_raw_indices_and_all_four_arguments():
    def fn(b, h, q, k):
        return ((q + k + b) % 2 == 0) | (k == h)

    B, H, Nq, Nk = 2, 3, 4, 5
    got = mh.custom(fn).dense(B, H, Nq, Nk)
    for b in range(B):
        for h in range(H):
            want = loop_mask(Nq, Nk, lambda i, j, b=b, h=h: (i + j + b) % 2 == 0 or j == h)
            assert_mask_equal(got[b, h], want)


# -- composition ---------------------------------------------------------------------------------------
def _menagerie(B: int, Nk: int) -> dict[str, mh.Mask]:
    g = torch.Generator().manual_seed(1)
    return {
        "causal": mh.causal(),
        "window": mh.sliding_window(3),
        "padding": mh.padding(torch.randint(0, Nk + 1, (B,), generator=g)),
        "key_padding": mh.key_padding(torch.rand(B, Nk, generator=g) > 0.3),
        "document": mh.document(torch.randint(0, 3, (B, Nk), generator=g).sort(dim=-1).values),
        "prefix": mh.prefix_lm(2),
        "custom": mh.custom(lambda b, h, q, k: (q * 3 + k + h) % 4 != 0),
        "tensor": torch.rand(B, 1, 1, Nk, generator=g) > 0.2,
    }


@pytest.mark.parametrize(("Nq", "Nk"), [(5, 7), (6, 6), (7, 4)])
def test_and_or_not_match_dense_bool_expressions(Nq, Nk):
    B, H = 2, 3
    masks = _menagerie(B, Nk)
    dense = {
        name: (m.dense(B, H, Nq, Nk) if isinstance(m, mh.Mask) else m.expand(B, H, Nq, Nk))
        for name, m in masks.items()
    }
    names = list(masks)
    for a in names:
        ma, da = as_mask(masks[a]), dense[a]  # a bool tensor on the right of & | is taken as it is
        assert_mask_equal((~ma).dense(B, H, Nq, Nk), ~da)
        for b in names:
            assert_mask_equal((ma & masks[b]).dense(B, H, Nq, Nk), da & dense[b])
            assert_mask_equal((ma | masks[b]).dense(B, H, Nq, Nk), da | dense[b])
    # longer expressions, De Morgan
    c, w, p = masks["causal"], masks["window"], masks["padding"]
    dc, dw, dp = dense["causal"], dense["window"], dense["padding"]
    assert_mask_equal(((c & ~w) | p).dense(B, H, Nq, Nk), (dc & ~dw) | dp)
    assert_mask_equal((~(c | p)).dense(B, H, Nq, Nk), ~dc & ~dp)


def test_dense_shape_and_dtype():
    for m in _menagerie(2, 5).values():
        d = as_mask(m).dense(2, 3, 4, 5)
        assert d.shape == (2, 3, 4, 5) and d.dtype == torch.bool and d.device.type == "cpu", m


# -- block: what the tiled kernel relies on -----------------------------------------------------------
@pytest.mark.parametrize(("Nq", "Nk"), [(13, 17), (16, 16), (17, 9)])
def test_block_equals_slice_of_dense(Nq, Nk):
    B, H = 2, 3
    rng = random.Random(Nq * 100 + Nk)
    masks = {name: as_mask(m) for name, m in _menagerie(B, Nk).items()}
    masks["doc|causal"] = mh.document(list(range(Nk))) | mh.causal()
    masks["window&~padding"] = mh.sliding_window(4) & ~mh.padding([2, 5])
    masks["head tensor"] = as_mask(torch.rand(1, H, Nq, Nk, generator=torch.Generator().manual_seed(5)) > 0.5)
    ctx = MaskContext(B, H, Nq, Nk)
    for name, m in masks.items():
        full = m.dense(B, H, Nq, Nk)
        for _ in range(12):
            q0 = rng.randrange(0, Nq)
            q1 = rng.randrange(q0 + 1, Nq + 1)
            k0 = rng.randrange(0, Nk)
            k1 = rng.randrange(k0 + 1, Nk + 1)
            tile = m.block(ctx, (q0, q1), (k0, k1))
            assert tile.dtype == torch.bool, name
            assert_mask_equal(tile.expand(B, H, q1 - q0, k1 - k0), full[:, :, q0:q1, k0:k1])


# -- bool tensors as masks ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [(4, 6), (6,), (1, 3, 4, 6), (2, 1, 1, 6), (2, 3, 4, 6), (3, 1, 6), (2, 1, 4, 1), (1, 1, 1, 1), ()],
)
def test_bool_tensor_mask_broadcasts(shape):
    B, H, Nq, Nk = 2, 3, 4, 6
    g = torch.Generator().manual_seed(len(shape))
    t = torch.rand(shape, generator=g) > 0.3
    want = t.expand(B, H, Nq, Nk)  # torch's own broadcasting is the outside reference
    assert_mask_equal(as_mask(t).dense(B, H, Nq, Nk), want)
    # and through attention: the result equals the one with the fully expanded mask and a manual softmax
    q = torch.randn(B, H, Nq, 5, dtype=torch.float64, generator=g)
    k = torch.randn(B, H, Nk, 5, dtype=torch.float64, generator=g)
    v = torch.randn(B, H, Nk, 5, dtype=torch.float64, generator=g)
    got = mh.attention(q, k, v, mask=t, backend="matrix")
    full = mh.attention(q, k, v, mask=want.contiguous(), backend="matrix")
    assert torch.allclose(got, full, atol=TOL[torch.float64], rtol=0)
    assert torch.allclose(got, manual_attention(q, k, v, want), atol=TOL[torch.float64], rtol=0)


def manual_attention(q, k, v, allowed, scale=None):
    """softmax over allowed keys, zeros on rows with none; float64, MHA only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize(("Nq", "Nk"), [(3, 8), (8, 8), (9, 5)])
def test_every_mask_applied_by_attention_matches_manual(Nq, Nk):
    B, H, D = 2, 2, 4
    g = torch.Generator().manual_seed(Nq + Nk)
    q = torch.randn(B, H, Nq, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, H, Nk, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, H, Nk, D, dtype=torch.float64, generator=g)
    for name, m in _menagerie(B, Nk).items():
        allowed = as_mask(m).dense(B, H, Nq, Nk)
        want = manual_attention(q, k, v, allowed)
        for backend in ("reference", "matrix", "tiled", "sdpa"):
            got = mh.attention(q, k, v, mask=m, backend=backend)
            err = (got - want).abs().max().item()
            assert err <= TOL[torch.float64], (name, backend, err)


@pytest.mark.parametrize(
    "mask",
    [mh.causal(), mh.sliding_window(3), mh.prefix_lm(4), mh.document([0, 0, 0, 1, 1, 1, 1, 2, 2])],
    ids=repr,
)
def test_chunked_prefill_rows_equal_full_rows(mask):
    # Bottom-right alignment: attending the last Nq queries against all Nk keys gives the same rows as the
    # full Nk x Nk call (prefill, chunked prefill and one-token decode share one mask).
    g = torch.Generator().manual_seed(3)
    N = 9
    q = torch.randn(1, 2, N, 4, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, N, 4, dtype=torch.float64, generator=g)
    v = torch.randn(1, 2, N, 4, dtype=torch.float64, generator=g)
    full = mh.attention(q, k, v, mask=mask, backend="reference")
    for Nq in (1, 2, 5):
        part = mh.attention(q[:, :, -Nq:], k, v, mask=mask, backend="reference")
        assert torch.allclose(part, full[:, :, -Nq:], atol=TOL[torch.float64], rtol=0), Nq


# -- printing ------------------------------------------------------------------------------------------
def test_str_draws_causal_picture():
    text = str(mh.causal())
    lines = text.splitlines()
    assert lines[0].startswith("causal()")
    rows = lines[1:]
    assert len(rows) == 8
    for i, row in enumerate(rows):
        assert row == " ".join(["#"] * (i + 1) + ["."] * (7 - i))


def test_picture_of_small_bottom_right_causal():
    lines = mh.causal().picture(2, 5).splitlines()
    assert "Nq=2" in lines[0] and "Nk=5" in lines[0]
    assert lines[1:] == ["# # # # .", "# # # # #"]
    lines = mh.causal().picture(4, 2).splitlines()
    assert lines[1:] == [". .", ". .", "# .", "# #"]


def test_str_of_sized_masks():
    lines = str(mh.padding([2, 3])).splitlines()  # drawn for batch row 0 at (max length + 1) = 4
    assert lines[1:] == ["# # . ."] * 4
    lines = str(mh.document([0, 0, 1])).splitlines()
    assert lines[1:] == ["# # .", "# # .", ". . #"]
    lines = mh.sliding_window(2).picture(3, 3).splitlines()
    assert lines[1:] == ["# . .", "# # .", ". # #"]


def test_str_of_composed_and_tensor_masks():
    real = torch.tensor([[True, True, True, False, False]])
    lines = str(mh.causal() & mh.key_padding(real)).splitlines()
    assert lines[1:] == ["# . . . .", "# # . . .", "# # # . .", "# # # . .", "# # # . ."]
    lines = str(mh.document([0, 0, 1, 1]) & mh.padding([3, 4])).splitlines()
    assert lines[1:] == ["# # . .", "# # . .", ". . # .", ". . # ."]
    t = torch.tensor([[True, False, True], [False, False, False], [False, False, False]])
    lines = str(mh.causal() | t).splitlines()
    assert lines[1:] == ["# . #", "# # .", "# # #"]
    lines = str(~mh.padding([2])).splitlines()
    assert lines[1:] == [". . #"] * 3
    # a tensor with a head dim draws head 0; a scalar tensor draws one cell
    heads = torch.zeros(1, 3, 2, 2, dtype=torch.bool)
    heads[0, 0, 0, 1] = True
    assert str(as_mask(heads)).splitlines()[1:] == [". #", ". ."]
    assert as_mask(heads).picture(head=2).splitlines()[1:] == [". .", ". ."]
    assert str(as_mask(torch.tensor(True))).splitlines()[1:] == ["#"]


def test_str_of_large_mask_is_one_short_line():
    for m in (mh.document(list(range(200))), mh.padding([1000]), mh.key_padding(torch.ones(1, 60).bool())):
        text = str(m)
        assert "\n" not in text and len(text) < 200, text
        assert "too large" in text


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 300),
    bi=st.integers(1, 3),
    size=st.integers(1, 40),
    shift=st.integers(0, 40),
    offset=st.integers(-60, 0),
    seed=st.integers(0, 2**16),
)
def test_tile_min_max_of_tile_edges_equals_slicing(n, bi, size, shift, offset, seed):
    """Document masks classify tiles by each tile's smallest and largest id: over tile edges (a shifted
    first block, clamped query ranges that leave empty ones) the padded reduction gives what slicing
    each range gives, empty ranges (max + 1, min - 1)."""
    from multihead.core.ranges import range_min_max, regular_min_max
    from multihead.core.tiles import edges

    low = -60 if seed % 2 else 0  # all-negative ids too: padding must sit below every id
    ids = torch.randint(low, low + 55, (bi, n), generator=torch.Generator().manual_seed(seed)).sort(1).values
    e = edges(n, size, min(shift, size) % size)
    lo, hi = [max(0, a + offset) for a in e[:-1]], [max(0, b + offset) for b in e[1:]]
    big, small = int(ids.max()) + 1, int(ids.min()) - 1
    above, below = torch.full((bi,), big), torch.full((bi,), small)
    want_min = torch.stack([ids[:, a:b].amin(1) if b > a else above for a, b in zip(lo, hi)], 1)
    want_max = torch.stack([ids[:, a:b].amax(1) if b > a else below for a, b in zip(lo, hi)], 1)
    got_min, got_max = range_min_max(ids, lo, hi)
    assert torch.equal(got_min, want_min) and torch.equal(got_max, want_max)
    if sum(b > a for a, b in zip(lo, hi)) >= 2:  # the padded reduction served it
        assert regular_min_max(ids, lo, hi, big, small) is not None


def test_tile_min_max_of_uneven_ranges_with_negative_ids():
    """Ranges of uneven lengths take the general gather; its empty-range and starting maximum sit below
    every id, negative ids included (they were -(max + 1), above all-negative ids: every tile's maximum
    read as that value, which cost the document mask its full and empty tiles)."""
    from multihead.core.ranges import range_min_max

    ids = torch.tensor([[-10] * 40 + [-3] * 40 + [-7] * 48])  # (1, 128)
    lo, hi = [0, 5, 30, 30, 70, 100], [5, 30, 30, 70, 100, 128]  # uneven, one empty
    got_min, got_max = range_min_max(ids, lo, hi)
    assert got_min.tolist() == [[-10, -10, -2, -10, -7, -7]]
    assert got_max.tolist() == [[-10, -10, -11, -3, -3, -7]]
