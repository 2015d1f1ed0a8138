"""The text LM's decode speed, ``multihead encode``'s texts/s and the remaining scripts in benchmarks/ time
through the timing helper: each driven with a fake clock (zero, tiny, huge durations) and stand-ins, so
no real timing and no heavy model runs."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.clocks import FakeClock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

ZERO_TINY_HUGE = pytest.mark.parametrize(
    ("per_call", "tick", "ok"),
    [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.01, 0.0, True), (1e6, 0.0, True)],
    ids=["zero", "tiny", "10ms", "huge"],
)


def _clock(per_call: float, tick: float = 0.0) -> FakeClock:
    """A clock that moves only with the calls it times (and 1 ns a read where the calls take time)."""
    return FakeClock(per_call, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick)


@ZERO_TINY_HUGE
def test_text_lm_decode_rate_or_too_short(per_call, tick, ok, monkeypatch):
    from multihead.study.sections import designs
    from multihead.train import text

    c = _clock(per_call, tick)
    monkeypatch.setattr(text, "generate", lambda *a, **kw: c.fn())
    t = text.decode_timing(None, torch.zeros(1, 4), 32, "dense", clock=c)  # type: ignore[arg-type]
    rate = t.rate(32)
    if ok:  # every generate of 32 tokens costs per_call
        assert rate == pytest.approx(32 / per_call, rel=1e-3) and t.samples >= 3
    else:
        assert rate is None and t.why.startswith("too short to measure")
    row = {"design": "mha", "bits_per_byte": 2.0, "decode_tok_s": rate, "decode_cached": True,
           "kv_bytes_per_token": 8, "first_token_share": None, "params": 10, "seconds": 1.0}  # fmt: skip
    cell = designs._text_table([row], text.TextConfig()).rows[0][2]
    assert cell == (f"{32 / per_call:,.0f}" if ok else "too short to measure")


class FakeEncoder:
    def __init__(self, clock: FakeClock):
        self.clock = clock

    def encode(self, texts, **kw):
        self.clock.fn()
        return torch.ones(len(texts), 4)  # (n, 4)


@ZERO_TINY_HUGE
def test_encode_command_rate_or_too_short(per_call, tick, ok):
    from multihead.cli import encode

    c = _clock(per_call, tick)
    args = argparse.Namespace(batch_size=32, packing=None)
    emb, took = encode._embed(args, FakeEncoder(c), ["a", "b"], clock=c)  # type: ignore[arg-type]
    assert emb.shape == (2, 4) and c.calls == 1  # the real work is never repeated
    fields, said = encode.speed(2, took)
    if ok:
        assert fields["docs_per_s"] == pytest.approx(2 / per_call, rel=1e-3)
        assert fields["seconds"] == pytest.approx(per_call, rel=1e-3) and "texts/s" in said
    else:
        assert fields == {"seconds": None, "docs_per_s": None}
        assert said == "; texts/s: too short to measure"


class FakeAttention(nn.Module):
    """A layer whose every call costs ``cost`` fake calls of ``clock``."""

    def __init__(self, clock: FakeClock, cost: int):
        super().__init__()
        self.clock, self.cost = clock, cost

    def forward(self, x, mask=None, cache=None):
        for _ in range(self.cost):
            self.clock.fn()
        return x


@ZERO_TINY_HUGE
def test_designs_speed_rates_and_ratios(per_call, tick, ok):
    import designs_speed

    c = _clock(per_call, tick)
    modules = {"mha": FakeAttention(c, 1), "twice": FakeAttention(c, 2), "same": FakeAttention(c, 1)}
    fwd, dec = designs_speed.timings(modules, torch.zeros(1, 8, 4), 3, 2, 3, clock=c)  # type: ignore[arg-type]
    if ok:  # a forward costs one call, a decode 3 steps of one call each (twice: 2)
        assert fwd["mha"].rate(8) == pytest.approx(8 / per_call, rel=1e-3)
        assert dec["twice"].rate(3) == pytest.approx(0.5 / per_call, rel=1e-3)
        assert designs_speed._vs(dec["twice"], dec["mha"]) == "0.50x"
        assert designs_speed._vs(fwd["same"], fwd["mha"]) == "same within noise"
    else:
        assert designs_speed._rate(dec["mha"], 3) == designs_speed._vs(fwd["twice"], fwd["mha"])
        assert designs_speed._rate(dec["mha"], 3) == "too short to measure"


@ZERO_TINY_HUGE
def test_masked_garbage_ratio_or_too_short(per_call, tick, ok, monkeypatch):
    import masked_garbage

    import multihead as mh
    import multihead.core.functional as functional

    c = _clock(per_call, tick)

    def attention(q, k, v, mask=None):  # the clearing on costs a second call
        c.fn()
        if functional.clear_dead_keys is masked_garbage.clear_dead_keys:
            c.fn()

    monkeypatch.setattr(mh, "attention", attention)
    rows = masked_garbage.timings({"case": (None, None, None, None)}, 3, clock=c)
    r = rows["case"]
    assert functional.clear_dead_keys is masked_garbage.clear_dead_keys  # put back
    if ok:
        assert r["on_ms"] == pytest.approx(2e3 * per_call, rel=1e-3) and r["text"] == "2.00x"
    else:
        assert r["on_ms"] is None and r["ratio"] is None and r["text"] == "too short to measure"
        assert r["why"].startswith("too short to measure")


@ZERO_TINY_HUGE
def test_surgery_recover_seconds_once(per_call, tick, ok):
    import surgery_quality

    c = _clock(per_call, tick)
    secs = surgery_quality.recover_seconds(c.fn, clock=c)
    assert c.calls == 1  # training is never repeated
    assert secs == (pytest.approx(per_call, rel=1e-3) if ok else None)


class FakeLM:
    """``generate(prompt, n)`` costs a prefill and n - 1 steps of ``per_call`` each."""

    def __init__(self, clock: FakeClock):
        self.clock = clock

    def generate(self, prompt, n):
        for _ in range(n):
            self.clock.fn()


@ZERO_TINY_HUGE
def test_llamacpp_our_rate_or_nan(per_call, tick, ok):
    import llamacpp_decode

    c = _clock(per_call, tick)
    rate = llamacpp_decode.our_rate(FakeLM(c), torch.zeros(1, 4), 9, clock=c)  # type: ignore[arg-type]
    if ok:  # (9 - 1) tokens in 8 steps of per_call
        assert rate == pytest.approx(1 / per_call, rel=1e-3)
    else:
        assert math.isnan(rate) and llamacpp_decode._median_rate([rate]) is None
        assert llamacpp_decode._cell(None, "5.2f", "x") == "too short to measure"


class FakeCache:
    def __init__(self):
        self.position = 0

    def reset(self):
        self.position = 0

    def advance(self, n):
        self.position += n


class FakeGreedyLM:
    """A model with native greedy runs: the prefill is free, each greedy token costs ``per_call``; records
    where each run started."""

    def __init__(self, clock: FakeClock, decline: bool = False):
        self.clock, self.decline, self.starts = clock, decline, []

    def make_cache(self, batch, max_len, kind):
        return [FakeCache(), FakeCache()]

    def hidden_states(self, ids, cache):
        for kv in cache:
            kv.advance(ids.shape[1])
        return torch.zeros(1, ids.shape[1], 8)

    def greedy_steps(self, h, out, t, steps, last, eos, cache):
        if self.decline:
            return None
        assert all(kv.position == t for kv in cache)  # rewound to the prompt's end
        self.starts.append(t)
        for _ in range(steps):
            self.clock.fn()
        for kv in cache:
            kv.advance(steps)
        return steps, h

    def generate(self, prompt, n):  # the route a declining model takes
        for _ in range(n):
            self.clock.fn()


@ZERO_TINY_HUGE
def test_llamacpp_our_rate_times_decoding_from_a_filled_cache(per_call, tick, ok):
    """As llama-bench -d: the prompt fills the cache once, every sample decodes 9 tokens from its end."""
    import llamacpp_decode

    c = _clock(per_call, tick)
    model = FakeGreedyLM(c)
    rate = llamacpp_decode.our_rate(model, torch.zeros(1, 4), 9, clock=c)  # type: ignore[arg-type]
    assert model.starts and set(model.starts) == {4}
    if ok:  # 9 tokens of per_call each
        assert rate == pytest.approx(1 / per_call, rel=1e-3)
    else:
        assert math.isnan(rate)
    c = _clock(per_call, tick)
    declining = FakeGreedyLM(c, decline=True)  # no native run: (9 - 1) / (t(9) - t(1)) of generate
    rate = llamacpp_decode.our_rate(declining, torch.zeros(1, 4), 9, clock=c)  # type: ignore[arg-type]
    assert not declining.starts
    assert rate == pytest.approx(1 / per_call, rel=1e-3) if ok else math.isnan(rate)


def test_llamacpp_of_limit_pairs_each_run_with_its_own_probe():
    """A machine whose memory halves between runs: each run against its own minute's probe reads 80%;
    the rates' median over the best probe would read 60%. Unmeasurable runs drop out; none left: "-";
    above 100%: the refusal."""
    import llamacpp_decode

    rates, limits = [80.0, 40.0, 80.0, 40.0], [100.0, 50.0, 100.0, 50.0]
    assert llamacpp_decode.paired_limit_text(rates, limits) == "80%"
    assert llamacpp_decode.timing.limit_text(60.0, max(limits)) == "60%"  # one probe, the best
    assert llamacpp_decode.paired_limit_text([math.nan, 45.0], [100.0, 50.0]) == "90%"
    assert llamacpp_decode.paired_limit_text([math.nan], [100.0]) == "-"
    assert "above limit" in llamacpp_decode.paired_limit_text([120.0], [100.0])
    # "of GEMVs": a step against its products alone, each run with its own; a NaN on either side drops out
    text = llamacpp_decode.paired_limit_text([90.0, 30.0, 95.0], [100.0, math.nan, 100.0], "noise")
    assert text == "92%" and llamacpp_decode.paired_limit_text([101.0], [100.0], "noise") == "noise"


def test_llamacpp_meet_text_is_the_runs_range():
    import llamacpp_decode

    assert llamacpp_decode.meet_text([None, None]) == "-"
    assert llamacpp_decode.meet_text([52.4]) == "52"
    assert llamacpp_decode.meet_text([410.2, 52.4, None, 130.0]) == "52-410"


def test_llamacpp_gemvs_rate_times_the_products_of_a_native_model():
    """The products alone of a native int8 model: one native call of every linear layer and the head,
    a finite rate above the whole step's (the step does more)."""
    import llamacpp_decode

    import multihead as mh
    from multihead import native
    from multihead.models import quant

    if native.unavailable() is not None:
        pytest.skip(f"native kernels unavailable: {native.unavailable()}")
    torch.manual_seed(0)
    model = quant.quantize(mh.pretrained.random_lm("llama-tiny"), **llamacpp_decode.PRECISIONS["q8_0"][0])
    rate = llamacpp_decode.gemvs_rate(model, llamacpp_decode.ACTIVATIONS["q8_0"])
    assert math.isfinite(rate) and rate > 0
    prompt = torch.randint(4, 100, (1, 16))  # (1, 16)
    with torch.inference_mode():
        assert llamacpp_decode._filled_cache_run(model, prompt, 9) is not None  # timed as llama-bench -d
        step = llamacpp_decode.our_rate(model, prompt, 9)
    assert not math.isfinite(step) or step < 2 * rate  # a step is never much faster than its products


