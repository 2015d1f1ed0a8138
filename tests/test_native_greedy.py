"""Native greedy runs (multihead.models.native_greedy.greedy_steps): several greedy tokens per native call
give the tokens, caches and states of the step-by-step loop, ties and NaNs picked as torch's argmax,
and the step-by-step loop wherever the run does not apply."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

import multihead as mh
from multihead import native
from multihead.models import generation, native_greedy, quant
from multihead.models.gemv_linear import GemvLinear
from tests.native_builds import built_for
from tests.native_counts import count_native_steps

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
F16 = pytest.mark.skipif(
    REASON is None and torch.float16 not in native.dtypes(), reason="this build has no fp16 kernels"
)
FP32 = ("fp32", None, None)
WEIGHTS = [
    pytest.param(FP32, id="fp32"),
    pytest.param(("bf16", None, None), id="bf16"),
    pytest.param(("fp16", None, None), id="fp16", marks=F16),
    pytest.param(("int8", 32, "int8"), id="int8-g32-int8-cache"),
    pytest.param(("int8", None, None), id="int8-per-row"),
]


def _lm(seed=0, vocab=300):
    torch.manual_seed(seed)
    lm = mh.TransformerLM(vocab, 64, 2, 4, 96, n_kv_heads=2, norm_eps=1e-6).eval()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, mh.nn.norms.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return lm


def _quantized(lm, spec):
    weights, group, kv = spec
    extra = {"group_size": group} if weights == "int8" else {}
    q = quant.quantize(lm, weights=weights, kv=kv, kernel="native", **extra)
    assert q.why_not_native_steps is None
    return q


def _step_by_step(model, monkeypatch):
    """The same model with the loop's native greedy run turned off (each token: head, argmax, one step)."""
    monkeypatch.setattr(model, "greedy_steps", lambda *args: None, raising=False)


PROMPT = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("spec", WEIGHTS)
def test_greedy_runs_give_the_step_by_step_tokens(spec, monkeypatch):
    model = _quantized(_lm(), spec)
    steps = count_native_steps(monkeypatch)
    lengths = (1, 2, generation.GREEDY_CHUNK, generation.GREEDY_CHUNK + 1, 2 * generation.GREEDY_CHUNK + 3)
    with torch.no_grad():
        fast = [model.generate(PROMPT, n) for n in lengths]
        assert len(steps) == sum(n - 1 for n in lengths)  # every step after the prefill ran natively
        eos = int(fast[-1][0, 11 + 5])  # a token the run meets at its 6th pick
        fast_eos = model.generate(PROMPT, 19, eos_token_id=eos)
        fast_never = model.generate(PROMPT, 9, eos_token_id=305)  # outside the vocabulary: never picked
        runs = len(steps)
        _step_by_step(model, monkeypatch)
        slow = [model.generate(PROMPT, n) for n in lengths]
        slow_eos = model.generate(PROMPT, 19, eos_token_id=eos)
        assert (
            torch.equal(fast_never, model.generate(PROMPT, 9, eos_token_id=305)) and fast_never.shape[1] == 20
        )
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert torch.equal(fast_eos, slow_eos) and int(fast_eos[0, -1]) == eos
    assert fast_eos.shape[1] <= 11 + 6  # stopped at the first eos
    assert len(steps) - runs == sum(n - 1 for n in lengths) + fast_eos.shape[1] - 12 + 8  # decode_step each


def test_a_streamer_sees_the_first_token_after_one_token_run(monkeypatch):
    """With a streamer the native runs pick 1, 2, 4, then GREEDY_CHUNK tokens, and the tokens are those
    of the runs without it."""
    model = _quantized(_lm(), FP32)
    asked: list[int] = []
    run = model.greedy_steps
    monkeypatch.setattr(
        model, "greedy_steps", lambda h, out, t, n, *a: asked.append(n) or run(h, out, t, n, *a)
    )
    seen: list[int] = []
    with torch.no_grad():
        streamed = model.generate(PROMPT, 20, eos_token_id=[], streamer=lambda tok: seen.append(int(tok)))
        assert asked == [1, 2, 4, 8, 5] and seen == streamed[0, 11:].tolist()
        asked.clear()
        assert torch.equal(streamed, model.generate(PROMPT, 20, eos_token_id=[])) and asked == [8, 8, 4]


