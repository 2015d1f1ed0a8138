"""What reaches ``mh.attention`` from Hugging Face models: predicates with analytic tile kinds, never dense
masks, so that ``auto`` can send each call to a fused kernel (SDPA's flash or our own) on a GPU.

Recorded on the CPU with tiny random-weight models in prefill, training, and greedy decoding with dynamic
and static caches; the recorder calls the real attention, so the outputs are also checked against
transformers' own attention.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the oracle of the HF backend tests"
)

import multihead.hf as mhf  # noqa: E402
from multihead.core.biases import Bias  # noqa: E402
from multihead.core.masks import Custom, Mask, MaskContext, TensorMask  # noqa: E402
from multihead.core.tiles import classify  # noqa: E402
from multihead.hf import attention as hf_attention  # noqa: E402

mhf.register()
VOCAB = 101


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def calls(monkeypatch):
    """Every call multihead's HF attention function makes to ``mh.attention`` or, for a decode step that
    sees every key, to the decode kernel's unmasked step: (q, k, mask, bias, sinks, path)."""
    seen: list[dict] = []
    real, real_step = hf_attention.attention, hf_attention.unmasked_step

    def recording(q, k, v, *, mask=None, bias=None, sinks=None, **kw):
        seen.append(
            {"q": q.shape, "k": k.shape, "mask": mask, "bias": bias, "sinks": sinks, "path": "attention"}
        )
        return real(q, k, v, mask=mask, bias=bias, sinks=sinks, **kw)

    def recording_step(q, k, v, scale):
        out = real_step(q, k, v, scale)
        if out is not None:
            seen.append(
                {"q": q.shape, "k": k.shape, "mask": None, "bias": None, "sinks": None, "path": "step"}
            )
        return out

    monkeypatch.setattr(hf_attention, "attention", recording)
    monkeypatch.setattr(hf_attention, "unmasked_step", recording_step)
    return seen


def _config(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                  initializer_range=0.1)  # fmt: skip
    T = transformers
    if name == "mistral":
        return T.MistralConfig(**common, sliding_window=6)
    if name == "gemma2":
        return T.Gemma2Config(**common, sliding_window=6, attn_logit_softcapping=2.0)
    return T.GptOssConfig(**common, sliding_window=6, num_local_experts=4, num_experts_per_tok=2)


def _model(name: str, impl: str = "multihead"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=impl)
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.eval()


def _batch():
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))  # (B, N)
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding on row 1
    return ids, am


def _assert_predicates(seen: list[dict]) -> None:
    """Each mask is a predicate with analytic tile kinds (or none at all): no tensors, no closures."""
    assert seen
    for c in seen:
        m = c["mask"]
        if m is None:
            continue
        assert isinstance(m, Mask) and not _holds(m, (TensorMask, Custom)), repr(m)
        B, Hq, Nq, _ = c["q"]
        ctx = MaskContext(B, Hq, Nq, c["k"][2])
        assert classify(m, ctx, 16, 16, evaluate=False) is not None, f"{m!r} has no analytic tile kinds"


def _holds(m: Mask, kinds: tuple[type, ...]) -> bool:
    parts = [getattr(m, name) for name in ("a", "b") if isinstance(getattr(m, name, None), Mask)]
    return isinstance(m, kinds) or any(_holds(p, kinds) for p in parts)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_prefill_with_padding_reaches_attention_as_predicates(name, calls):
    model, ids, am = _model(name), *_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am).logits
    _assert_predicates(calls)
    assert any("sliding_window(6)" in repr(c["mask"]) for c in calls)  # the window is a parameter
    assert any("key_padding" in repr(c["mask"]) for c in calls)  # the padding a (B, Nk) predicate
    if name == "gemma2":
        assert all(isinstance(c["bias"], Bias) and "softcap" in repr(c["bias"]) for c in calls)
    if name == "gpt_oss":
        assert all(c["sinks"] is not None and c["sinks"].shape == (4,) for c in calls)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
    real = am.bool()
    assert float((got - want)[real].abs().max() / want[real].abs().max()) < 1e-4


def test_training_step_reaches_attention_as_predicates(calls):
    model, ids, _ = _model("mistral"), *_batch()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    _assert_predicates(calls)
    assert [repr(c["mask"]) for c in calls] == ["sliding_window(6)"] * 2
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_greedy_decoding_reaches_attention_as_predicates(name, cache, calls):
    model, ids, am = _model(name), *_batch()

    def kw():  # a static cache of 40 slots: 25 of them never written in this run
        if cache == "dynamic":
            return {}
        return {
            "cache": transformers.StaticCache(config=model.config, max_cache_len=40),
            "disable_compile": True,
        }

    with torch.no_grad():
        got = model.generate(
            input_ids=ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw()
        )
    _assert_predicates(calls)
    steps = [c for c in calls if c["q"][2] == 1]
    assert len(steps) == 2 * 4, "every layer of the 4 decode steps after the prefill was recorded"
    if name != "mistral":  # soft-cap and sinks take the general path on every step
        assert all(c["path"] == "attention" for c in steps)
    # a static cache's unused tail never reaches the kernel: at most prompt + generated keys
    assert all(c["k"][2] <= ids.shape[1] + 5 for c in calls)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(
            input_ids=ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw()
        )
    assert torch.equal(got, want)


def test_static_cache_generation_compiles_without_graph_breaks():
    # On a GPU transformers compiles the forward of static-cache generation by itself; multihead's
    # attention function must trace whole (no graph break, no recompilation per call) and stay exact.
    # Dynamo alone (backend "eager") on the CPU checks the tracing without inductor's compile time.
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model, ids, am = _model("mistral"), *_batch()
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True  # compile on the CPU as transformers does on a GPU
    torch._dynamo.reset()
    counters.clear()

    def generate(**kw):
        cache = transformers.StaticCache(config=model.config, max_cache_len=24)
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=am,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=0,
                cache=cache,
                **kw,
            )

    got = generate(compile_config=config)
    assert counters["stats"]["calls_captured"] > 0, "generation was not compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2
    model.set_attn_implementation("eager")
    assert torch.equal(got, generate(disable_compile=True))
    torch._dynamo.reset()
