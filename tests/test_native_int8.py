"""The native int8 GEMV (multihead.native.int8), Int8GemvLinear and int8 native decode steps: float64
on the same int8 numbers, the fp32 model within the stated tolerance, the eager steps of the same
int8 model, and the old kernels wherever the native ones cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import native
from multihead.models import native_step, quant
from multihead.models.int8_gemv_linear import dequantize_groups, quantize_groups
from multihead.native import int8 as native_int8
from tests.native_builds import built_for

REASON = native.unavailable()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
LOGIT_TOL = 0.05  # tests/test_quant.py's stated tolerance of a quantized model against fp32
GROUPS = [None, 32, 64]


def _reference(w8, scale, group, xq, xs, bias=None):
    """The int8 product in float64 on the same int8 numbers: (W8 * scale) @ (xq * xs) + bias."""
    w = dequantize_groups(w8, scale.double(), group, torch.float64)  # (O, I)
    x = (xq.double().view(-1, 32) * xs.double()[:, None]).view(-1)[: w.shape[1]]  # (I,)
    y = w @ x  # (O,)
    return y if bias is None else y + bias.double(), w.abs() @ x.abs() + 1


@needs_native
@pytest.mark.parametrize(
    ("rows", "cols"), [(1, 1), (5, 7), (3, 33), (17, 100), (8, 130), (4, 1000), (3, 1024), (70, 2048)]
)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemv_matches_float64_on_the_same_int8_numbers(rows, cols, group, bias):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    w8, scale = quantize_groups(torch.randn(rows, cols, generator=g), group)
    x = torch.randn(cols, generator=g) * 3  # (I,)
    b = torch.randn(rows, generator=g) if bias else None  # (O,)
    y = native_int8.gemv_q8(w8, scale, x, b, group)
    assert y.shape == (rows,) and y.dtype == torch.float32
    ref, size = _reference(w8, scale, group, *native_int8.quantize_activations(x), b)
    assert float(((y.double() - ref).abs() / size).max()) < 1e-6


@needs_native
@pytest.mark.parametrize(
    ("rows", "cols", "group"),
    [
        (6, 1000, 128),  # a power of two: each scale serves 4 blocks
        (5, 700, 192),  # no power of two: scales gathered
        (3, 1500, 512),
        (4, 33000, 32),  # past the widths whose lane starts live on the stack
        (3, 40000, None),
    ],
)
def test_int8_gemv_other_groups_and_wide_rows(rows, cols, group):
    g = torch.Generator().manual_seed(cols)
    w8, scale = quantize_groups(torch.randn(rows, cols, generator=g), group)
    x = torch.randn(cols, generator=g)  # (I,)
    y = native_int8.gemv_q8(w8, scale, x, None, group)
    ref, size = _reference(w8, scale, group, *native_int8.quantize_activations(x))
    assert float(((y.double() - ref).abs() / size).max()) < 1e-6


@needs_native
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 1024])
def test_activation_rounding_is_torchs(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 5  # (I,)
    x[: n // 3] = 0  # an all-zero block: scale 0, values 0
    xq, xs = native_int8.quantize_activations(x)
    pad = -(-n // 64) * 64
    assert xq.shape == (pad,) and xs.shape == (pad // 32,)
    blocks = F.pad(x, (0, pad - n)).view(-1, 32)  # (I64 / 32, 32)
    scale = blocks.abs().amax(1) / 127.0  # (I64 / 32,)
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None])  # (I64 / 32, 32)
    assert torch.equal(xs, scale) and torch.equal(xq.view(-1, 32).float(), q)


@needs_native
@pytest.mark.parametrize("n", [64, 96 + 17])  # whole blocks (vector code where AVX-512), and a scalar tail
def test_activation_rounding_of_ties_extremes_and_non_numbers(n):
    """Exact halves round to even; a NaN is passed over by the block's largest |x| and becomes 0; an inf
    makes its block's scale inf (every value then 0: x / inf, inf / inf a NaN); the whole blocks (AVX-512
    code) and the tail (plain C) agree with one reference."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randint(-40, 41, (n,), generator=g) / 2.0) * (127 / 20)  # many exact halves of the step
    x[5], x[40], x[50] = float("nan"), float("inf"), -3e38
    x[n - 3] = float("nan")  # in the tail block too
    xq, xs = native_int8.quantize_activations(x)
    pad = -(-n // 64) * 64
    blocks = F.pad(x, (0, pad - n)).view(-1, 32)  # (I64 / 32, 32)
    scale = torch.where(blocks.isnan(), 0.0, blocks.abs()).amax(1) / 127.0  # NaN passed over; inf kept
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127)
    q = torch.where(q.isnan(), 0.0, q)  # (I64 / 32, 32)
    assert torch.equal(xs, scale) and torch.equal(xq.view(-1, 32).float(), q)


