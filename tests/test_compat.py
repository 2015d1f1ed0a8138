"""``multihead.compat.MultiheadAttention`` against ``torch.nn.MultiheadAttention`` with the same weights.

Every parity test builds torch's module, perturbs all its parameters (torch zero-initialises the biases,
which would hide bias bugs), loads its state_dict into ours, and compares outputs, weights and gradients
with the fixed tolerance TOL of tests/numerics.py. Fully masked rows are tested on their own: torch gives
NaN there in some paths, we give zeros (documented in the module docstring).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from multihead.nn.compat import MultiheadAttention
from tests.numerics import TOL

# torch warns (deprecation) when a bool and a float mask are mixed; we accept the mix silently.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")

E, H = 8, 2  # embed_dim, num_heads (head dim 4)
B, L, S = 3, 5, 7  # batch, target length, source length

CONFIGS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "no_bias": {"bias": False},
    "kdim_vdim": {"kdim": 5, "vdim": 6},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "all": {"add_bias_kv": True, "add_zero_attn": True, "batch_first": True, "kdim": 6, "vdim": 3},
}
MASKS = [
    "none",
    "kpm_bool",
    "kpm_float",
    "attn2d_bool",
    "attn2d_float",
    "attn3d_bool",
    "attn3d_float",
    "both_bool",
    "kpm_bool_attn_float",
]
DTYPES = [torch.float32, torch.float64]
WEIGHT_MODES = [(True, True), (True, False), (False, True)]  # (need_weights, average_attn_weights)


def make_pair(dtype: torch.dtype = torch.float32, **kw) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = MultiheadAttention(E, H, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def make_inputs(
    m: MultiheadAttention, dtype: torch.dtype, *, batched: bool = True, self_attn: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """query, key, value in the module's layout; self-attention passes one tensor three times."""
    torch.manual_seed(1)

    def shape(n: int, d: int) -> tuple[int, ...]:
        if not batched:
            return (n, d)
        return (B, n, d) if m.batch_first else (n, B, d)

    q = torch.randn(shape(L, E), dtype=dtype)
    if self_attn:
        return q, q, q
    return q, torch.randn(shape(S, m.kdim), dtype=dtype), torch.randn(shape(S, m.vdim), dtype=dtype)


def make_masks(kind: str, dtype: torch.dtype, *, batched: bool = True, n: int = S) -> dict[str, Tensor]:
    """torch-convention masks (bool True = NOT allowed) that leave key 0 visible to every query row."""
    torch.manual_seed(2)
    nb = B if batched else 1
    kpm_shape = (nb, n) if batched else (n,)
    out: dict[str, Tensor] = {}
    if kind.startswith("kpm_bool"):
        kpm = torch.rand(kpm_shape) < 0.4
        kpm[..., 0] = False
        out["key_padding_mask"] = kpm
    if kind == "kpm_float":
        kpm_f = torch.randn(kpm_shape, dtype=dtype)
        kpm_f[..., 1] = float("-inf")
        out["key_padding_mask"] = kpm_f
    if kind.startswith("attn") or kind in ("both_bool", "kpm_bool_attn_float"):
        shape = (nb * H, L, n) if kind.startswith("attn3d") else (L, n)
        if kind.endswith("bool"):
            am = torch.rand(shape) < 0.4
            am[..., 0] = False
        else:
            am = torch.randn(shape, dtype=dtype)
            am[..., 2] = float("-inf")
        out["attn_mask"] = am
    return out


def assert_close(ours, ref, dtype: torch.dtype) -> None:
    if ref is None:
        assert ours is None
        return
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, atol=TOL[dtype], rtol=0)


def both(ref, ours, args, **kw):
    return ref(*args, **kw), ours(*args, **kw)


# -- parameters and state_dict -------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_state_dict_keys_shapes_and_init_match_torch(cfg):
    torch.manual_seed(123)
    ref = nn.MultiheadAttention(E, H, **cfg)
    torch.manual_seed(123)
    ours = MultiheadAttention(E, H, **cfg)
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ours) == list(sd_ref)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for name in sd_ref:  # same shapes, and the same init draws under one seed
        assert torch.equal(sd_ours[name], sd_ref[name]), name
    ref.load_state_dict(ours.state_dict())  # both directions load strictly


def test_default_init_distributions():
    m = MultiheadAttention(64, 4, add_bias_kv=True)
    bound = (6.0 / (64 + 3 * 64)) ** 0.5  # xavier_uniform over the packed (3E, E) weight
    assert m.in_proj_weight is not None and m.in_proj_bias is not None
    assert float(m.in_proj_weight.detach().abs().max()) <= bound
    assert torch.count_nonzero(m.in_proj_bias) == 0 and torch.count_nonzero(m.out_proj.bias) == 0
    assert m.bias_k is not None and float(m.bias_k.detach().std()) > 0


