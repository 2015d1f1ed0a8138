"""OutputGatedAttention (Qiu et al., 2025): the gated heads against a float64 per-head loop, every backend
against the float64 gold, KV-cached decode, the gate's initialisation and gradients, and (when
transformers has it) one Qwen3-Next full-attention layer."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import multihead as mh
from multihead import variants as V
from tests.numerics import TOL, allowed, max_err

F64 = torch.float64
B, N, M, d, H = 2, 7, 5, 24, 4
D = d // H
BACKENDS = ("reference", "matrix", "sdpa", "tiled")


def randomize(m: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter N(0, std^2), float64."""
    g = torch.Generator().manual_seed(seed)
    m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * std)
    return m


def inputs(seed: int = 1, n: int = N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, d, generator=g, dtype=F64), torch.randn(B, M, d, generator=g, dtype=F64)


def lin(t, w, b, rows=slice(None)):
    out = t @ w[rows].T
    return out if b is None else out + b[rows]


def reference(m, x, ctx=None, mask=None, head_mask=None):
    """concat_i(softmax(Q_i K_j^T / sqrt(D)) V_j * sigmoid(x W_g + b_g)_i * head_mask_i) W^O, one head at a
    time; j = i // (Hq / Hkv); a row with no allowed key gives zeros."""
    src = x if ctx is None else ctx
    w, b, Hkv = m.qkv_proj.weight, m.qkv_proj.bias, m.n_kv_heads
    gate = torch.sigmoid(lin(x, m.gate_proj.weight, m.gate_proj.bias))  # (B, N, Hq*D) or (B, N, Hq)
    allowed_ = None if mask is None else mask.dense(B, H, x.shape[1], src.shape[1])
    heads = []
    for i in range(H):
        j = i // (H // Hkv)
        q = lin(x, w, b, slice(i * D, (i + 1) * D))
        k = lin(src, w, b, slice((H + j) * D, (H + j + 1) * D))
        v = lin(src, w, b, slice((H + Hkv + j) * D, (H + Hkv + j + 1) * D))
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if allowed_ is not None:
            s = s.masked_fill(~allowed_[:, i], -math.inf)
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        g = gate[..., i * D : (i + 1) * D] if m.gate == "elementwise" else gate[..., i : i + 1]
        heads.append(p @ v * g * (1.0 if head_mask is None else head_mask[i]))
    return lin(torch.cat(heads, dim=-1), m.o_proj.weight, m.o_proj.bias)


MASKS = {
    "none": None,
    "causal": mh.causal(),
    "per-head": mh.custom(lambda b, h, q, k: (k <= q) | (h == 1)),
    "empty-row": mh.causal() & mh.custom(lambda b, h, q, k: q != 2),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("n_kv", [H, 2, 1])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_matches_a_float64_per_head_loop(gate, n_kv, mask):
    m = randomize(V.OutputGatedAttention(d, H, n_kv, gate=gate)).eval()
    x, ctx = inputs()
    hm = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=F64)
    assert (
        max_err(m(x, mask=MASKS[mask], head_mask=hm), reference(m, x, mask=MASKS[mask], head_mask=hm))
        < TOL[F64]
    )
    assert max_err(m(x, ctx), reference(m, x, ctx)) < TOL[F64]  # cross-attention: the gate reads x


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_every_backend_follows_the_float64_gold(gate):
    """float32 on each backend: outputs within 2x, gradients within 3x the plain matrix path's error."""
    m64 = randomize(V.OutputGatedAttention(d, H, 2, gate=gate, rotary=mh.RotaryEmbedding(D)), seed=2).eval()
    x64, _ = inputs(seed=3, n=33)

    def run(m, x):
        x = x.clone().requires_grad_(True)
        y = m(x, mask=mh.causal())
        y.pow(2).sum().backward()
        return y.detach(), x.grad, m.gate_proj.weight.grad

    m64.backend = "reference"
    gold = run(m64, x64)
    errs = {}
    for name in BACKENDS:
        m32 = copy.deepcopy(m64).float()
        m32.zero_grad()
        m32.backend = name
        errs[name] = [max_err(a, b) for a, b in zip(run(m32, x64.float()), gold)]
    for name, (out, gx, gw) in errs.items():
        base = errs["matrix"]
        assert out <= allowed(base[0]), name
        assert gx <= allowed(base[1], grad=True) and gw <= allowed(base[2], grad=True), name


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_kv_cached_decode_equals_the_full_pass(gate):
    m = randomize(V.OutputGatedAttention(d, H, 2, gate=gate, rotary=mh.RotaryEmbedding(D)), seed=4).eval()
    x, _ = inputs(seed=5)
    full = m(x, mask=mh.causal())
    cache = mh.KVCache(B, 2, D, N, dtype=F64)
    steps = [m(x[:, :3], mask=mh.causal(), cache=cache)]
    steps += [m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(3, N)]
    assert max_err(torch.cat(steps, dim=1), full) < TOL[F64]