@pytest.mark.parametrize("group", GROUPS)
def test_group_rounding_bound_and_odd_widths(group):
    w = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))  # 100: a short last group
    w[2, :40] = 0
    w8, scale = quantize_groups(w, group)
    assert w8.dtype == torch.int8 and w8.shape == (6, 100)
    assert scale.shape == ((6,) if group is None else (6, -(-100 // group)))
    back = dequantize_groups(w8, scale, group, torch.float32)  # (O, I)
    step = dequantize_groups(torch.ones_like(w8), scale, group, torch.float32)  # each weight's scale
    assert float(((back - w).abs() - step / 2).max()) <= 1e-6
    if group is not None:  # smaller groups round no worse than one scale per row
        per_row = dequantize_groups(*quantize_groups(w, None), None, torch.float32)
        assert float((back - w).abs().max()) <= float((per_row - w).abs().max())


@needs_native
@pytest.mark.parametrize("group", GROUPS)
def test_int8_gemv_linear_one_row_native_and_with_grad_f_linear_on_the_dequantized_weight(group, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200)
    layer = quant.Int8GemvLinear(lin, group)
    assert layer.why_not_native is None
    calls = []
    real = native_int8.run_q8
    monkeypatch.setattr(native_int8, "run_q8", lambda *a: calls.append(1) or real(*a))
    w = layer.dequantized()  # (O, I)
    with torch.no_grad():
        for shape in ((96,), (1, 96), (1, 1, 96)):
            x = torch.randn(shape)
            ref, size = _reference(
                layer.weight_int8,
                layer.scale,
                group,
                *native_int8.quantize_activations(x.view(-1)),
                layer.bias,
            )
            assert float(((layer(x).view(-1).double() - ref).abs() / size).max()) < 1e-6
            # against the unrounded activation: within the int8 activation rounding (absmax / 254 a value)
            torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), rtol=0.02, atol=0.02)
        assert len(calls) == 6
    x = torch.randn(3, 96, requires_grad=True)  # training: F.linear on the dequantized weight
    assert torch.equal(layer(x), F.linear(x, w, layer.bias))
    assert len(calls) == 6


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return mh.TransformerLM(500, 64, 2, 4, 128, n_kv_heads=2).eval()


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kv", [None, "int8"])
def test_int8_native_model_within_tolerance_of_fp32_and_greedy_equal(lm, group, kv):
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    q = quant.quantize(lm, weights="int8", kv=kv, kernel="native", group_size=group)
    assert q.why_not_native_steps == (
        None if REASON is None else f"the native kernels are unavailable: {REASON}"
    )
    with torch.no_grad():
        ref, out = lm(ids), q(ids)
        span = float(ref.max() - ref.min())
        assert float((out - ref).abs().max()) <= LOGIT_TOL * span
        assert torch.equal(q.generate(ids[:, :8], 16), lm.generate(ids[:, :8], 16))


def _cached(c) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first 15 cached keys and values as floats (an int8 cache's dequantized)."""
    if c.kind != "int8":
        return c.k[:, :, :15].float(), c.v[:, :, :15].float()
    k = c.k[:, :, :15].float() * c.k_scale[:, :, :15]  # (B, Hkv, 15, D): scales (B, Hkv, 15, 1)
    v = c.v[:, :, :15].float() * c.v_scale[:, :, :15]  # (B, Hkv, 15, D)
    return k, v


@needs_native
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kv", [None, "int8"])
def test_int8_native_steps_follow_the_eager_steps_of_the_same_model(lm, group, kv, monkeypatch):
    """The native steps against the eager layers of the same int8 model, both against the float model.

    The two compute the same equations with sums in other orders (torch's GEMMs and attention against
    the native kernels): values that differ in their last bits can round to neighbouring int8 steps
    (an activation block's or a cached key's), and one such step then moves every later value by a
    fraction of the int8 model's own error. So the rule is the numerics rule's: the native steps' error
    against the float model at most twice the eager steps' (no worse than the eager int8 model), and
    the two apart by at most the eager steps' error; the caches' values within twice the eager cache's
    error."""
    fast = quant.quantize(lm, weights="int8", kv=kv, kernel="native", group_size=group)
    slow = copy.deepcopy(fast)
    slow.native_steps = False  # the eager layers; their linears still run the native int8 GEMV
    prompt = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 500, (6,), generator=torch.Generator().manual_seed(3))
    calls = []
    real = native_step.decode_step
    monkeypatch.setattr(native_step, "decode_step", lambda *a: calls.append(1) or real(*a))
    caches = []
    hs = []
    with torch.no_grad():
        for model in (fast, slow, lm):
            cache = model.make_cache(1, 32)
            assert cache[0].kind == ("int8" if kv and model is not lm else "dense")
            model.hidden_states(prompt, cache=cache)
            hs.append(torch.stack([model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]))
            caches.append(cache)
            if model is slow:
                assert len(calls) == 1 + 6  # the prompt in one native call, then the six steps
    native_err, eager_err, apart = (
        float((a - b).abs().max()) for a, b in ((hs[0], hs[2]), (hs[1], hs[2]), (hs[0], hs[1]))
    )
    assert eager_err > 0  # the int8 model is not the float one
    assert native_err <= 2 * eager_err and apart <= eager_err, (native_err, eager_err, apart)
    for c, e, f in zip(*caches):  # the native layer wrote what the eager cache holds
        assert c.position == e.position == 15
        for got, eager, exact in zip(_cached(c), _cached(e), _cached(f)):
            eager_err = float((eager - exact).abs().max())  # a cached value's rounding: up to half a step
            assert float((got - exact).abs().max()) <= 2 * eager_err + 1e-6


@needs_native
def test_a_tied_head_shares_its_group_scales_with_the_embedding(lm):
    q = quant.quantize(lm, weights="int8", kv=None, group_size=32)  # auto: native for a decoder
    assert isinstance(q.lm_head, quant.Int8GemvLinear) and q.lm_head.group_size == 32
    assert q.embed.weight_int8 is q.lm_head.weight_int8 and q.embed.scale is q.lm_head.scale
    ids = torch.tensor([[3, 499]])
    torch.testing.assert_close(q.embed(ids)[0], q.lm_head.dequantized()[ids[0]])
    assert quant.model_bytes(lm) / quant.model_bytes(q) > 3.2  # 1.125 bytes a weight and fp32 norms


def test_without_native_kernels_int8_takes_the_old_kernels(lm, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_NATIVE", "0")
    native.loader.load.cache_clear()
    try:
        assert native.unavailable() == "disabled by MULTIHEAD_NATIVE=0"
        q = quant.quantize(lm, weights="int8", kv="int8")  # auto: fbgemm, as before the native kernel
        assert isinstance(q.lm_head, quant.Int8Linear) and not isinstance(q.lm_head, quant.Int8GemvLinear)
        grouped = quant.quantize(lm, weights="int8", kv="int8", group_size=64)  # F.linear, dequantized
        assert "F.linear (disabled by MULTIHEAD_NATIVE=0)" in repr(grouped.lm_head)
        assert "unavailable" in grouped.why_not_native_steps
        ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            ref = lm.generate(ids, 12)
            assert torch.equal(q.generate(ids, 12), ref) and torch.equal(grouped.generate(ids, 12), ref)
        with pytest.raises(
            ValueError, match="the native int8 GEMV is unavailable: disabled by MULTIHEAD_NATIVE"
        ):
            native_int8.gemv_q8(grouped.lm_head.weight_int8, grouped.lm_head.scale, torch.randn(64), None, 64)
    finally:
        native.loader.load.cache_clear()


@needs_native
def test_gemv_q8_rejects_bad_inputs_with_the_fix():
    w8, scale = quantize_groups(torch.randn(4, 64), 32)
    x = torch.randn(64)
    with pytest.raises(ValueError, match="group_size must be 32, a multiple of 64 or None, got 48"):
        native_int8.gemv_q8(w8, scale, x, None, 48)
    with pytest.raises(ValueError, match=r"needs weight \(O, I\), scale \(O, ceil\(I / group\)\)"):
        native_int8.gemv_q8(w8, scale, x, None, 64)
    with pytest.raises(ValueError, match="needs an int8 weight and fp32 scale, x and bias"):
        native_int8.gemv_q8(w8.float(), scale, x, None, 32)
    with pytest.raises(ValueError, match=r"needs bias \(O,\) = \(4,\), got \(3,\)"):
        native_int8.gemv_q8(w8, scale, x, torch.randn(3), 32)
    with pytest.raises(ValueError, match="group_size must be 32, 64"):
        quant.Int8GemvLinear(torch.nn.Linear(8, 8), group_size=16)


@needs_native
@pytest.mark.parametrize(
    ("march", "flag", "isa"),
    [("x86-64", "sse2", "portable C"), ("x86-64-v3", "avx2", "AVX2")],
)
def test_the_portable_and_avx2_int8_paths_pass_the_self_check(march, flag, isa, monkeypatch):
    with built_for(march, flag, monkeypatch):
        assert native.unavailable() is None  # the build for that target passed the int8 self-check too
        assert native_int8.isa() == isa
        w8, scale = quantize_groups(torch.randn(9, 200), 64)
        x = torch.randn(200)
        ref, size = _reference(w8, scale, 64, *native_int8.quantize_activations(x))
        assert float(((native_int8.gemv_q8(w8, scale, x, None, 64).double() - ref).abs() / size).max()) < 1e-6
        assert not native_int8.reads_blocked() and not quant.Int8GemvLinear(torch.nn.Linear(600, 3)).blocked
        with pytest.raises(ValueError, match="blocked=True needs the AVX512-VNNI kernel"):
            native_int8.gemv_q8(w8, scale, x, None, 64, blocked=True)


@needs_native
@pytest.mark.parametrize(("d", "n_heads", "n_kv_heads"), [(216, 3, 1), (480, 6, 1)])
def test_int8_cache_attention_every_head_dim_and_group_tail(d, n_heads, n_kv_heads):
    """The native attention over an int8 cache (scales on the scores and the weights, not the rows) at
    head dims 72 and 80 and 3 or 6 query heads a kv head, past 64 keys: as the eager step."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, d, 1, n_heads, 64, n_kv_heads=n_kv_heads).eval()
    fast = quant.quantize(lm, weights="int8", kv="int8", kernel="native", group_size=32)
    slow = copy.deepcopy(fast)
    slow.native_steps = False
    prompt = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))
    hs = []
    with torch.no_grad():
        for model in (fast, slow):
            cache = model.make_cache(1, 80)
            model.hidden_states(prompt, cache=cache)
            hs.append(torch.stack([model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]))
    torch.testing.assert_close(hs[0], hs[1], rtol=1e-4, atol=1e-4)


def test_the_blocked_layout_permutes_each_rows_columns_within_every_512():
    """Stored byte 64 v + 4 l + t of every whole 512 columns is column 32 l + 4 v + t; the columns past the
    last whole 512 stay; from_blocked undoes it (any leading dims)."""
    from multihead.native.layout import from_blocked, to_blocked

    cols = torch.arange(1100).expand(2, 3, 1100)  # (2, 3, I): each value its column
    b = to_blocked(cols)
    for j in (0, 1):
        for v, l, t in ((0, 0, 0), (0, 1, 0), (1, 0, 2), (7, 15, 3), (3, 9, 1)):
            assert int(b[1, 2, 512 * j + 64 * v + 4 * l + t]) == 512 * j + 32 * l + 4 * v + t
    assert torch.equal(b[..., 1024:], cols[..., 1024:])
    assert sorted(b[0, 0].tolist()) == list(range(1100))
    assert torch.equal(from_blocked(b), cols)
    assert torch.equal(to_blocked(cols[..., :300]), cols[..., :300])  # no whole 512: as it is


needs_blocked = pytest.mark.skipif(
    REASON is not None or not native_int8.reads_blocked(),
    reason=f"the blocked layout is the AVX512-VNNI kernel's; here: {native_int8.isa() or REASON}",
)


@needs_blocked
@pytest.mark.parametrize(
    ("rows", "cols", "group"),
    [(1, 512, 32), (3, 512, 32), (5, 1024, None), (4, 1100, 32), (3, 1100, 64), (2, 2816, 128),
     (3, 1600, 192), (6, 2048, 512), (2, 33000, 32), (7, 1024, 32)],
)  # fmt: skip
def test_int8_gemv_on_blocked_rows_matches_float64(rows, cols, group):
    """The kernel on rows in the blocked layout (whole 512s and a tail; scales of every group size, per
    row; past the stack's scratch; one row, and odd counts, whose middle row is its own partner) against
    float64 on the same int8 numbers in column order."""
    from multihead.native.layout import to_blocked

    g = torch.Generator().manual_seed(cols + rows)
    w8, scale = quantize_groups(torch.randn(rows, cols, generator=g), group)
    x = torch.randn(cols, generator=g) * 2  # (I,)
    b = torch.randn(rows, generator=g)  # (O,)
    y = native_int8.gemv_q8(to_blocked(w8), scale, x, b, group, blocked=True)
    ref, size = _reference(w8, scale, group, *native_int8.quantize_activations(x), b)
    assert float(((y.double() - ref).abs() / size).max()) < 1e-6


@needs_blocked
@pytest.mark.parametrize("group", [None, 32])
def test_int8_gemv_linear_keeps_blocked_rows_and_a_state_dict_in_column_order(group, monkeypatch):
    """Where the kernel reads the blocked layout an Int8GemvLinear keeps its rows so; int8_weight, the
    dequantized weight and the state dict are in column order, and the state dict loads into a module
    of either layout with the same outputs."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1100, 40)
    layer = quant.Int8GemvLinear(lin, group)
    w8, scale = quantize_groups(lin.weight, group)
    assert layer.blocked and not torch.equal(layer.weight_int8, w8)
    assert torch.equal(layer.int8_weight, w8) and torch.equal(layer.state_dict()["weight_int8"], w8)
    torch.testing.assert_close(layer.dequantized(), dequantize_groups(w8, scale, group, torch.float32))
    x = torch.randn(1100)
    with torch.no_grad():
        y = layer(x)
        ref, size = _reference(w8, scale, group, *native_int8.quantize_activations(x), layer.bias)
        assert float(((y.double() - ref).abs() / size).max()) < 1e-6
        other = quant.Int8GemvLinear(torch.nn.Linear(1100, 40), group)
        other.load_state_dict(layer.state_dict())
        assert torch.equal(other.weight_int8, layer.weight_int8) and torch.equal(other(x), y)
        monkeypatch.setattr(native_int8, "reads_blocked", lambda: False)  # a machine without the layout
        plain = quant.Int8GemvLinear(torch.nn.Linear(1100, 40), group)
        plain.load_state_dict(layer.state_dict())
        assert not plain.blocked and torch.equal(plain.weight_int8, w8)
        torch.testing.assert_close(plain(x), y, rtol=1e-5, atol=1e-5)
    assert "blocked rows" in repr(layer)


@needs_blocked
@pytest.mark.parametrize("group", [None, 32])
def test_native_steps_on_blocked_rows_follow_eager_steps_on_rows_in_order(group):
    """A model wide enough for whole 512s (d 512, d_ff 1088): the native decode layer on blocked rows
    follows the eager steps of the same model (1e-4), and those follow the eager steps with every row put
    back in column order (the kernel's plain layout): the same numbers but for the fp32 order of the
    block sums, which may move an activation's int8 rounding by one step; the prompt's rows are rounded
    too, and such a step there reaches every later position through the attention (here up to 1.6e-2,
    median 3e-3 of states about 0.8 in size; a column in the wrong place would move them by their size);
    the tied embedding reads its blocked rows back in order."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, 512, 2, 4, 1088, n_kv_heads=2).eval()
    fast = quant.quantize(lm, weights="int8", kv=None, kernel="native", group_size=group)
    eager = copy.deepcopy(fast)
    eager.native_steps = False
    plain = copy.deepcopy(eager)
    for m in plain.modules():
        if isinstance(m, quant.Int8GemvLinear):
            assert m.blocked
            m.weight_int8, m.blocked = m.int8_weight, False  # buffers: a new tensor in column order
    plain.embed.weight_int8, plain.embed.blocked = plain.lm_head.weight_int8, False
    ids = torch.tensor([[3, 299, 17]])
    torch.testing.assert_close(fast.embed(ids), plain.embed(ids), rtol=0, atol=0)
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 300, (5,), generator=torch.Generator().manual_seed(3))
    hs = []
    with torch.no_grad():
        for model in (fast, eager, plain):
            cache = model.make_cache(1, 32)
            steps, model.native_steps = model.native_steps, False  # the prompt through the eager layers
            model.hidden_states(prompt, cache=cache)  # in all three (a native prompt: test_native_batch)
            model.native_steps = steps
            hs.append(torch.stack([model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]))
    torch.testing.assert_close(hs[0], hs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hs[1], hs[2], rtol=0, atol=3e-2)
    assert float((hs[1] - hs[2]).abs().median()) < 5e-3


@needs_native
@pytest.mark.parametrize("group", [None, 32, 64])
@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_embedding_row_from_one_native_call_equals_the_lookup(group, tied):
    """The decode step's embedding lookup (``native_row``): the same fp32 values as the module's forward,
    for a table of its own (one scale per row) and one tied to the head (its group scales, its layout:
    blocked where the kernel is AVX512-VNNI's; d 544 = a whole 512 and a tail)."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, 544, 1, 4, 64, n_kv_heads=2, tie_embeddings=tied).eval()
    q = quant.quantize(lm, weights="int8", kv=None, kernel="native", group_size=group)
    assert (q.embed.weight_int8 is q.lm_head.weight_int8) == tied
    assert q.embed.blocked == (tied and native_int8.reads_blocked())
    for i in (0, 7, 299):
        row = q.embed.native_row(i)
        assert row is not None and row.shape == (544,)
        assert torch.equal(row, q.embed(torch.tensor([i]))[0])
    with pytest.raises(IndexError, match="index 300 is out of range for an embedding of 300 rows"):
        q.embed.native_row(300)
    q.embed.dtype = torch.bfloat16  # another output dtype: the module's own lookup
    assert q.embed.native_row(7) is None
    q.embed.dtype = torch.float32
    q.embed.scale = q.embed.scale.half()  # scales cast after quantizing: not read as fp32
    assert q.embed.native_row(7) is None
