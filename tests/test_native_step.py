"""Native decode steps (multihead.models.native_step): the eager model's numbers (against float64 and
against transformers), its tokens, its cache, and the eager step wherever the native one does not apply."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import native_step, quant
from tests.native_counts import count_native_steps

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")


def _lm(n_heads=4, n_kv_heads=2, interleaved=False, seed=0, **kw):
    torch.manual_seed(seed)
    lm = mh.TransformerLM(300, 64, 2, n_heads, 96, n_kv_heads=n_kv_heads, norm_eps=1e-6, **kw).eval()
    if interleaved:
        for layer in lm.layers:
            layer.self_attn.rotary.interleaved = True
    with torch.no_grad():  # non-trivial norm gains, so a wrong gain shows
        for m in lm.modules():
            if isinstance(m, mh.nn.norms.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return lm


def _native(lm, weights):
    q = quant.quantize(lm, weights=weights, kv=None, kernel="native")
    assert q.why_not_native_steps is None
    return q


def _eager(lm, weights):
    q = quant.quantize(lm, weights=weights, kv=None, kernel="native")
    q.native_steps = False
    return q


def _steps(model, prompt, tokens, max_len=64):
    """Prefill, then one step per token: the stacked final hidden states (n, d) and the caches."""
    cache = model.make_cache(1, max_len)
    with torch.no_grad():
        model.hidden_states(prompt, cache=cache)
        hs = [model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]
    return torch.stack(hs), cache


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp32_native_steps_match_the_float64_model(n_heads, n_kv_heads, interleaved):
    lm = _lm(n_heads, n_kv_heads, interleaved)
    prompt = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(2))
    got, cache = _steps(_native(lm, "fp32"), prompt, tokens)
    want, ref_cache = _steps(copy.deepcopy(lm).double(), prompt, tokens)  # the float64 reference
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    for c, r in zip(cache, ref_cache):  # the native steps wrote the rotated keys and the values in place
        assert c.position == r.position == 17
        torch.testing.assert_close(c.k[:, :, :17].double(), r.k[:, :, :17], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.v[:, :, :17].double(), r.v[:, :, :17], rtol=1e-5, atol=1e-5)


HALVES = [
    pytest.param("bf16", torch.bfloat16, id="bf16"),
    pytest.param(
        "fp16",
        torch.float16,
        id="fp16",
        marks=pytest.mark.skipif(
            torch.float16 not in native.dtypes(),
            reason="no fp16 kernel here (neither F16C nor the compiler's _Float16)",
        ),
    ),
]


@pytest.mark.parametrize(("weights", "dtype"), HALVES)
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 2), (4, 1)])
def test_half_native_steps_follow_the_eager_model_of_their_dtype(weights, dtype, n_heads, n_kv_heads):
    lm = _lm(n_heads, n_kv_heads)
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(2))
    got, _ = _steps(_native(lm, weights), prompt, tokens)
    want, _ = _steps(_eager(lm, weights), prompt, tokens)
    ref, _ = _steps(copy.deepcopy(lm).double(), prompt, tokens)
    assert got.dtype == dtype
    # the same rounding points as the eager layers: as close to them as two eager kernels get,
    # and no further from the float64 model than the eager model of that dtype is
    eager_err = float((want.double() - ref).abs().max())
    assert float((got.double() - want.double()).abs().max()) <= 2 * eager_err
    assert float((got.double() - ref).abs().max()) <= 2 * eager_err


@pytest.mark.parametrize("weights", ["fp32", "bf16", pytest.param("fp16", marks=HALVES[1].marks)])
def test_native_generation_gives_the_eager_tokens_and_takes_every_decode_step(weights, monkeypatch):
    lm = _lm()
    prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    fast = _native(lm, weights)
    calls = count_native_steps(monkeypatch)
    with torch.no_grad():
        got = fast.generate(prompt, 20)
        assert len(calls) == 19  # every step after the prefill
        assert torch.equal(got, _eager(lm, weights).generate(prompt, 20))
        sampled = fast.generate(prompt, 10, do_sample=True, top_k=20)  # sampling steps run natively too
    assert sampled.shape == (1, 22) and len(calls) == 19 + 9


def test_native_generation_equals_transformers_llama():
    tf = pytest.importorskip("transformers", reason="the outside reference needs transformers")
    config = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(config).eval()
    ours = quant.quantize(mh.pretrained.from_hf(hf), weights="fp32", kv=None, kernel="native")
    assert ours.why_not_native_steps is None
    prompt = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert torch.equal(ours.generate(prompt, 24), want)
        # the hidden state of a native step against transformers' last hidden state of the same sequence
        cache = ours.make_cache(1, 40)
        ours.hidden_states(want[:, :20], cache=cache)
        h = ours.hidden_states(want[:, 20:21], cache=cache)[0, 0]
        ref = hf(want[:, :21], output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-4)


def test_eager_and_native_steps_share_one_cache():
    lm = _lm()
    fast, slow = _native(lm, "fp32"), _eager(lm, "fp32")
    prompt = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(6))
    cache = fast.make_cache(1, 32)
    with torch.no_grad():
        fast.hidden_states(prompt, cache=cache)
        fast.hidden_states(tokens[0].view(1, 1), cache=cache)  # native
        slow.hidden_states(tokens[1].view(1, 1), cache=cache)  # eager, on what the native step wrote
        fast.hidden_states(tokens[2:3].view(1, 1), cache=cache)  # native again
        mixed = slow.hidden_states(tokens[3].view(1, 1), cache=cache)[0, 0]
        want = slow.hidden_states(torch.cat([prompt[0], tokens]).view(1, -1))[0, -1]
    assert cache[0].position == 12
    torch.testing.assert_close(mixed, want, rtol=1e-5, atol=1e-5)


def test_what_stops_a_native_model_and_the_eager_fallback():
    assert "sliding window" in native_step.why_not_model(_lm(sliding_window=8))
    assert "not RMSNorm" in native_step.why_not_model(_lm(norm="layernorm"))
    assert "has a bias" in native_step.why_not_model(_lm(bias=True))
    assert "not SwiGLU" in native_step.why_not_model(_lm(activation="gelu"))
    assert "rotary" in native_step.why_not_model(_lm(positions="learned"))
    lm = _lm()
    lm.layers[1].self_attn.backend = mh.approx.TopK(k=4)
    assert "layer 1's attention runs an approximation" in native_step.why_not_model(lm)
    lm.layers[1].self_attn.backend = "tiled"  # an exact backend: the same equations, native steps apply
    assert native_step.why_not_model(lm) is None
    lm2 = _lm()
    lm2.layers[0].register_forward_hook(lambda *a: None)
    assert "forward hooks" in native_step.why_not_model(lm2)
    int8 = quant.quantize(_lm(), weights="int8", kv="int8", kernel="fbgemm")
    assert int8.why_not_native_steps.startswith("native_steps is off for this model")
    assert "kernel='native'" in int8.why_not_native_steps
    # a model the native step cannot serve generates exactly as the eager one
    windowed = _lm(sliding_window=8)
    q = quant.quantize(windowed, weights="fp32", kv=None, kernel="native")
    assert "sliding window" in q.why_not_native_steps
    prompt = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(q.generate(prompt, 8), _eager(windowed, "fp32").generate(prompt, 8))


def test_calls_that_take_the_eager_step():
    fast = _native(_lm(), "fp32")
    one = torch.tensor([[5]])
    dense = fast.make_cache(1, 16)
    assert native_step.why_not_call(fast, one, None, None) == "not a cached call"
    assert native_step.why_not_call(fast, torch.tensor([[5], [6]]), None, fast.make_cache(2, 16)) is None
    assert native_step.why_not_call(fast, torch.tensor([[5], [6]]), None, dense) == (
        "the cache holds 1 rows for a call of 2"
    )
    assert native_step.why_not_call(fast, torch.tensor([[5, 6]]), None, dense) is None  # a prompt of two
    assert native_step.why_not_call(fast, torch.tensor([[5, 6], [7, 8]]), None, fast.make_cache(2, 16)) == (
        "2 tokens of each of 2 rows (native steps take one token of several rows, or one row)"
    )
    assert (
        native_step.why_not_call(fast, one, torch.tensor([[0, 1]]), dense) == "the attention mask has padding"
    )
    assert native_step.why_not_call(fast, one, torch.tensor([[1, 1]]), dense) is None
    assert "dense torch.float32 cache" in native_step.why_not_call(
        fast, one, None, fast.make_cache(1, 16, "int8")
    )
    assert "not an integer in [0, vocab_size)" in native_step.why_not_call(
        fast, torch.tensor([[300]]), None, dense
    )
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=300\)"):
        fast.hidden_states(torch.tensor([[300]]), cache=dense)  # the eager step says what is wrong
    # padded batches and int8 caches still generate (eagerly)
    with torch.no_grad():
        ids, mask = mh.left_pad([[1, 2, 3], [4, 5]])
        assert fast.generate(ids, 4, attention_mask=mask).shape == (2, 7)


def test_kv_cache_advance_counts_positions_written_in_place():
    c = mh.KVCache(1, 2, 8, 4)
    c.advance(3)
    assert c.position == 3
    with pytest.raises(ValueError, match=r"KVCache overflow: 3 cached \+ 2 new > max_len=4"):
        c.advance(2)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        c.advance(0)
    with pytest.raises(
        ValueError, match="for 'dense' and 'int8' caches written in place, this one is 'sliding'"
    ):
        mh.KVCache(1, 2, 8, 4, kind="sliding", window=2).advance(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_model_takes_native_steps_in_its_own_dtype(dtype, monkeypatch):
    import pickle

    lm = _lm().to(dtype)  # the natural call: no quantize step
    assert lm.why_not_native_steps is None
    eager = copy.deepcopy(lm)
    eager.native_steps = False
    assert eager.why_not_native_steps.startswith("native_steps is off for this model")
    calls = count_native_steps(monkeypatch)
    prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(8))
    got = lm.generate(prompt, 12)
    assert len(calls) == 11  # every step after the prefill
    assert torch.equal(got, eager.generate(prompt, 12)) and len(calls) == 11
    lm.train()  # training mode (dropout) runs the eager layers
    cache = lm.make_cache(1, 16)
    with torch.no_grad():
        lm.hidden_states(prompt[:, :4], cache=cache)
        lm.hidden_states(prompt[:, 4:5], cache=cache)
    assert len(calls) == 11
    assert pickle.loads(pickle.dumps(lm)).why_not_native_steps is None  # the memos do not travel


@pytest.mark.parametrize(
    ("d", "n_heads", "n_kv_heads"),
    [
        (216, 3, 1),  # head dim 72: the 64-lane loop and an 8-value tail; 3 query heads a kv head
        (480, 6, 1),  # head dim 80: 64 + 16 lanes; 6 heads: a group of 4 and one of 2
        (320, 10, 2),  # head dim 32: only 16-lane steps; 5 heads: one left over
    ],
)
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_native_attention_head_dim_and_group_tails_follow_the_eager_step(d, n_heads, n_kv_heads, weights):
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, d, 1, n_heads, 64, n_kv_heads=n_kv_heads, norm_eps=1e-6).eval()
    prompt = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(1))  # keys past 64
    tokens = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))
    got, _ = _steps(_native(lm, weights), prompt, tokens, max_len=80)
    want, _ = _steps(_eager(lm, weights), prompt, tokens, max_len=80)
    tol = 1e-5 if weights == "fp32" else 2e-2
    assert float((got.double() - want.double()).abs().max()) <= tol * float(want.abs().max())


def test_layers_with_their_own_rotary_tables_each_get_their_rows():
    lm = _lm(4, 2)
    lm.layers[1].self_attn.rotary = mh.nn.positions.RotaryEmbedding(16, base=500.0)  # its own, other base
    prompt = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))
    got, _ = _steps(_native(lm, "fp32"), prompt, tokens)
    want, _ = _steps(copy.deepcopy(lm).double(), prompt, tokens)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    shared, _ = _steps(_native(_lm(4, 2), "fp32"), prompt, tokens)  # the base matters: not a vacuous test
    assert float((shared - got).abs().max()) > 1e-3


def test_a_failed_step_advances_only_the_caches_of_the_layers_that_ran():
    model = _native(_lm(4, 2), "fp32")
    cache = model.make_cache(1, 16)
    with torch.no_grad():
        model.hidden_states(torch.tensor([[1, 2, 3]]), cache=cache)
        model.hidden_states(torch.tensor([[4]]), cache=cache)  # a native step: the plan is made
        plan = model.__dict__["_native_plan"]

        class OneLayerThenNoMemory:  # the library's answer when layer 2's scratch cannot be allocated
            def mh_decode_layers(self, x, args, n, pos, cos, sin, g_final, eps, out, done):
                plan.lib = real
                plan.done.value = 1
                return -1

        real, plan.lib = plan.lib, OneLayerThenNoMemory()
        with pytest.raises(ValueError, match="could not allocate"):
            native_step.decode_step(model, torch.tensor([[5]]), cache)
    assert [kv.position for kv in cache] == [5, 4]


@pytest.mark.parametrize("name", ["layer", "greedy"])
def test_the_self_check_refuses_a_build_whose_arguments_differ_from_the_ctypes_mirrors(name):
    mirrors = {"mh_layer_args_bytes": native.LayerArgs, "mh_greedy_args_bytes": native.GreedyArgs}
    wrong = f"mh_{name}_args_bytes"

    class Built:  # a library built from sources whose struct `name` gained a field
        def __getattr__(self, fn):
            return lambda: ctypes.sizeof(mirrors[fn]) + (8 if fn == wrong else 0)

    why = native.checks.check_library(Built())
    assert why is not None and f"{name} arguments take" in why and "disagree" in why
    assert getattr(native.library(), wrong)() == ctypes.sizeof(mirrors[wrong])  # this build agrees
