"""Position encodings: the sinusoidal table (seed 003 §3.3.1), learned tables, rotary (both pairings)."""

from __future__ import annotations

import math

import pytest
import torch

from multihead.nn.positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions, sinusoidal_table
from tests.numerics import TOL, max_err

F64 = torch.float64


# -- sinusoidal -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d_model", [1, 4, 7, 16])
def test_sinusoidal_table_is_the_closed_form(d_model):
    max_len = 13
    table = SinusoidalPositions(d_model, max_len, dtype=F64).table
    want = torch.empty(max_len, d_model, dtype=F64)
    for pos in range(max_len):
        for col in range(d_model):
            angle = pos / 10000 ** ((col - col % 2) / d_model)  # 2i = col rounded down to even
            want[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    assert table.shape == (max_len, d_model)
    assert max_err(table, want) <= TOL[F64]


def test_sinusoidal_hand_values_and_odd_width():
    # d = 4: the second pair's frequency is 1 / 10000^(2/4) = 1/100.
    row = SinusoidalPositions(4, 2, dtype=F64).table[1]
    want = torch.tensor([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)], dtype=F64)
    assert max_err(row, want) <= TOL[F64]
    # d = 5: the last column (index 4 = 2i with i = 2) is a sine at frequency 10000^(-4/5).
    t = SinusoidalPositions(5, 4, dtype=F64).table
    assert max_err(t[3, 4], torch.tensor(math.sin(3 * 10000 ** (-4 / 5)))) <= TOL[F64]
    assert torch.equal(t[0], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0], dtype=F64))


def test_sinusoidal_lookup_shapes_dtype_and_buffer():
    pe = SinusoidalPositions(6, 20)
    assert pe.table.dtype == torch.get_default_dtype()
    assert torch.equal(pe.table, sinusoidal_table(20, 6).to(pe.table.dtype))
    pos = torch.tensor([3, 0, 19])
    assert torch.equal(pe(pos), pe.table[pos])  # (N, d)
    batch = torch.tensor([[1, 2], [5, 7]])
    assert pe(batch).shape == (2, 2, 6) and torch.equal(pe(batch)[1, 1], pe.table[7])
    assert pe.state_dict() == {}  # derived: not part of a checkpoint
    assert pe.to(F64).table.dtype == F64


@pytest.mark.parametrize("cls", [SinusoidalPositions, LearnedPositions])
def test_table_lookup_errors(cls):
    pe = cls(8, 8)  # square, so the argument order does not matter here
    with pytest.raises(ValueError, match=r"max_len=8.*maximum of 8.*max_len >= 9"):
        pe(torch.arange(9))
    with pytest.raises(ValueError, match=r">= 0.*minimum of -1"):
        pe(torch.tensor([0, -1]))
    with pytest.raises(ValueError, match=r"integer tensor.*float32.*long\(\)"):
        pe(torch.arange(3.0))
    with pytest.raises(ValueError, match=r"\(N,\) or \(B, N\).*3 dims"):
        pe(torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"max_len must be an int >= 1, got 0"):
        cls(max_len=0, d_model=8)
    assert pe(torch.zeros(0, dtype=torch.long)).shape == (0, 8)


def test_learned_positions_lookup_and_grad():
    pe = LearnedPositions(10, 4)
    assert pe.table is pe.weight and pe.weight.shape == (10, 4)
    assert list(pe.state_dict()) == ["weight"]
    pos = torch.tensor([[1, 9, 9]])
    out = pe(pos)  # (1, 3, 4)
    assert out.shape == (1, 3, 4) and torch.equal(out[0, 1], pe.weight[9])
    out.sum().backward()
    assert pe.weight.grad is not None
    assert torch.equal(pe.weight.grad[9], torch.full((4,), 2.0)) and pe.weight.grad[0].abs().sum() == 0