@pytest.mark.parametrize("spec", WEIGHTS[:2] + WEIGHTS[3:4])
def test_a_greedy_run_leaves_the_caches_and_state_of_the_steps(spec):
    model = _quantized(_lm(), spec)
    kind = spec[2] or "dense"
    with torch.no_grad():
        cache = model.make_cache(1, 40, kind)
        h = model.hidden_states(PROMPT, cache=cache)
        out = torch.zeros(1, 30, dtype=torch.long)
        picked, state = model.greedy_steps(h, out, 3, 6, False, None, cache)  # not the last: 6 steps too
        assert picked == 6 and cache[0].position == 11 + 6 and state.shape == (1, 1, 64)
        ref_cache = model.make_cache(1, 40, kind)
        ref = model.hidden_states(PROMPT, cache=ref_cache)
        for i in range(6):
            token = generation.pick_next(model.lm_head(ref[:, -1]), False, 1.0, None, None)
            assert int(token) == int(out[0, 3 + i])
            ref = model.hidden_states(token.view(1, 1), cache=ref_cache)
    assert torch.equal(out[0, :3], torch.zeros(3, dtype=torch.long)) and torch.equal(state, ref)
    for a, b in zip(cache, ref_cache):
        assert a.position == b.position
        assert torch.equal(a.k[:, :, : a.position], b.k[:, :, : b.position])
        assert torch.equal(a.v[:, :, : a.position], b.v[:, :, : b.position])


@pytest.mark.parametrize("spec", [WEIGHTS[0], WEIGHTS[3]])  # a float head, an int8 one
def test_ties_and_nans_are_picked_as_torch_argmax(spec, monkeypatch):
    lm = _lm()
    with torch.no_grad():  # an untied head whose logits are its bias: two tied maxima, at 5 and 9
        lm.lm_head = GemvLinear(64, 300, bias=True)
        lm.lm_head.weight.zero_()
        lm.lm_head.bias.zero_()
        lm.lm_head.bias[[5, 9]] = 1.0
    model = _quantized(lm, spec)
    assert native_greedy.why_not_greedy(model) is None
    with torch.no_grad():
        tied = model.generate(PROMPT, 10)
        model.lm_head.bias[7] = float("nan")  # a NaN counts as the maximum
        model.lm_head.bias[12] = float("nan")
        nan = model.generate(PROMPT, 10)
        _step_by_step(model, monkeypatch)
        nan_steps = model.generate(PROMPT, 10)
        model.lm_head.bias[[7, 12]] = 0.0
        tied_steps = model.generate(PROMPT, 10)
    assert torch.equal(tied[0, 11:], torch.full((10,), 5)) and torch.equal(tied, tied_steps)
    assert torch.equal(nan[0, 11:], torch.full((10,), 7)) and torch.equal(nan, nan_steps)


# logits (the head's bias, 300 values: 18 whole blocks of 16 and 12 past them) and the token they give:
# the first maximum (ties in different blocks, in the values past the whole blocks, at a block's edge),
# the first NaN wherever it lies, and all values equal
ARGMAX = {
    "tail": ({299: 2.0, 3: 1.0}, 299),
    "tie-across-blocks": ({20: 1.5, 290: 1.5, 100: 1.5}, 20),
    "block-edge": ({16: 1.0, 15: 0.5, 31: 1.0}, 16),
    "nan-in-tail": ({3: 9.0, 295: float("nan")}, 295),
    "nan-after-max": ({3: 9.0, 40: float("nan"), 41: float("nan")}, 40),
    "all-equal": ({}, 0),
    "first-is-max": ({0: 3.0, 150: 3.0}, 0),
}


@pytest.mark.parametrize("case", list(ARGMAX))
@pytest.mark.parametrize("spec", [WEIGHTS[0], WEIGHTS[1], WEIGHTS[2], WEIGHTS[4]])  # fp32, 16-bit, int8 heads
def test_the_run_picks_torch_argmax_of_every_shape_of_logits(spec, case, monkeypatch):
    lm = _lm()
    with torch.no_grad():  # an untied head whose logits are its bias (300 values), the rest -1
        lm.lm_head = GemvLinear(64, 300, bias=True)
        lm.lm_head.weight.zero_()
        lm.lm_head.bias.fill_(-1.0)
    model = _quantized(lm, spec)
    values, want = ARGMAX[case]
    with torch.no_grad():
        for i, value in values.items():
            model.lm_head.bias[i] = value
        assert int(torch.argmax(model.lm_head.bias.float())) == want  # the premise: torch's first maximum
        run = model.generate(PROMPT, 4)
        _step_by_step(model, monkeypatch)
        steps = model.generate(PROMPT, 4)
    assert torch.equal(run[0, 11:], torch.full((4,), want)) and torch.equal(run, steps)