def test_factory_kwargs_and_attributes():
    m = MultiheadAttention(E, H, kdim=5, vdim=6, batch_first=True, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    ref = nn.MultiheadAttention(E, H, kdim=5, vdim=6, batch_first=True)
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "batch_first", "_qkv_same_embed_dim"):
        assert getattr(m, attr) == getattr(ref, attr), attr
    assert isinstance(m.out_proj, nn.Linear)


# -- forward parity ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_forward_matches_torch(cfg, mask, dtype):
    ref, ours = make_pair(dtype, **cfg)
    args = make_inputs(ours, dtype)
    masks = make_masks(mask, dtype)
    for need_weights, average in WEIGHT_MODES:
        kw = dict(masks, need_weights=need_weights, average_attn_weights=average)
        (out_r, w_r), (out_o, w_o) = both(ref, ours, args, **kw)
        assert_close(out_o, out_r, dtype)
        assert_close(w_o, w_r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["none", "kpm_bool", "kpm_float", "attn2d_bool", "attn3d_float"])
@pytest.mark.parametrize("cfg", ["default", "batch_first", "kdim_vdim", "all"])
def test_unbatched_matches_torch(cfg, mask, dtype):
    ref, ours = make_pair(dtype, **CONFIGS[cfg])
    args = make_inputs(ours, dtype, batched=False)
    masks = make_masks(mask, dtype, batched=False)
    for need_weights, average in WEIGHT_MODES:
        kw = dict(masks, need_weights=need_weights, average_attn_weights=average)
        (out_r, w_r), (out_o, w_o) = both(ref, ours, args, **kw)
        assert out_o.shape == (L, E)
        assert_close(out_o, out_r, dtype)
        assert_close(w_o, w_r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eval_self_attention_matches_torch_fast_path(dtype):
    """eval + batch_first + self-attention + no grad is where torch takes its native fast path."""
    ref, ours = make_pair(dtype, batch_first=True)
    ref.eval(), ours.eval()
    x, _, _ = make_inputs(ours, dtype, self_attn=True)
    masks = make_masks("kpm_bool", dtype, n=L)
    with torch.no_grad():
        for need_weights in (True, False):
            (out_r, w_r), (out_o, w_o) = both(ref, ours, (x, x, x), need_weights=need_weights, **masks)
            assert_close(out_o, out_r, dtype)
            assert_close(w_o, w_r, dtype)


@pytest.mark.parametrize("cfg", ["default", "bias_kv", "all"])
def test_train_and_eval_agree_without_dropout(cfg):
    ref, ours = make_pair(torch.float32, **CONFIGS[cfg])
    args = make_inputs(ours, torch.float32)
    masks = make_masks("both_bool", torch.float32)
    train = ours(*args, **masks)
    ours.eval(), ref.eval()
    evald, ref_eval = ours(*args, **masks), ref(*args, **masks)
    for a, b, r in zip(train, evald, ref_eval):
        assert_close(a, b, torch.float32)
        assert_close(b, r, torch.float32)


# -- is_causal -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_is_causal_with_causal_attn_mask_matches_torch(mask_kind, with_kpm, dtype):
    ref, ours = make_pair(dtype, batch_first=True)
    x, _, _ = make_inputs(ours, dtype, self_attn=True)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)  # (L, L), -inf above diag
    am = torch.isinf(causal) if mask_kind == "bool" else causal
    kpm = make_masks("kpm_bool", dtype, n=L) if with_kpm else {}
    if mask_kind == "float" and kpm:
        kpm = {"key_padding_mask": torch.zeros(B, L, dtype=dtype).masked_fill(kpm["key_padding_mask"], -1e4)}
    for need_weights in (True, False):
        kw = dict(kpm, attn_mask=am, is_causal=True, need_weights=need_weights)
        (out_r, w_r), (out_o, w_o) = both(ref, ours, (x, x, x), **kw)
        assert_close(out_o, out_r, dtype)
        assert_close(w_o, w_r, dtype)


