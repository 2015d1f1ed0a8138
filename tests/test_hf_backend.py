"""multihead as a Hugging Face attention backend: tiny random-weight models of many families, built from
configs offline, must give the logits of transformers' own "eager" attention on a left-padded batch and
the same greedy tokens with dynamic and static caches; the masks transformers composes must reach
multihead as predicates equal to transformers' own dense masks."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the oracle of the HF backend tests"
)

import multihead as mh  # noqa: E402
import multihead.hf as mhf  # noqa: E402
from multihead.hf.masks import HFMask, mask_interface  # noqa: E402

mu = pytest.importorskip("transformers.masking_utils", reason="transformers without masking_utils (< 4.48)")

FN = mhf.register()  # "multihead"


@pytest.fixture(autouse=True)
def _registered():
    """Each test counts the calls of the function registered as "multihead" now: another test file may
    have registered its own under that name since this module was imported."""
    global FN
    FN = mhf.register()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threads only add contention (a 32-wide linear takes 100x longer on a busy
    2-core machine with 2 threads); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


REL = 1e-4  # relative logits tolerance against eager (the acceptance figure)
VOCAB = 101


def _common(**extra):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    base.update(extra)
    return base


def _configs():
    T = transformers
    gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1)
    return {
        "llama": lambda: T.LlamaConfig(**_common(num_key_value_heads=2)),
        "mistral": lambda: T.MistralConfig(**_common(num_key_value_heads=2, sliding_window=6)),
        "qwen2": lambda: T.Qwen2Config(**_common(num_key_value_heads=2)),
        "qwen3": lambda: T.Qwen3Config(**_common(num_key_value_heads=2, head_dim=8)),
        "gemma": lambda: T.GemmaConfig(**_common(num_key_value_heads=1, head_dim=8)),
        "gemma2": lambda: T.Gemma2Config(
            **_common(num_key_value_heads=2, head_dim=8, sliding_window=6, attn_logit_softcapping=2.0)
        ),
        "gpt_oss": lambda: T.GptOssConfig(
            **_common(num_key_value_heads=2, head_dim=8, sliding_window=6, num_local_experts=4),
            num_experts_per_tok=2,
        ),
        "gpt2": lambda: T.GPT2Config(**gpt2),
        "phi": lambda: T.PhiConfig(**_common(partial_rotary_factor=0.5)),
        "gpt_neox": lambda: T.GPTNeoXConfig(**_common(rotary_pct=0.25)),
        "stablelm": lambda: T.StableLmConfig(**_common(num_key_value_heads=2, partial_rotary_factor=0.25)),
        "starcoder2": lambda: T.Starcoder2Config(**_common(num_key_value_heads=2, sliding_window=6)),
        "olmo": lambda: T.OlmoConfig(**_common()),
    }


DECODERS = list(_configs())


def _model(name: str, impl: str = "eager"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[name](), attn_implementation=impl)
    if name == "gpt_oss":  # sinks start near 0; give them weight so dropping them shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.eval()


def _batch(n: int = 10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, n), generator=g)  # (B, N)
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding on row 1
    ids[1, :3] = 0
    return ids, am


def _rel(out: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    """Max relative difference over real tokens only: a padded query row sees no key, where multihead
    returns zeros and eager a uniform average of the (padded) values."""
    return float((out - ref)[real].abs().max() / ref[real].abs().max())


def _logits(model, impl: str, ids, am):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).logits


def _greedy(model, impl: str, ids, am, cache: str):
    model.set_attn_implementation(impl)
    kw = {"cache_implementation": cache, "disable_compile": True} if cache == "static" else {}
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=am, max_new_tokens=16, do_sample=False, pad_token_id=0, **kw
        )


NO_STATIC: set[str] = set()  # families whose transformers code path takes no StaticCache


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_matches_eager(name):
    model = _model(name)
    ids, am = _batch()
    ref = _logits(model, "eager", ids, am)
    before = FN.calls
    out = _logits(model, "multihead", ids, am)
    assert FN.calls - before == model.config.num_hidden_layers, "every layer must run through multihead"
    assert _rel(out, ref, am.bool()) <= REL
    for cache in ("dynamic",) if name in NO_STATIC else ("dynamic", "static"):
        want = _greedy(model, "eager", ids, am, cache)
        got = _greedy(model, "multihead", ids, am, cache)
        assert torch.equal(want, got), f"{name} greedy tokens differ with the {cache} cache"


def _drop(what: str):
    """A broken adapter for the negative control: runs mh.attention without the mask or the sinks."""
    good = mhf.make_attention_function()

    def broken(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        if what == "mask":
            attention_mask = HFMask(None, key.shape[2], key.shape[2], query.shape[2])
        else:
            kw.pop("s_aux", None)
        return good(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kw)

    transformers.AttentionInterface.register(f"mh_drop_{what}", broken)
    transformers.masking_utils.AttentionMaskInterface.register(f"mh_drop_{what}", mask_interface)
    return f"mh_drop_{what}"


@pytest.mark.parametrize(("name", "what"), [("llama", "mask"), ("mistral", "mask"), ("gpt_oss", "sinks")])
def test_negative_control_fails(name, what):
    model = _model(name)
    ids, am = _batch()
    ref = _logits(model, "eager", ids, am)
    bad = _logits(model, _drop(what), ids, am)
    assert _rel(bad, ref, am.bool()) > 100 * REL, "the comparison must catch a dropped mask / sinks"


def test_packed_sequences_restarting_positions():
    model = _model("mistral")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, 14), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 0, 1, 2]])  # three packed documents
    outs = {}
    for impl in ("eager", "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert _rel(outs["multihead"], outs["eager"], torch.ones(1, 14, dtype=torch.bool)) <= REL
    with torch.no_grad():  # and each document alone gives the same logits
        alone = model(input_ids=ids[:, 8:11], use_cache=False).logits
    assert torch.allclose(alone, outs["multihead"][:, 8:11], atol=1e-5, rtol=1e-4)


def test_bert_encoder_matches_eager():
    T = transformers
    cfg = T.BertConfig(**_common(), type_vocab_size=2)
    torch.manual_seed(0)
    model = T.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    ids, _ = _batch()
    am = torch.ones_like(ids)
    am[1, -4:] = 0  # right padding
    ref = _logits_hidden(model, "eager", ids, am)
    before = FN.calls
    out = _logits_hidden(model, "multihead", ids, am)
    assert FN.calls - before == 2
    assert _rel(out, ref, am.bool()) <= REL


def _logits_hidden(model, impl, ids, am):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).last_hidden_state


def test_bart_encoder_decoder_cross_attention():
    T = transformers
    cfg = T.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = T.AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="eager").eval()
    ids, _ = _batch()
    am = torch.ones_like(ids)
    am[1, -3:] = 0
    dec = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    outs = {}
    for impl in ("eager", "multihead"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    assert _rel(outs["multihead"], outs["eager"], torch.ones(2, 5, dtype=torch.bool)) <= REL
    gen = {}
    for impl in ("eager", "multihead"):
        model.set_attn_implementation(impl)
        before = FN.calls
        with torch.no_grad():
            gen[impl] = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=16, do_sample=False)
    assert FN.calls > before
    assert torch.equal(gen["eager"], gen["multihead"])


# -- the masks: multihead's reading of transformers' mask functions equals transformers' dense mask --
def _dense(hf: HFMask, B: int) -> torch.Tensor:
    out = torch.zeros(B, 1, hf.q_length, hf.kv_length, dtype=torch.bool)
    if hf.mask is None:
        out[..., : hf.keep] = True
    else:
        out[..., : hf.keep] = hf.mask.dense(B, 1, hf.q_length, hf.keep)
    return out


def _cases():
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :4] = False
    lp = torch.tensor([0, 4])
    packed = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    sw = mu.sliding_window_causal_mask_function(3)
    return {  # name: (kwargs, structured: the reading must not fall back to evaluating a closure)
        "causal": (dict(q_length=6, kv_length=6), True),
        "causal_padded": (dict(q_length=12, kv_length=12, attention_mask=pad), True),
        "decode_dynamic": (dict(q_length=1, kv_length=12, q_offset=11, attention_mask=pad), True),
        "static_prefill": (dict(q_length=8, kv_length=12, attention_mask=pad[:, :8]), True),
        "static_decode": (dict(q_length=1, kv_length=12, q_offset=9, attention_mask=pad[:, :10]), True),
        "window": (dict(q_length=12, kv_length=12, mask_function=sw, attention_mask=pad), True),
        "window_cache": (dict(q_length=1, kv_length=3, q_offset=11, kv_offset=9, mask_function=sw), True),
        "window_static": (dict(q_length=4, kv_length=6, q_offset=0, mask_function=sw), True),
        "bidirectional": (
            dict(q_length=12, kv_length=12, mask_function=mu.bidirectional_mask_function),
            True,
        ),
        "bidir_padded": (
            dict(q_length=12, kv_length=12, mask_function=mu.bidirectional_mask_function, attention_mask=pad),
            True,
        ),
        "cross": (dict(q_length=3, kv_length=12, mask_function=mu.bidirectional_mask_function), True),
        "packed": (
            dict(
                q_length=8,
                kv_length=8,
                mask_function=mu.and_masks(
                    mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
                    mu.packed_sequence_mask_function(packed),
                ),
            ),
            True,
        ),
        "chunked": (
            dict(q_length=12, kv_length=12, mask_function=mu.chunked_causal_mask_function(4, lp)),
            False,
        ),
        "unknown": (
            dict(q_length=7, kv_length=9, q_offset=2, mask_function=lambda b, h, q, k: (q + k) % 3 > 0),
            False,
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_mask_reading_equals_transformers_dense_mask(case):
    kwargs, structured = _cases()[case]
    B = 2
    want = mu.sdpa_mask(batch_size=B, allow_is_causal_skip=False, **kwargs)  # (B, 1, Nq, Nk) bool
    got = mask_interface(batch_size=B, **kwargs)
    assert isinstance(got, HFMask)
    assert torch.equal(_dense(got, B), want.expand(B, 1, -1, -1))
    assert ("custom" not in repr(got.mask)) == structured, repr(got)


def test_static_cache_keys_past_the_prompt_are_dropped():
    got = mask_interface(batch_size=1, q_length=2, kv_length=32, q_offset=8)
    assert got.keep == 10 and repr(got.mask) == "causal()"  # bottom-right over the kept keys
    step = mask_interface(batch_size=1, q_length=1, kv_length=32, q_offset=9)
    assert step.keep == 10 and step.mask is None  # one new token sees every kept key: no mask at all
    k = torch.zeros(1, 2, 32, 8)
    k2, _, _ = got.apply(k, k)
    assert k2.shape[2] == 10
    with pytest.raises(ValueError, match="kv_length=32"):
        got.apply(k[:, :, :31], k[:, :, :31])


def test_register_rejects_bad_names_and_options():
    with pytest.raises(ValueError, match="sdpa"):
        mhf.register("sdpa")
    with pytest.raises(ValueError, match="approx"):
        mhf.register("mh_x", backend="tiled", approx=mh.approx.TopK(4))


def test_output_attentions_falls_back_with_a_warning():
    model = _model("llama")
    ids, am = _batch()
    model.set_attn_implementation("multihead")
    with pytest.warns(UserWarning, match="matrix"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, output_attentions=True)
    assert out.attentions is not None and out.attentions[0].shape == (2, 4, 10, 10)


def test_training_backward_with_sinks_and_softcap():
    for name in ("gpt_oss", "gemma2"):
        model = _model(name)
        ids, _ = _batch()
        am = torch.ones_like(ids)  # no padding: the loss would read logits of padded rows
        grads = {}
        for impl in ("eager", "multihead"):
            model.zero_grad()
            model.set_attn_implementation(impl)
            out = model(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
            out.loss.backward()
            grads[impl] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        err = float((grads["multihead"] - grads["eager"]).abs().max() / grads["eager"].abs().max())
        assert err <= 1e-4, f"{name}: q_proj gradient differs by {err:.2e} (relative)"


def test_approximation_under_its_own_name():
    fn = mhf.register("mh_topk_test", approx=mh.approx.TopK(4))
    model = _model("llama")
    ids, am = _batch()
    exact = _logits(model, "multihead", ids, am)
    before = fn.calls
    approx = _logits(model, "mh_topk_test", ids, am)
    assert fn.calls - before == 2
    assert torch.isfinite(approx[am.bool()]).all()
    assert _rel(approx, exact, am.bool()) > REL  # top-4 of up to 10 keys is not exact attention


def test_bf16_error_within_twice_eager_bf16_error():
    model = _model("mistral")
    ids, am = _batch()
    real = am.bool()
    gold = _logits(model, "eager", ids, am).double()  # fp32 eager as the reference
    model.to(torch.bfloat16)
    eager = _logits(model, "eager", ids, am).double()
    ours = _logits(model, "multihead", ids, am).double()
    base = max((eager - gold)[real].abs().max().item(), 1e-5)
    assert (ours - gold)[real].abs().max().item() <= 2 * base


def test_import_multihead_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, multihead, multihead.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decode_step_fast_path_is_exact_and_counted(monkeypatch):
    """A one-row step that sees every key skips the Problem and goes to the decode kernel call: the same
    output as the reference backend (GQA folded, a static cache's unused slots dropped), still counted."""
    import multihead.hf.attention as hf_attention
    from multihead.backends import decode

    taken = []

    def spy(q, k, v, scale):
        out = decode.unmasked_step(q, k, v, scale)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(hf_attention, "unmasked_step", spy)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 8, generator=g)  # (B, Hq, 1, D)
    k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(2))  # (B, Hkv, 40, D): G = 2
    before = FN.calls
    for keep, scaling in ((40, None), (25, 0.3)):  # keep < 40: a static cache's slots past the prompt
        out, weights = FN(torch.nn.Module(), q, k, v, HFMask(None, keep, 40, 1), scaling=scaling)
        ref = mh.attention(q, k[:, :, :keep], v[:, :, :keep], scale=scaling, backend="reference")
        assert weights is None and out.shape == (2, 1, 6, 8) and out.is_contiguous()
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    assert taken == [True, True] and FN.calls - before == 2
    # a mask left to apply, a soft-cap or weights asked for: the general path, never the fast one
    FN(torch.nn.Module(), q, k, v, HFMask(mh.sliding_window(8), 40, 40, 1))
    FN(torch.nn.Module(), q, k, v, HFMask(None, 40, 40, 1), softcap=2.0)
    assert taken == [True, True]


def test_unpadded_greedy_decode_matches_eager_through_the_fast_path():
    """No padding and a dynamic cache: every decode step runs the fast path (GQA llama, windowed mistral
    inside its window and past it) and the tokens and step logits equal eager's."""
    for name in ("llama", "mistral"):
        model = _model(name)
        ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))  # (B, N)
        am = torch.ones_like(ids)
        runs = {}
        for impl in ("eager", "multihead"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                runs[impl] = model.generate(
                    input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
        assert torch.equal(runs["eager"].sequences, runs["multihead"].sequences), name
        for a, b in zip(runs["eager"].logits, runs["multihead"].logits):
            assert float((a - b).abs().max() / a.abs().max()) <= REL, name