def test_an_avx2_build_s_run_picks_torch_argmax_too(monkeypatch):
    """The argmax without AVX-512 (one value at a time) on the same shapes of logits, fp32 and bf16 heads."""
    with built_for("x86-64-v3", "avx2", monkeypatch):
        assert native.unavailable() is None
        for spec in (FP32, ("bf16", None, None)):
            lm = _lm()
            with torch.no_grad():
                lm.lm_head = GemvLinear(64, 300, bias=True)
                lm.lm_head.weight.zero_()
                lm.lm_head.bias.fill_(-1.0)
            model = _quantized(lm, spec)
            assert native_greedy.why_not_greedy(model) is None  # the native run, its argmax without AVX-512
            for values, want in ARGMAX.values():
                with torch.no_grad():
                    model.lm_head.bias.fill_(-1.0)
                    for i, value in values.items():
                        model.lm_head.bias[i] = value
                    run = model.generate(PROMPT, 2)
                assert run[0, 11:].tolist() == [want, want], (spec, values)


def test_calls_and_models_the_run_leaves_to_the_step_by_step_loop(monkeypatch):
    model = _quantized(_lm(), FP32)
    runs = []
    real = native_greedy.greedy_steps
    monkeypatch.setattr(native_greedy, "greedy_steps", lambda *a: runs.append(1) or real(*a))
    two = torch.cat([PROMPT, PROMPT.flip(1)])
    padded = torch.ones(1, 11, dtype=torch.long)
    padded[0, 0] = 0
    with torch.no_grad():
        model.generate(PROMPT, 5, do_sample=True, top_k=5)  # sampling
        model.generate(two, 5)  # two rows
        model.generate(PROMPT, 5, attention_mask=padded)  # padding
        generation.generate(model, PROMPT, 5, cache=None)  # no cache
        assert runs == []
        model.generate(PROMPT, 5, attention_mask=torch.ones(1, 11, dtype=torch.long))  # a mask of ones
        assert runs == [1]
        want = model.generate(PROMPT, 9)  # two runs: 8 tokens, then the last
        assert len(runs) == 3
        head = nn.Linear(64, 300, bias=False)  # a head of another type: native steps, torch's head
        head.weight = model.lm_head.weight
        model.lm_head = head
        assert "not a GemvLinear" in native_greedy.why_not_greedy(model)
        assert torch.equal(model.generate(PROMPT, 9), want) and len(runs) == 3


def test_a_hook_on_the_output_head_is_honoured(monkeypatch):
    fast, slow = _quantized(_lm(), FP32), _quantized(_lm(), FP32)
    slow.native_steps = False
    steps = count_native_steps(monkeypatch)
    with torch.no_grad():
        before = fast.generate(PROMPT, 9)
        flip = lambda m, args, out: -out  # noqa: E731  the least likely token instead
        with fast.lm_head.register_forward_hook(flip), slow.lm_head.register_forward_hook(flip):
            assert "forward hooks" in native_greedy.why_not_greedy(fast)
            hooked = fast.generate(PROMPT, 9)
            assert len(steps) == 16  # the layers still step natively, one call a token
            assert torch.equal(hooked, slow.generate(PROMPT, 9)) and not torch.equal(hooked, before)
        assert torch.equal(fast.generate(PROMPT, 9), before)


def test_a_failed_run_advances_the_caches_that_were_written(monkeypatch):
    model = _quantized(_lm(), FP32)
    real = native.library()

    class TwoStepsThenOneLayer:  # the library's answer when the third step's second layer finds no memory
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def mh_decode_greedy(*args):
            ids, picked, stepped, done = args[-4:]
            ctypes.memmove(ids, (ctypes.c_int64 * 3)(4, 5, 6), 24)
            picked._obj.value, stepped._obj.value, done._obj.value = 3, 2, 1
            return -1

    with torch.no_grad():
        cache = model.make_cache(1, 30)
        h = model.hidden_states(PROMPT, cache=cache)
        out = torch.zeros(1, 20, dtype=torch.long)
        monkeypatch.setattr(native, "library", lambda: TwoStepsThenOneLayer())
        with pytest.raises(ValueError, match="could not allocate"):
            model.greedy_steps(h, out, 0, 8, False, None, cache)
    assert [kv.position for kv in cache] == [11 + 3, 11 + 2] and out[0, :4].tolist() == [4, 5, 6, 0]