def test_is_causal_hint_follows_torch_quirks():
    """With is_causal, need_weights=False and no key_padding_mask, torch ignores attn_mask's content and
    uses SDPA's top-left causal mask over all keys, so the appended bias_k key is hidden from every row;
    with need_weights=True the padded attn_mask lets every row see it. We mirror both."""
    ref, ours = make_pair(torch.float32, add_bias_kv=True)
    x, _, _ = make_inputs(ours, torch.float32, self_attn=True)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    results = {}
    for need_weights in (True, False):
        kw = dict(attn_mask=causal, is_causal=True, need_weights=need_weights)
        (out_r, _), (out_o, _) = both(ref, ours, (x, x, x), **kw)
        assert_close(out_o, out_r, torch.float32)
        results[need_weights] = out_o
    assert not torch.allclose(results[True], results[False])
    # A hint that lies: torch's slow path trusts is_causal, not attn_mask; so do we.
    no_mask = torch.zeros(L, L)
    (out_r, _), (out_o, _) = both(ref, ours, (x, x, x), attn_mask=no_mask, is_causal=True, need_weights=False)
    assert_close(out_o, out_r, torch.float32)


# -- gradients -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_gradients_match_torch(cfg, need_weights, dtype):
    ref, ours = make_pair(dtype, **cfg)
    inputs = []
    for m in (ref, ours):
        args = tuple(t.clone().requires_grad_(True) for t in make_inputs(ours, dtype))
        masks = make_masks("kpm_bool_attn_float", dtype)
        out, w = m(*args, need_weights=need_weights, **masks)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum()
        if w is not None:
            loss = loss + (w * w).sum()
        loss.backward()
        inputs.append(args)
    for a_ref, a_ours in zip(*inputs):
        assert_close(a_ours.grad, a_ref.grad, dtype)
    params_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, params_ref[name].grad, dtype)


