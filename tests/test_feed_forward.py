"""FeedForward (eq. (11)): each activation against its formula, SwiGLU names, dropout, validation."""

from __future__ import annotations

import math

import pytest
import torch

from multihead.nn.feed_forward import ACTIVATIONS, FeedForward
from tests.numerics import TOL, max_err

F64 = torch.float64


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


FORMULAS = {
    "relu": lambda x: x.clamp(min=0),
    "gelu": _gelu_erf,
    "gelu_tanh": _gelu_tanh,
    "silu": lambda x: x * torch.sigmoid(x),
}


@pytest.mark.parametrize("activation", list(FORMULAS))
@pytest.mark.parametrize("bias", [True, False])
def test_plain_ffn_is_w2_act_w1(activation, bias):
    f = FeedForward(24, 56, activation=activation, bias=bias, dtype=F64)
    x = torch.randn(2, 7, 24, dtype=F64)
    h = x @ f.linear1.weight.T + (f.linear1.bias if bias else 0)
    ref = FORMULAS[activation](h) @ f.linear2.weight.T + (f.linear2.bias if bias else 0)
    assert max_err(f(x), ref) <= TOL[F64]


def test_swiglu_is_llama_w2_silu_w1_times_w3():
    f = FeedForward(24, 40, activation="swiglu", bias=False, dtype=F64)
    assert {n for n, _ in f.named_parameters()} == {"w1.weight", "w2.weight", "w3.weight"}
    x = torch.randn(3, 5, 24, dtype=F64)
    g = x @ f.w1.weight.T
    ref = (g * torch.sigmoid(g) * (x @ f.w3.weight.T)) @ f.w2.weight.T
    assert max_err(f(x), ref) <= TOL[F64]


def test_plain_ffn_parameter_names_match_torch_encoder_layer():
    f = FeedForward(16, 32)
    names = {n for n, _ in f.named_parameters()}
    assert names == {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}
    t = torch.nn.TransformerEncoderLayer(16, 2, 32)
    assert names <= {n for n, _ in t.named_parameters()}


def test_any_leading_shape_works_row_by_row():
    f = FeedForward(8, 16, activation="gelu", dtype=F64)
    x = torch.randn(2, 3, 4, 8, dtype=F64)
    assert max_err(f(x)[1, 2], f(x[1, 2])) <= TOL[F64]


def test_dropout_is_stochastic_in_training_and_off_in_eval():
    torch.manual_seed(0)
    f = FeedForward(16, 64, dropout=0.3)
    x = torch.randn(4, 16)
    f.train()
    assert not torch.equal(f(x), f(x))
    f.eval()
    assert torch.equal(f(x), f(x))
    plain = FeedForward(16, 64)
    plain.load_state_dict(f.state_dict())
    assert max_err(f(x), plain(x)) <= TOL[torch.float32]


def test_bad_arguments_raise():
    with pytest.raises(
        ValueError, match=r"one of \['relu', 'gelu', 'gelu_tanh', 'silu', 'swiglu'\], got 'tanh'"
    ):
        FeedForward(8, 16, activation="tanh")
    assert ACTIVATIONS == ("relu", "gelu", "gelu_tanh", "silu", "swiglu")
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\), got 1.5"):
        FeedForward(8, 16, dropout=1.5)
    with pytest.raises(ValueError, match="d_ff must be an int >= 1, got 0"):
        FeedForward(8, 0)
    with pytest.raises(ValueError, match=r"last dim d_model=8, got shape \(2, 7\)"):
        FeedForward(8, 16)(torch.randn(2, 7))