# -- rotary -----------------------------------------------------------------------------------------------
def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """Independent float64 rotary: pairs as complex numbers times exp(i * pos * base^(-2i/D))."""
    D = x.shape[-1]
    theta = torch.tensor([base ** (-2 * i / D) for i in range(D // 2)], dtype=F64)
    rot = torch.polar(torch.ones(1, dtype=F64), positions.double()[..., None] * theta)  # (.., N, D/2)
    if positions.dim() == 2:
        rot = rot[:, None]  # (B, 1, N, D/2)
    xd = x.double()
    if interleaved:
        z = torch.view_as_complex(xd.reshape(*x.shape[:-1], D // 2, 2).contiguous())
        return torch.view_as_real(z * rot).reshape(x.shape)
    z = torch.complex(xd[..., : D // 2], xd[..., D // 2 :])
    out = z * rot
    return torch.cat((out.real, out.imag), dim=-1)


def interleave_features(y: torch.Tensor) -> torch.Tensor:
    """Per-head feature permutation j * D/2 + i -> 2i + j (what permute_for_interleaved does to rows)."""
    D = y.shape[-1]
    return y.unflatten(-1, (2, D // 2)).transpose(-1, -2).flatten(-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "base"), [(2, 10000.0), (64, 10000.0), (58, 500000.0)])
def test_rotary_matches_complex_reference(interleaved, head_dim, base):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, head_dim, dtype=F64)
    rope = RotaryEmbedding(head_dim, base=base, interleaved=interleaved)
    pos = torch.arange(11) + 5
    assert max_err(rope(x, pos), complex_rope(x, pos, base, interleaved)) <= TOL[F64]
    per_batch = torch.stack([torch.arange(11), torch.arange(11) * 3 + 100])  # (B, N)
    assert max_err(rope(x, per_batch), complex_rope(x, per_batch, base, interleaved)) <= TOL[F64]
    x32 = x.float()
    out32 = rope(x32, pos)
    assert out32.dtype == torch.float32
    assert max_err(out32, complex_rope(x32, pos, base, interleaved)) <= TOL[torch.float32]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_preserves_norms_and_position_zero(interleaved):
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, interleaved=interleaved)
    x = torch.randn(1, 2, 9, 16, dtype=F64)
    out = rope(x, torch.arange(9) * 37)
    assert max_err(out.norm(dim=-1), x.norm(dim=-1)) <= TOL[F64]
    assert max_err(rope(x, torch.zeros(9, dtype=torch.long)), x) == 0.0


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_scores_depend_only_on_position_difference(interleaved):
    torch.manual_seed(2)
    rope = RotaryEmbedding(32, interleaved=interleaved)
    q = torch.randn(1, 1, 1, 32, dtype=F64).expand(1, 1, 6, 32)
    k = torch.randn(1, 1, 1, 32, dtype=F64).expand(1, 1, 6, 32)
    m = torch.tensor([3, 10, 50, 0, 7, 1000])
    n = torch.tensor([1, 10, 60, 5, 0, 999])
    shift = 1234
    s = (rope(q, m) * rope(k, n)).sum(-1)  # (1, 1, 6) scores at positions (m, n)
    s_shift = (rope(q, m + shift) * rope(k, n + shift)).sum(-1)
    assert max_err(s, s_shift) <= TOL[F64]
    assert (s[0, 0, 0] - s[0, 0, 1]).abs() > 1e-3  # a different offset gives a different score


def test_rotary_low_precision_computes_in_float32():
    torch.manual_seed(3)
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 2, 5, 8).bfloat16()
    pos = torch.arange(5) + 300
    out = rope(x, pos)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rope(x.float(), pos).bfloat16())  # one rounding, at the end


def test_rotary_weight_permutation_relates_the_two_pairings():
    torch.manual_seed(4)
    H, D, d_in, N = 3, 8, 10, 7
    w = torch.randn(H * D, d_in, dtype=F64)
    b = torch.randn(H * D, dtype=F64)
    x = torch.randn(2, N, d_in, dtype=F64)
    pos = torch.arange(N) + 2

    def rotated(weight, bias, interleaved):
        y = (x @ weight.T + bias).view(2, N, H, D).transpose(1, 2)  # (B, H, N, D)
        return RotaryEmbedding(D, interleaved=interleaved)(y, pos)

    w_meta = RotaryEmbedding.permute_for_interleaved(w, H)
    b_meta = RotaryEmbedding.permute_for_interleaved(b, H)
    q_hf, q_meta = rotated(w, b, False), rotated(w_meta, b_meta, True)
    assert max_err(q_meta, interleave_features(q_hf)) <= TOL[F64]
    assert max_err(q_meta @ q_meta.transpose(-1, -2), q_hf @ q_hf.transpose(-1, -2)) <= TOL[F64]
    # the inverse is transformers' convert_llama_weights_to_hf.py `permute`
    hf_permute = w_meta.view(H, D // 2, 2, d_in).transpose(1, 2).reshape(H * D, d_in)
    assert torch.equal(RotaryEmbedding.permute_for_half_split(w_meta, H), hf_permute)
    assert torch.equal(hf_permute, w)
    with pytest.raises(ValueError, match=r"n_heads=5.*even head dim"):
        RotaryEmbedding.permute_for_interleaved(w, 5)


def test_rotary_errors():
    with pytest.raises(ValueError, match=r"even int.*got 7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match=r"base must be a finite number > 0, got 0"):
        RotaryEmbedding(8, base=0)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"head_dim=8 but x has D=6"):
        rope(torch.randn(1, 1, 3, 6), torch.arange(3))
    with pytest.raises(ValueError, match=r"\(B, H, N, D\).*transpose"):
        rope(torch.randn(3, 8), torch.arange(3))
    with pytest.raises(ValueError, match=r"do not fit.*\(N,\) = \(3,\)"):
        rope(torch.randn(1, 1, 3, 8), torch.arange(4))
    with pytest.raises(ValueError, match=r"do not fit.*\(B, N\) = \(2, 3\)"):
        rope(torch.randn(2, 1, 3, 8), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer tensor.*long\(\)"):
        rope(torch.randn(1, 1, 3, 8), torch.arange(3.0))


def test_rotary_matches_transformers_llama():
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    except ImportError:
        pytest.skip(
            "transformers is not installed (pip install -e '.[oracles]'); HF rotary parity not checked"
        )
    torch.manual_seed(5)
    H, D, N = 4, 16, 9
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H)
    q, k = torch.randn(2, H, N, D), torch.randn(2, H, N, D)
    position_ids = torch.stack([torch.arange(N), torch.arange(N) + 40])  # (B, N)
    cos, sin = LlamaRotaryEmbedding(config=config)(q, position_ids)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryEmbedding(D, base=10000.0)
    assert max_err(rope(q, position_ids), q_hf) <= TOL[torch.float32]
    assert max_err(rope(k, position_ids), k_hf) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotate_pair_equals_forward_and_regrows_its_table(dtype):
    """rotate_pair (one cos/sin for q and k, a cached table) gives forward's values bit for bit."""
    rot = RotaryEmbedding(16)
    q, k = torch.randn(2, 4, 3, 16).to(dtype), torch.randn(2, 2, 3, 16).to(dtype)
    for start in (0, 5, 300, 1000):  # 300 and 1000 grow the table past its first size
        pos = torch.arange(start, start + 3)
        q2, k2 = rot.rotate_pair(q, k, start=start)
        assert torch.equal(q2, rot(q, pos)) and torch.equal(k2, rot(k, pos))
    pos_b = torch.tensor([[0, 1, 2], [7, 8, 9]])
    q3, k3 = rot.rotate_pair(q, k, pos_b)
    assert torch.equal(q3, rot(q, pos_b)) and torch.equal(k3, rot(k, pos_b))
    assert "_tables" not in str(rot.state_dict().keys())
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        rot.rotate_pair(q, k, start=-1)