def test_attention_speed_markdown_keeps_noise_and_too_short_apart():
    import attention_speed

    row = {"case": "dense", "n": 64, "gflops": 1.0, "matmul_frac": 0.5, "gbps": None, "peak_mib": 1.0}
    doc = {
        "machine": {"cpu": "x", "threads": 1, "torch": "t", "matmul_gflops": 2, "bandwidth_gbps": 1},
        "results": [
            {
                **row,
                "method": "auto",
                "note": "",
                "ms": 1.0,
                "ms_spread": [0.9, 1.1],
                "vs": {"sdpa": 1.02, "eager": 0.5},
                "vs_noise": {"sdpa": True, "eager": False},
            },
            {**row, "method": "tiled", "note": "too short to measure: 4096 calls took 0 s", "ms": None},
            {**row, "method": "flex", "note": "needs torch.compile", "ms": None},
        ],
        "goals": [
            {
                "goal": "auto <= sdpa",
                "case": "dense",
                "n": 64,
                "value": 1.02,
                "within_noise": True,
                "met": True,
            }
        ],
    }
    md = attention_speed.markdown(doc)
    assert "sdpa same within noise, eager 0.50x" in md and "1.02x" not in md
    assert "| 1.0 (0.9-1.1) |" in md
    assert "| tiled | too short to measure: too short" in md and "| flex | skipped: needs" in md
    assert "| dense | 64 | same within noise |" in md
