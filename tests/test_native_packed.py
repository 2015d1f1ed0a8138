"""Packed int8 rows (each 512 blocked weights followed by their 16 scales, one buffer a module): the same
numbers as the rows and scales kept apart, bit for bit, in every kernel (one row, several rows, the
decode layers one thread and a team, the greedy runs' head), and the same state dict."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import quant
from multihead.models.int8_gemv_linear import Int8GemvLinear
from multihead.native import int8 as native_int8
from multihead.native import layout
from tests.native_counts import count_native_steps

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
BLOCKED = pytest.mark.skipif(
    REASON is not None or not native_int8.reads_blocked(),
    reason=f"packed rows are the AVX512-VNNI kernel's ({native_int8.isa()} here)",
)
WIDTHS = [33, 64, 200, 512, 1000, 1088, 2816]  # tails only, one chunk, chunks and tails (masked, whole)


@pytest.mark.parametrize("cols", WIDTHS)
def test_packed_rows_round_trip_and_their_bytes(cols):
    g = torch.Generator().manual_seed(cols)
    w = torch.randint(-127, 128, (5, cols), generator=g, dtype=torch.int8)  # (O, I)
    s = torch.rand(5, -(-cols // 32), generator=g)  # (O, Gr)
    rows = layout.to_packed(w, s)  # (O, R)
    assert rows.shape == (5, layout.packed_row_bytes(cols)) and rows.shape[1] % 64 == 0
    back_w, back_s = layout.from_packed(rows, cols)
    assert torch.equal(back_w, w) and torch.equal(back_s, s)
    lib = native.library()
    assert lib.mh_q8_row_bytes(cols, native_int8.PACKED) == rows.shape[1]  # the kernels' row stride
    assert lib.mh_q8_row_bytes(cols, native_int8.BLOCKED) == cols
    if cols >= 512:  # chunk 0: its 512 weights, then their 16 scales
        assert torch.equal(rows[:, :512], w[:, :512]) and torch.equal(
            rows[:, 512:576].view(torch.float32), s[:, :16]
        )


def test_packing_refuses_other_shapes():
    w, s = torch.zeros(3, 64, dtype=torch.int8), torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"to_packed needs int8 rows \(O, I\) and fp32 scales"):
        layout.to_packed(w, torch.zeros(3, 1))
    with pytest.raises(ValueError, match="to_packed needs"):
        layout.to_packed(w.float(), s)
    with pytest.raises(ValueError, match=r"from_packed needs int8 rows \(O, 128\) for 64 columns"):
        layout.from_packed(torch.zeros(3, 64, dtype=torch.int8), 64)


@BLOCKED
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize(
    "rows", [1, 7, 600]
)  # one row, an odd count (its middle row paired with itself), two threads' work
def test_packed_rows_give_the_bits_of_blocked_rows(rows, cols):
    lib = native.library()
    g = torch.Generator().manual_seed(rows * cols)
    w = layout.to_blocked(torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8))  # (O, I)
    s = torch.rand(rows, -(-cols // 32), generator=g) + 0.5  # (O, Gr)
    b = torch.randn(rows, generator=g)  # (O,)
    packed = layout.to_packed(w, s)  # (O, R)
    x = torch.randn(cols, generator=g)  # (I,)
    want = native_int8.run_q8(lib, w, s, x, b, 32, native_int8.BLOCKED)
    assert torch.equal(native_int8.run_q8(lib, packed, packed, x, b, 32, native_int8.PACKED), want)
    xs = torch.randn(9, cols, generator=g)  # (N, I): four at a time twice, then one
    want_rows = native_int8.run_gemm_q8(lib, w, s, xs, None, 32, native_int8.BLOCKED)
    assert torch.equal(
        native_int8.run_gemm_q8(lib, packed, packed, xs, None, 32, native_int8.PACKED), want_rows
    )
    out, ref = torch.empty(cols), layout.from_blocked(w).float() * s.repeat_interleave(32, 1)[:, :cols]
    for o in {0, rows // 2, rows - 1}:  # a packed row read back in column order
        lib.mh_dequantize_row_q8(packed[o].data_ptr(), None, cols, 32, native_int8.PACKED, out.data_ptr())
        assert torch.equal(out, ref[o])


@BLOCKED
def test_the_kernels_refuse_packed_rows_they_cannot_read():
    lib = native.library()
    y, x = torch.empty(4), torch.zeros(64)
    xq, xs = native_int8.quantize_activations(x)
    rows = torch.zeros(4, 192, dtype=torch.int8)
    for G, cols in ((64, 64), (32, 32)):  # groups of 64; a row of one group (its scale per row)
        args = (xq.data_ptr(), xs.data_ptr(), None, y.data_ptr(), 4, cols, 192, G, native_int8.PACKED)
        assert lib.mh_gemv_q8(rows.data_ptr(), rows.data_ptr(), *args) == -2
        assert (
            lib.mh_gemm_q8(
                rows.data_ptr(), rows.data_ptr(), x.data_ptr(), None, y.data_ptr(), 1, 4, cols, 192, G, 2
            )
            == -2
        )


@BLOCKED
def test_a_packed_module_has_the_outputs_and_state_of_one_with_its_scales_apart():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1088, 70)
    packed, apart = Int8GemvLinear(linear, 32, packed=True), Int8GemvLinear(linear, 32)
    assert packed.packed and not apart.packed and list(packed._buffers) == ["rows_q8", "bias"]
    assert "with their scales" in repr(packed)
    x = torch.randn(5, 1088)  # (N, I)
    with torch.no_grad():
        assert torch.equal(packed(x), apart(x)) and torch.equal(packed(x[:1]), apart(x[:1]))
    assert torch.equal(packed.weight_int8, apart.weight_int8) and torch.equal(packed.scale, apart.scale)
    assert torch.equal(packed.dequantized(), apart.dequantized())
    state, want = packed.state_dict(), apart.state_dict()
    assert list(state) == list(want) == ["weight_int8", "scale", "bias"]
    assert all(torch.equal(state[k], want[k]) for k in want)  # in column order, whatever the layout
    other = Int8GemvLinear(torch.nn.Linear(1088, 70), 32, packed=True)
    other.load_state_dict(want)  # an unpacked module's state into packed rows
    with torch.no_grad():
        assert torch.equal(other(x), apart(x))
    packed.set_packed(False)
    assert list(packed._buffers) == ["weight_int8", "scale", "bias"] and torch.equal(
        packed.weight_int8, apart.weight_int8
    )
    with pytest.raises(ValueError, match="groups of 32"):
        Int8GemvLinear(linear, 64, packed=True)
    assert Int8GemvLinear(torch.nn.Linear(64, 8), 32).packs_well is False  # 78% of padding
    assert Int8GemvLinear(torch.nn.Linear(1024, 8), 32).packs_well is True


def _lm(d=512, d_ff=1024, tied=False):
    """Widths whose packed rows cost no padding (512, 1024): quantize packs every int8 linear."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, d, 2, 4, d_ff, n_kv_heads=2, norm_eps=1e-6, tie_embeddings=tied).eval()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, mh.nn.norms.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return lm


