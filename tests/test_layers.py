"""TransformerLayer, Encoder, Decoder vs torch.nn.Transformer*Layer with copied weights; norms; KV cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.nn.layers import Decoder, Encoder, TransformerLayer
from multihead.nn.norms import RMSNorm, make_norm
from multihead.nn.positions import RotaryEmbedding
from tests.numerics import TOL, max_err

F64 = torch.float64
D_MODEL, HEADS, D_FF = 32, 4, 48


# -- copying torch weights ------------------------------------------------------------------------------
def _copy_linear(dst: nn.Linear, w, b) -> None:
    dst.weight.copy_(w)
    dst.bias.copy_(b)


def _copy_mha(dst, src: nn.MultiheadAttention) -> None:
    # torch's in_proj_weight is [W_Q; W_K; W_V]: exactly our fused qkv_proj layout
    _copy_linear(dst.qkv_proj, src.in_proj_weight, src.in_proj_bias)
    _copy_linear(dst.o_proj, src.out_proj.weight, src.out_proj.bias)


def _randomise_norms(t: nn.Module) -> None:
    """torch initialises LayerNorm to (1, 0); random values make a swapped norm mapping visible."""
    for m in t.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.normal_(1.0, 0.3)
            m.bias.normal_(0.0, 0.3)


@torch.no_grad()
def copy_from_torch(ours: TransformerLayer, t: nn.Module) -> None:
    """Map torch.nn.TransformerEncoderLayer / TransformerDecoderLayer parameters onto ours."""
    _randomise_norms(t)
    _copy_mha(ours.self_attn, t.self_attn)
    _copy_linear(ours.ffn.linear1, t.linear1.weight, t.linear1.bias)
    _copy_linear(ours.ffn.linear2, t.linear2.weight, t.linear2.bias)
    ours.attn_norm.load_state_dict(t.norm1.state_dict())
    if isinstance(t, nn.TransformerDecoderLayer):
        assert ours.cross_attn is not None and ours.cross_norm is not None
        _copy_mha(ours.cross_attn, t.multihead_attn)
        ours.cross_norm.load_state_dict(t.norm2.state_dict())
        ours.ffn_norm.load_state_dict(t.norm3.state_dict())
    else:
        ours.ffn_norm.load_state_dict(t.norm2.state_dict())


def _torch_kwargs(norm_first, activation):
    return dict(dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, dtype=F64)


def _grads_match(ours: TransformerLayer, t: nn.Module, x, xt) -> None:
    assert max_err(x.grad, xt.grad) <= TOL[F64]
    pairs = [
        (ours.self_attn.qkv_proj.weight, t.self_attn.in_proj_weight),
        (ours.self_attn.o_proj.bias, t.self_attn.out_proj.bias),
        (ours.ffn.linear1.weight, t.linear1.weight),
        (ours.attn_norm.weight, t.norm1.weight),
    ]
    for a, b in pairs:
        assert max_err(a.grad, b.grad) <= TOL[F64]


# -- parity with torch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_encoder_layer_matches_torch(norm_first, activation, masking):
    torch.manual_seed(0)
    t = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, **_torch_kwargs(norm_first, activation))
    ours = TransformerLayer(D_MODEL, HEADS, D_FF, norm_first=norm_first, activation=activation).double()
    copy_from_torch(ours, t)
    B, N = 3, 13
    x = torch.randn(B, N, D_MODEL, dtype=F64, requires_grad=True)
    xt = x.detach().clone().requires_grad_(True)
    pad = torch.zeros(B, N, dtype=torch.bool)  # torch convention: True = padding
    pad[1, 9:] = True
    pad[2, 4:] = True
    kw, ours_mask = {}, None
    if masking == "padding":
        kw, ours_mask = {"src_key_padding_mask": pad}, mh.key_padding(~pad)
    elif masking == "causal":
        square = nn.Transformer.generate_square_subsequent_mask(N, dtype=F64)
        kw, ours_mask = {"src_mask": square, "is_causal": True}, mh.causal()
    t.eval()
    ours.eval()
    out_t = t(xt, **kw)  # grad enabled, so torch takes its plain (not fast) path: all rows computed
    out = ours(x, mask=ours_mask)
    assert max_err(out, out_t) <= TOL[F64]
    r = torch.randn_like(out)
    (out * r).sum().backward()
    (out_t * r).sum().backward()
    _grads_match(ours, t, x, xt)
    ours.train()
    assert max_err(ours(x, mask=ours_mask), out_t) <= TOL[F64]  # dropout=0: train == eval


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(1)
    t = nn.TransformerDecoderLayer(D_MODEL, HEADS, D_FF, **_torch_kwargs(norm_first, "relu"))
    ours = TransformerLayer(D_MODEL, HEADS, D_FF, norm_first=norm_first, cross_attention=True).double()
    copy_from_torch(ours, t)
    B, N, M = 2, 9, 17
    x = torch.randn(B, N, D_MODEL, dtype=F64, requires_grad=True)
    xt = x.detach().clone().requires_grad_(True)
    mem = torch.randn(B, M, D_MODEL, dtype=F64)
    mem_pad = torch.zeros(B, M, dtype=torch.bool)
    mem_pad[0, 11:] = True
    square = nn.Transformer.generate_square_subsequent_mask(N, dtype=F64)
    out_t = t(xt, mem, tgt_mask=square, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    out = ours(x, memory=mem, mask=mh.causal(), memory_mask=mh.key_padding(~mem_pad))
    assert max_err(out, out_t) <= TOL[F64]
    r = torch.randn_like(out)
    (out * r).sum().backward()
    (out_t * r).sum().backward()
    _grads_match(ours, t, x, xt)
    assert max_err(ours.cross_attn.qkv_proj.weight.grad, t.multihead_attn.in_proj_weight.grad) <= TOL[F64]


def test_post_ln_layer_is_exactly_eq_9_38_to_9_43():
    torch.manual_seed(2)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF).double().eval()
    X = torch.randn(2, 7, D_MODEL, dtype=F64)
    T1 = layer.self_attn(X)  # (8)
    T2 = X + T1  # (9)
    T3 = layer.attn_norm(T2)  # (10)
    T4 = layer.ffn(T3)  # (11)
    T5 = T4 + T3  # (12)
    H = layer.ffn_norm(T5)  # (13)
    assert torch.equal(layer(X), H)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_matches_torch_encoder(norm_first):
    torch.manual_seed(3)
    t_layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, **_torch_kwargs(norm_first, "gelu"))
    final = nn.LayerNorm(D_MODEL, dtype=F64) if norm_first else None
    t = nn.TransformerEncoder(t_layer, 2, norm=final, enable_nested_tensor=False)
    ours = Encoder(2, D_MODEL, HEADS, D_FF, norm_first=norm_first, activation="gelu").double()
    assert isinstance(ours.final_norm, nn.LayerNorm if norm_first else nn.Identity)
    for o, tl in zip(ours.layers, t.layers):
        copy_from_torch(o, tl)
    if final is not None:
        with torch.no_grad():
            final.weight.normal_(1.0, 0.3)
        ours.final_norm.load_state_dict(final.state_dict())
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    assert max_err(ours(x, mask=mh.key_padding(~pad)), t(x, src_key_padding_mask=pad)) <= TOL[F64]


def test_decoder_stack_matches_torch_decoder():
    torch.manual_seed(4)
    t_layer = nn.TransformerDecoderLayer(D_MODEL, HEADS, D_FF, **_torch_kwargs(True, "relu"))
    final = nn.LayerNorm(D_MODEL, dtype=F64)
    t = nn.TransformerDecoder(t_layer, 2, norm=final)
    ours = Decoder(2, D_MODEL, HEADS, D_FF, norm_first=True).double()
    for o, tl in zip(ours.layers, t.layers):
        copy_from_torch(o, tl)
    ours.final_norm.load_state_dict(final.state_dict())
    x, mem = torch.randn(2, 8, D_MODEL, dtype=F64), torch.randn(2, 5, D_MODEL, dtype=F64)
    square = nn.Transformer.generate_square_subsequent_mask(8, dtype=F64)
    ref = t(x, mem, tgt_mask=square, tgt_is_causal=True)
    assert max_err(ours(x, mem), ref) <= TOL[F64]  # mask defaults to mh.causal()
    assert max_err(ours(x, mem, mask=None), t(x, mem)) <= TOL[F64]


def test_pre_ln_rmsnorm_swiglu_layer_is_the_llama_block():
    torch.manual_seed(5)
    layer = TransformerLayer(
        D_MODEL, HEADS, D_FF, n_kv_heads=2, norm="rmsnorm", norm_first=True, activation="swiglu", bias=False
    ).double()
    assert isinstance(layer.attn_norm, RMSNorm)
    x = torch.randn(2, 6, D_MODEL, dtype=F64)
    h = x + layer.self_attn(layer.attn_norm(x), mask=mh.causal())
    ref = h + layer.ffn(layer.ffn_norm(h))
    assert torch.equal(layer(x, mask=mh.causal()), ref)


# -- norms ---------------------------------------------------------------------------------------------
def test_rmsnorm_matches_formula_and_torch():
    n = RMSNorm(16, eps=1e-6, dtype=F64)
    with torch.no_grad():
        n.weight.normal_()
    x = torch.randn(3, 5, 16, dtype=F64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight
    assert max_err(n(x), ref) <= TOL[F64]
    t = nn.RMSNorm(16, eps=1e-6, dtype=F64)
    t.load_state_dict(n.state_dict())
    assert max_err(n(x), t(x)) <= TOL[F64]


def test_rmsnorm_keeps_low_precision_statistics_in_fp32():
    n = RMSNorm(64, dtype=torch.bfloat16)
    x = torch.randn(4, 64) * 30
    out = n(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert max_err(out, RMSNorm(64)(x)) <= TOL[torch.bfloat16] * 4  # one bf16 rounding of O(1) values


def test_make_norm():
    assert isinstance(make_norm("layernorm", 8), nn.LayerNorm)
    assert isinstance(make_norm("rmsnorm", 8, 1e-6), RMSNorm)
    with pytest.raises(ValueError, match=r"norm must be one of \['layernorm', 'rmsnorm'\], got 'batchnorm'"):
        make_norm("batchnorm", 8)


# -- KV cache --------------------------------------------------------------------------------------------
def _cached_run(run, x, caches_reset, first):
    """Run ``run`` on a prefill of ``first`` tokens, then one token at a time; concatenate."""
    caches_reset()
    parts = [run(x[:, :first])]
    parts += [run(x[:, t : t + 1]) for t in range(first, x.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize(
    "kind,norm_first,n_kv", [("dense", True, 2), ("dense", False, 4), ("int8", True, 1), ("sliding", True, 2)]
)
def test_layer_cache_prefill_then_steps_equals_full_forward(kind, norm_first, n_kv):
    from multihead.nn.kv_cache import KVCache

    torch.manual_seed(6)
    layer = TransformerLayer(
        D_MODEL, HEADS, D_FF, n_kv_heads=n_kv, norm="rmsnorm", norm_first=norm_first,
        activation="swiglu", rotary=RotaryEmbedding(D_MODEL // HEADS),
    ).double()  # fmt: skip
    W = 4
    mask = mh.sliding_window(W) if kind == "sliding" else mh.causal()
    x = torch.randn(2, 12, D_MODEL, dtype=F64)
    full = layer(x, mask=mask)
    cache = KVCache(
        2, n_kv, D_MODEL // HEADS, 16, kind=kind, window=W if kind == "sliding" else None, dtype=F64
    )
    with torch.no_grad():
        got = _cached_run(lambda xs: layer(xs, mask=mask, cache=cache), x, cache.reset, 5)
    err = max_err(got, full)
    if kind == "int8":
        # per-token int8 K/V: each entry off by <= absmax / 254 (0.4%); the layer keeps that O(1)
        assert 0 < err <= 0.02 * full.abs().max().item()
    else:
        assert err <= TOL[F64]


def test_decoder_with_caches_equals_full_forward():
    from multihead.nn.kv_cache import KVCache

    torch.manual_seed(7)
    dec = Decoder(2, D_MODEL, HEADS, D_FF, norm_first=True, rotary=RotaryEmbedding(D_MODEL // HEADS)).double()
    x, mem = torch.randn(1, 9, D_MODEL, dtype=F64), torch.randn(1, 6, D_MODEL, dtype=F64)
    full = dec(x, mem)
    caches = [KVCache(1, HEADS, D_MODEL // HEADS, 9, dtype=F64) for _ in range(2)]
    with torch.no_grad():
        got = _cached_run(lambda xs: dec(xs, mem, caches=caches), x, lambda: None, 4)
    assert max_err(got, full) <= TOL[F64]


# -- dropout and validation -----------------------------------------------------------------------------
def test_dropout_is_stochastic_in_training_and_off_in_eval():
    torch.manual_seed(8)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, dropout=0.2, cross_attention=True)
    x, mem = torch.randn(2, 5, D_MODEL), torch.randn(2, 3, D_MODEL)
    layer.train()
    assert not torch.equal(layer(x, memory=mem), layer(x, memory=mem))
    layer.eval()
    assert torch.equal(layer(x, memory=mem), layer(x, memory=mem))


def test_bad_arguments_raise():
    layer = TransformerLayer(D_MODEL, HEADS, D_FF)
    x = torch.randn(1, 4, D_MODEL)
    with pytest.raises(ValueError, match="memory must be given exactly when the layer has cross-attention"):
        layer(x, memory=x)
    with pytest.raises(ValueError, match="cross_attention=True and memory=None"):
        TransformerLayer(D_MODEL, HEADS, D_FF, cross_attention=True)(x)
    with pytest.raises(ValueError, match="memory_mask was given without memory"):
        layer(x, memory_mask=mh.causal())
    with pytest.raises(ValueError, match=r"x has width 8 but the module was built with d_model=32"):
        layer(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match=r"norm must be one of \['layernorm', 'rmsnorm'\], got 'rms'"):
        TransformerLayer(D_MODEL, HEADS, D_FF, norm="rms")
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        TransformerLayer(D_MODEL, HEADS, D_FF, n_kv_heads=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerLayer(D_MODEL, HEADS, D_FF, activation="swish")
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\)"):
        TransformerLayer(D_MODEL, HEADS, D_FF, dropout=1.0)
    with pytest.raises(ValueError, match="n_layers must be an int >= 1, got 0"):
        Encoder(0, D_MODEL, HEADS, D_FF)
    with pytest.raises(ValueError, match="Encoder layers have no cross-attention"):
        Encoder(1, D_MODEL, HEADS, D_FF, cross_attention=True)
    with pytest.raises(ValueError, match="Decoder layers always have cross-attention"):
        Decoder(1, D_MODEL, HEADS, D_FF, cross_attention=False)
    with pytest.raises(ValueError, match="caches has 1 entries but the decoder has 2 layers"):
        Decoder(2, D_MODEL, HEADS, D_FF)(x, x, caches=[None])
    with pytest.raises(TypeError, match="norm_frist"):  # a misspelled option is not swallowed
        Encoder(1, D_MODEL, HEADS, D_FF, norm_frist=True)


def test_final_norm_defaults_and_override():
    assert isinstance(Encoder(1, D_MODEL, HEADS, D_FF).final_norm, nn.Identity)
    assert isinstance(Encoder(1, D_MODEL, HEADS, D_FF, norm_first=True).final_norm, nn.LayerNorm)
    enc = Encoder(1, D_MODEL, HEADS, D_FF, final_norm=True, norm="rmsnorm")
    assert isinstance(enc.final_norm, RMSNorm)
    assert isinstance(
        Decoder(1, D_MODEL, HEADS, D_FF, norm_first=True, final_norm=False).final_norm, nn.Identity
    )