# -- fully masked rows: zeros, not NaN -----------------------------------------------------------
@pytest.mark.parametrize("need_weights", [True, False])
def test_fully_masked_rows_give_zeros_not_nan(need_weights):
    ref, ours = make_pair(torch.float64, batch_first=True)
    q, k, v = (t.requires_grad_(True) for t in make_inputs(ours, torch.float64))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # batch row 1 sees no key at all
    am = torch.zeros(L, S, dtype=torch.bool)
    am[2] = True  # query row 2 sees no key in any batch row
    out, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
    out_r, w_r = ref(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
    empty = torch.zeros(B, L, dtype=torch.bool)
    empty[1], empty[:, 2] = True, True
    assert not torch.isnan(out).any()
    bias = ours.out_proj.bias.detach().expand(int(empty.sum()), E)
    assert_close(out[empty].detach(), bias, torch.float64)  # zero attention, then out_proj
    assert_close(out[~empty], out_r[~empty], torch.float64)  # torch's other rows are finite
    if need_weights:
        assert w is not None and w_r is not None
        assert torch.count_nonzero(w[empty]) == 0
        assert_close(w[~empty], w_r[~empty], torch.float64)
    out.sum().backward()
    for t in (q, k, v, *ours.parameters()):
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_fully_masked_rows_with_float_masks():
    ref, ours = make_pair(torch.float32)
    args = make_inputs(ours, torch.float32)
    kpm = torch.zeros(B, S)
    kpm[0] = float("-inf")
    out, w = ours(*args, key_padding_mask=kpm)
    assert w is not None and torch.count_nonzero(w[0]) == 0
    assert_close(out[:, 0].detach(), ours.out_proj.bias.detach().expand(L, E), torch.float32)
    out_nw, _ = ours(*args, key_padding_mask=kpm, need_weights=False)
    assert_close(out_nw, out, torch.float32)
    out_r, _ = ref(*args, key_padding_mask=kpm)
    assert_close(out[:, 1:], out_r[:, 1:], torch.float32)


# -- dropout -------------------------------------------------------------------------------------
def test_dropout_in_training_is_random_and_weights_are_after_dropout():
    p = 0.5
    ref, ours = make_pair(torch.float64, dropout=p)
    args = make_inputs(ours, torch.float64)
    ours.eval()
    out_eval, w_eval = ours(*args, average_attn_weights=False)
    ours.train()
    out1, w1 = ours(*args, average_attn_weights=False)
    out2, _ = ours(*args, average_attn_weights=False)
    out3, _ = ours(*args, need_weights=False)
    for o in (out1, out2, out3):
        assert torch.isfinite(o).all() and not torch.allclose(o, out_eval)
    assert not torch.allclose(out1, out2)
    assert w1 is not None and w_eval is not None
    kept = w1 != 0  # weights come back after dropout: each is 0 or w / (1 - p)
    assert_close(w1[kept], w_eval[kept] / (1 - p), torch.float64)
    assert 0.35 < 1 - kept.double().mean().item() < 0.65
    ours.eval(), ref.eval()
    again, _ = ours(*args)
    ref_eval, _ = ref(*args)
    assert_close(again, out_eval, torch.float64)
    assert_close(again, ref_eval, torch.float64)


# -- drop-in inside torch's own layers -----------------------------------------------------------
@pytest.mark.parametrize("train", [True, False])
def test_drop_in_inside_transformer_encoder_layer(train):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    ours = MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(layer.self_attn.state_dict())
    x = torch.randn(B, L, E)
    kpm = make_masks("kpm_bool", torch.float32, n=L)["key_padding_mask"]
    layer.train(train)
    with torch.no_grad():
        want = layer(x, src_key_padding_mask=kpm)
        layer.self_attn = ours  # type: ignore[assignment]
        got = layer(x, src_key_padding_mask=kpm)
    assert_close(got[~kpm], want[~kpm], torch.float32)  # eval fast path leaves padded rows at 0


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"embed_dim": 10, "num_heads": 3}, r"embed_dim \(10\) must be divisible by num_heads \(3\)"),
        ({"embed_dim": 8, "num_heads": 0}, r"num_heads must be a positive int, got 0"),
        ({"embed_dim": 8, "num_heads": 2, "dropout": 1.0}, r"dropout must be a probability in \[0, 1\)"),
        ({"embed_dim": 8, "num_heads": 2, "dropout": -0.1}, r"dropout must be .* got -0.1"),
        ({"embed_dim": 8, "num_heads": 2, "kdim": 0}, r"kdim must be a positive int, got 0"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiheadAttention(**kwargs)


def _bad_forward_cases():
    x = torch.randn(L, B, E)
    kv = torch.randn(S, B, E)
    return [
        ((torch.randn(1, L, B, E), kv, kv), {}, r"all be 3-D .* or all 2-D .* got 4-D, 3-D and 3-D"),
        ((x, torch.randn(S, E), kv), {}, r"got 3-D, 2-D and 3-D"),
        ((torch.randn(L, B, 6), kv, kv), {}, r"query has 6 features .* embed_dim=8"),
        ((x, torch.randn(S, B, 5), kv), {}, r"key has 5 features .* kdim=8"),
        ((x, kv, torch.randn(S + 1, B, E)), {}, r"key and value must have the same length S"),
        ((x, torch.randn(S, B + 1, E), torch.randn(S, B + 1, E)), {}, r"batch sizes differ along dim 1"),
        (
            (x, kv, kv),
            {"key_padding_mask": torch.zeros(B, S + 1, dtype=torch.bool)},
            r"key_padding_mask has shape \(3, 8\) but must be \(3, 7\)",
        ),
        (
            (x, kv, kv),
            {"key_padding_mask": torch.zeros(B, S, dtype=torch.long)},
            r"key_padding_mask must be a bool tensor .* got torch.int64",
        ),
        (
            (x, kv, kv),
            {"attn_mask": torch.zeros(L + 1, S, dtype=torch.bool)},
            r"attn_mask has shape \(6, 7\) but must be \(L, S\)=\(5, 7\) or \(B \* num_heads, L, S\)",
        ),
        ((x, kv, kv), {"attn_mask": torch.zeros(B, L, S)}, r"=\(6, 5, 7\) with B=3, num_heads=2"),
        (
            (x, kv, kv),
            {"attn_mask": torch.zeros(L, S, dtype=torch.int32)},
            r"attn_mask must be a bool tensor",
        ),
        ((x, kv, kv), {"is_causal": True}, r"is_causal=True .* needs attn_mask"),
        (
            (x[:, 0], kv[:, 0], kv[:, 0]),
            {"key_padding_mask": torch.zeros(1, S, dtype=torch.bool)},
            r"must be \(7,\) \(\(S,\) for unbatched input\)",
        ),
        (
            (x[:, 0], kv[:, 0], kv[:, 0]),
            {"attn_mask": torch.zeros(B * H, L, S)},
            r"\(num_heads, L, S\)=\(2, 5, 7\)",
        ),
    ]


@pytest.mark.parametrize("args, kwargs, match", _bad_forward_cases())
def test_bad_forward_arguments(args, kwargs, match):
    m = MultiheadAttention(E, H)
    with pytest.raises(ValueError, match=match):
        m(*args, **kwargs)


@pytest.mark.parametrize("masks", ["none", "kpm", "attn2d", "attn3d", "both"])
def test_merge_masks_matches_torch(masks):
    ref, ours = make_pair(torch.float32, batch_first=True)
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L).masked_fill(torch.rand(B, L) < 0.3, float("-inf"))
    am = torch.randn(B * H, L, L) if masks == "attn3d" else torch.randn(L, L)
    args = (
        am if masks in ("attn2d", "attn3d", "both") else None,
        kpm if masks in ("kpm", "both") else None,
        x,
    )
    (m_ref, t_ref), (m_ours, t_ours) = ref.merge_masks(*args), ours.merge_masks(*args)
    assert t_ours == t_ref
    assert_close(m_ours, m_ref, torch.float32)