def _apart(model):
    """A copy with every int8 linear's scales kept apart (the same numbers)."""
    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, Int8GemvLinear):
            m.set_packed(False)
    return out


@BLOCKED
@pytest.mark.parametrize("threads", [1, 2])
def test_a_packed_model_decodes_with_the_bits_of_its_rows_apart(threads, monkeypatch):
    """One row (one thread; two: the decode step's team), a batch of rows, a prompt and greedy runs."""
    model = quant.quantize(_lm(), weights="int8", kv="int8", kernel="native", group_size=32)
    linears = [m for m in model.modules() if isinstance(m, Int8GemvLinear)]
    assert linears and all(m.packed for m in linears)
    apart = _apart(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = count_native_steps(monkeypatch)
        prompt = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))  # (1, P)
        with torch.inference_mode():
            got, want = model.generate(prompt, 9), apart.generate(prompt, 9)
            assert torch.equal(got, want) and len(calls) == 2 * 8  # every step native, both models
            batch = torch.randint(0, 300, (3, 5), generator=torch.Generator().manual_seed(2))  # (B, T)
            caches = [m.make_cache(3, 16, "int8") for m in (model, apart)]
            hs = [m.hidden_states(batch[:, :4], cache=c) for m, c in zip((model, apart), caches)]  # prompts
            assert torch.equal(hs[0], hs[1])
            steps = [
                m.hidden_states(batch[:, 4:], cache=c) for m, c in zip((model, apart), caches)
            ]  # (B, 1, d)
            assert torch.equal(steps[0], steps[1])
            for a, b in zip(*caches):
                assert torch.equal(a.k, b.k) and torch.equal(a.k_scale, b.k_scale)
    finally:
        torch.set_num_threads(before)


@BLOCKED
def test_a_tied_head_keeps_its_scales_apart_and_shares_its_table():
    model = quant.quantize(_lm(tied=True), weights="int8", kv="int8", kernel="native", group_size=32)
    assert not model.lm_head.packed and model.embed.weight_int8 is model.lm_head.weight_int8
    assert all(m.packed for m in model.layers.modules() if isinstance(m, Int8GemvLinear))
    prompt = torch.tensor([[5, 17, 260]])
    with torch.inference_mode():
        assert torch.equal(model.generate(prompt, 6), _apart(model).generate(prompt, 6))


def test_a_copy_of_a_quantized_model_made_before_its_first_step_steps_natively(monkeypatch):
    """copy.deepcopy and pickle keep the "not yet checked" mark of a fresh quantized model (a copy once
    carried another object there and never ran natively)."""
    import io

    model = quant.quantize(_lm(d=128, d_ff=256), weights="int8", kv="int8", kernel="native", group_size=32)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    calls = count_native_steps(monkeypatch)
    prompt = torch.tensor([[5, 17, 260]])
    with torch.inference_mode():
        want = model.generate(prompt, 5)
        for other in copies:
            assert torch.equal(other.generate(prompt, 5), want)
    assert len(calls) == 3 * 4  # every decode step of all three native


@BLOCKED
def test_linears_of_one_layer_in_two_layouts_run_the_eager_layers(monkeypatch):
    model = quant.quantize(_lm(), weights="int8", kv="int8", kernel="native", group_size=32)
    prompt = torch.tensor([[5, 17, 260]])
    with torch.inference_mode():
        want = model.generate(prompt, 3)  # natively, one layout
        model.layers[1].ffn.w2.set_packed(False)  # the next generation checks the structure again
        assert model.why_not_native_steps == "layer 1's w2 has blocked int8 rows, another projection packed"
        calls = count_native_steps(monkeypatch)
        assert torch.equal(model.generate(prompt, 3), want)  # the same values, through the eager layers
    assert calls == []