def test_a_headwise_gate_forced_to_one_is_multi_head_attention():
    m = randomize(V.OutputGatedAttention(d, H, 2, gate="headwise"), seed=6).eval()
    mha = mh.MultiHeadAttention(d, H, 2).double().eval()
    mha.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("gate_proj")})
    x, _ = inputs(seed=7)
    with torch.no_grad():
        m.gate_proj.weight.zero_()
        m.gate_proj.bias.fill_(50.0)  # sigmoid(50) == 1.0 in float64
    assert torch.equal(torch.sigmoid(torch.tensor(50.0, dtype=F64)), torch.tensor(1.0, dtype=F64))
    assert max_err(m(x, mask=mh.causal()), mha(x, mask=mh.causal())) < TOL[F64]
    with torch.no_grad():
        m.gate_proj.bias[2] = -50.0  # head 2 closed: as pruning it with head_mask
    hm = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64)
    assert max_err(m(x, mask=mh.causal()), mha(x, mask=mh.causal(), head_mask=hm)) < TOL[F64]


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gate_bias_init_sets_where_the_gates_start(gate):
    x, _ = inputs(seed=8)
    half = V.OutputGatedAttention(d, H, gate=gate).double().eval()  # default: b_g = 0
    assert torch.equal(half.gate_proj.bias, torch.zeros_like(half.gate_proj.bias))
    with torch.no_grad():
        half.gate_proj.weight.zero_()
    mha = mh.MultiHeadAttention(d, H).double().eval()
    mha.load_state_dict({k: v for k, v in half.state_dict().items() if not k.startswith("gate_proj")})
    b_o = half.o_proj.bias
    assert max_err(half(x) - b_o, 0.5 * (mha(x) - b_o)) < TOL[F64]  # sigmoid(0) = 1/2 on every head
    opened = V.OutputGatedAttention(d, H, gate=gate, gate_bias_init=5.0)
    assert torch.equal(opened.gate_proj.bias, torch.full_like(opened.gate_proj.bias, 5.0))
    assert V.OutputGatedAttention(d, H, gate=gate, gate_bias=False).gate_proj.bias is None
    width = H * D if gate == "elementwise" else H
    assert half.gate_proj.weight.shape == (width, d)


def test_from_mha_starts_as_the_given_layer():
    mha = randomize(mh.MultiHeadAttention(d, H, 2, rotary=mh.RotaryEmbedding(D)), seed=9).eval()
    x, _ = inputs(seed=10)
    for gate in ("elementwise", "headwise"):
        m = V.OutputGatedAttention.from_mha(mha, gate=gate).eval()
        assert m.rotary is mha.rotary and m.gate_proj.weight.dtype == F64
        assert max_err(m(x, mask=mh.causal()), mha(x, mask=mh.causal())) < TOL[F64]
    with pytest.raises(ValueError, match=r"from_mha needs n_heads \* head_dim == d_model, got 4 \* 4 != 24"):
        V.OutputGatedAttention.from_mha(mh.MultiHeadAttention(d, H, head_dim=4))


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gradient_reaches_the_gate(gate):
    m = randomize(V.build("output_gated", d, H, gate=gate), seed=11).train()
    x, _ = inputs(seed=12)
    m(x, mask=mh.causal()).pow(2).mean().backward()
    for p in (m.gate_proj.weight, m.gate_proj.bias, m.qkv_proj.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"gate must be one of \['elementwise', 'headwise'\], got 'scalar'"):
        V.OutputGatedAttention(d, H, gate="scalar")
    with pytest.raises(ValueError, match=r"gate_bias_init must be a finite number, got inf"):
        V.OutputGatedAttention(d, H, gate_bias_init=math.inf)
    with pytest.raises(ValueError, match=r"output_gated'\) got unknown arguments \['gates'\]"):
        V.build("output_gated", d, H, gates="headwise")


# -- Qwen3-Next's gated full-attention layer (transformers, when installed) ---------------------------------
class _QKNormed(V.OutputGatedAttention):
    """Qwen3-Next's full-attention layer: the output gate plus RMSNorm(1 + w) on every q and k head."""

    def __init__(self, *args, eps: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps
        self.q_w = torch.nn.Parameter(torch.zeros(self.head_dim))
        self.k_w = torch.nn.Parameter(torch.zeros(self.head_dim))

    def project(self, x, context):
        q, k, v = super().project(x, context)  # (B, Hq, N, D), 2 x (B, Hkv, N, D)

        def norm(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w)

        return norm(q, self.q_w), norm(k, self.k_w), v


def test_matches_a_qwen3_next_full_attention_layer():
    """Qwen3-Next stores the gate inside q_proj (per head: D query rows, then D gate rows); float32, as the
    layer's q/k norms compute in float32."""
    tf = pytest.importorskip("transformers", reason="the Qwen3-Next oracle needs transformers")
    qn = pytest.importorskip(
        "transformers.models.qwen3_next.modeling_qwen3_next", reason="this transformers has no Qwen3-Next"
    )
    hd, heads, kv, width, n = 16, 4, 2, 64, 9
    config = tf.Qwen3NextConfig(
        hidden_size=width,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        partial_rotary_factor=1.0,
        layer_types=["full_attention"],
        num_hidden_layers=1,
        vocab_size=16,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = qn.Qwen3NextAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = _QKNormed(
        width, heads, kv, eps=config.rms_norm_eps, bias=False, gate_bias=False,
        rotary=mh.RotaryEmbedding(hd, base=config.rope_parameters["rope_theta"]),
    ).eval()  # fmt: skip
    wq = hf.q_proj.weight.reshape(heads, 2, hd, width)  # per head: query rows, then gate rows
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(
            torch.cat([wq[:, 0].reshape(-1, width), hf.k_proj.weight, hf.v_proj.weight])
        )
        ours.gate_proj.weight.copy_(wq[:, 1].reshape(-1, width))
        ours.o_proj.weight.copy_(hf.o_proj.weight)
        ours.q_w.copy_(hf.q_norm.weight)
        ours.k_w.copy_(hf.k_norm.weight)
    x = torch.randn(2, n, width, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)[None]
    causal = torch.full((n, n), -math.inf).triu(1)[None, None]  # (1, 1, N, N) additive
    with torch.no_grad():
        ref, _ = hf(x, qn.Qwen3NextRotaryEmbedding(config)(x, pos), causal)
        got = ours(x, mask=mh.causal())
    assert max_err(got, ref) < TOL[torch.float32] * max(1.0, ref.abs().max().item())
