"""``multihead bench decode``: decode speed per dtype against Hugging Face, and the bandwidth limit.

    multihead bench decode                                   # llama-20m, 256-token prompt, minutes
    multihead bench decode --preset llama-155m --threads 1 --rounds 3 --new-tokens 32

A LLaMA-shaped model with random weights is built once by transformers (``LlamaForCausalLM`` from the
preset's config) and converted with ``mh.pretrained.from_hf``, so both sides hold the same weights.
Contestants: multihead and transformers' ``generate`` in fp32, bf16 and fp16 (``model.to(dtype)``),
the "prepacked" rows: bf16 with oneDNN-prepacked linear weights (``mh.quant.quantize(model,
weights="bf16", kv=None, kernel="onednn")``: the same bf16 weights and results, a faster batch-1 kernel,
bf16 dense KV cache; plain ``F.linear`` where oneDNN lacks bf16, with the reason printed), the same for
fp32 (the fp32 weights in oneDNN's batch-1 layout, equal up to the order of the sums); the "native" rows
(``kernel="native"``: every decode step one native call for all the layers with the compiled GEMV,
:mod:`multihead.models.native_step`, rows split over the torch threads; ``F.linear`` and the eager
layers, with the reason printed, where the kernels cannot build); and ``mh.quant.quantize(model,
weights="int8", kv="int8", kernel="fbgemm")`` of the fp32 and of the bf16 model (int8 weights per output
channel, int8 KV cache); the "int8 native" rows: ``kernel="native"`` with one scale per output channel
or per group of 64 or 32 inputs (int8 activations per 32-block, int8 KV cache, every decode step one
native call per layer), with their logit error against the fp32 model along its greedy tokens
(:func:`int8_quality`). Greedy decoding; decode tokens/s excludes the prefill:
``(new - 1) / (t(new tokens) - t(1 token))``, each time the median of interleaved samples
(:mod:`multihead.bench.timing`: samples long enough for the clock and the scheduler, with their
spread); where the difference is inside the noise of its two terms (too few new tokens) the row says
"too short to measure" instead of a rate. A ratio whose spreads overlap reads "same within noise".
Without transformers the multihead rows run alone (random weights from ``mh.pretrained.random_lm``)
and the report says why the Hugging Face rows are missing.

The bandwidth limit of a contestant is the read bandwidth over as many bytes as every decode step
reads (all parameters and buffers but the input embedding, which is read one row at a time; a tied
output head is counted), measured by :func:`read_bandwidth` over a buffer of that size read again and
again, as the steps read the weights: from memory for a model larger than the caches, from the caches
for a small one. The KV cache is not counted (at a 256-token prompt it is about 1% of the weights).
Every figure is checked against what it can be (:func:`multihead.bench.timing.check_figure`): a limit
below a rate measured against it (the probe ran while the machine was busy), a rate whose spread is
wider than 10x or reaches above its limit: each reads "n/a (why; what to pass)", naming the option
(``--rounds``, ``--new-tokens``) that gives a figure.

Contestants run interleaved, round after round, so a load change on a shared machine hits all of them;
the ratios come from the same run.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import native, pretrained
from ..core.checks import check_int
from ..models import quant
from ..models.lm import TransformerLM
from . import timing
from .decode_quality import int8_quality
from .decode_report import render, summary_lines, to_json
from .decode_rows import FLOATS, INT8_NATIVE, ROWS, row
from .floors import read_bandwidth, step_bytes
from .tokens import parting

__all__ = [
    "DEFAULT_PRESET",
    "FLOATS",
    "INT8_NATIVE",
    "ROWS",
    "int8_quality",
    "read_bandwidth",
    "render",
    "run",
    "step_bytes",
    "summary_lines",
    "to_json",
]

DEFAULT_PRESET = "llama-20m"

Generate = Callable[[int], Tensor]


def _hf_models(preset: str) -> tuple[nn.Module, TransformerLM, str]:
    """transformers' fp32 model of the preset (random weights) and our conversion; the version."""
    import transformers as tf

    config = tf.LlamaConfig(
        **{k: v for k, v in pretrained.preset_config(preset).items() if k != "model_type"}
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # generate exactly n tokens
    torch.manual_seed(0)
    hf32 = tf.LlamaForCausalLM(config).eval()
    ours = pretrained.from_hf(hf32)
    assert isinstance(ours, TransformerLM)
    return hf32, ours, tf.__version__


def _contestants(preset: str, prompt: Tensor) -> tuple[dict[str, tuple[Generate, int]], dict[str, Any]]:
    """name -> (generate n tokens, bytes per step) for every row that can run; what was skipped and why."""
    info: dict[str, Any] = {"transformers": None, "skipped": None, "bf16_prepacked": None, "native": None}
    try:
        hf32, ours32, info["transformers"] = _hf_models(preset)
    except ImportError as e:
        hf32 = None
        ours32 = pretrained.random_lm(preset, seed=0)
        info["skipped"] = f"HF rows skipped: transformers is not installed ({e}); pip install transformers"
    ours16 = copy.deepcopy(ours32).to(torch.bfloat16)
    packed = quant.quantize(ours16, weights="bf16", kv=None, kernel="onednn")
    head = packed.get_submodule("lm_head")
    assert isinstance(head, quant.Bf16Linear)
    info["bf16_prepacked"] = head.why_not_packed or "oneDNN prepacked"
    why_not = native.unavailable()
    dp = "AVX512-BF16 dot products" if native.has_dpbf16() else "bf16 widened to fp32"
    info["native"] = f"F.linear ({why_not})" if why_not else f"native, {native.threads()} thread(s), {dp}"
    models: dict[str, tuple[nn.Module, str]] = {
        "multihead fp32": (ours32, "embed"),
        "multihead fp32 prepacked": (
            quant.quantize(ours32, weights="fp32", kv=None, kernel="onednn"),
            "embed",
        ),
        "multihead fp32 native": (quant.quantize(ours32, weights="fp32", kv=None, kernel="native"), "embed"),
        "multihead bf16": (ours16, "embed"),
        "multihead bf16 prepacked": (packed, "embed"),
        "multihead bf16 native": (quant.quantize(ours16, weights="bf16", kv=None, kernel="native"), "embed"),
        "multihead fp16": (copy.deepcopy(ours32).to(torch.float16), "embed"),
        "multihead fp16 native": (quant.quantize(ours32, weights="fp16", kv=None, kernel="native"), "embed"),
        "multihead int8 (fp32 activations)": (
            quant.quantize(ours32, weights="int8", kv="int8", kernel="fbgemm"),
            "embed",
        ),
        "multihead int8 (bf16 activations)": (
            quant.quantize(ours16, weights="int8", kv="int8", kernel="fbgemm"),
            "embed",
        ),
    }
    for name, group in INT8_NATIVE.items():  # int8 weights and KV cache, native decode steps
        models[name] = (
            quant.quantize(ours32, weights="int8", kv="int8", kernel="native", group_size=group),
            "embed",
        )
    if hf32 is not None:
        models["HF fp32"] = (hf32, "model.embed_tokens")
        models["HF bf16"] = (copy.deepcopy(hf32).to(torch.bfloat16), "model.embed_tokens")
        models["HF fp16"] = (copy.deepcopy(hf32).to(torch.float16), "model.embed_tokens")

    def gen(name: str, model: nn.Module) -> Generate:
        if name.startswith("HF"):
            return lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # type: ignore[operator]
        return lambda n: model.generate(prompt, n)  # type: ignore[operator]

    out = {
        name: (gen(name, models[name][0]), step_bytes(*models[name])) for name, _, _ in ROWS if name in models
    }
    info["models"] = {name: m for name, (m, _) in models.items()}
    return out, info


def _measure(
    contestants: dict[str, tuple[Generate, int]],
    new_tokens: int,
    rounds: int,
    say: Callable[[str], None],
) -> tuple[dict[str, timing.Timing], dict[int, float]]:
    """Per contestant: the decode steps' time (n tokens minus 1 token, interleaved samples), and the read
    bandwidth over each step size."""
    calls: dict[str, Callable[[], object]] = {}
    for name, (gen, _) in contestants.items():
        calls[f"{name}|1"] = functools.partial(gen, 1)
        calls[f"{name}|n"] = functools.partial(gen, new_tokens)
    say(f"timing generate(1) and generate({new_tokens}) of {len(contestants)} contestants, interleaved")
    t = timing.measure_all(calls, min_samples=rounds, warmup=0, max_seconds=2.0, progress=say)
    steps = {k: timing.difference(t[f"{k}|n"], t[f"{k}|1"]) for k in contestants}
    bandwidth: dict[int, float] = {}
    for group in _size_groups(sorted({b for _, b in contestants.values()})):
        say(f"read bandwidth over {group[-1] / 1e6:.1f} MB")
        # one probe for sizes within 25% (the same caches hold them); its fastest sample counts, so more
        # rounds give a busy machine more chances at the limit
        rate = read_bandwidth(group[-1], reps=max(5, 2 * rounds))
        bandwidth.update(dict.fromkeys(group, rate))
    return steps, bandwidth


def _size_groups(sizes: list[int]) -> list[list[int]]:
    """Sorted byte counts in groups whose largest is within 1.25x of its smallest."""
    groups: list[list[int]] = []
    for n in sizes:
        if groups and n <= 1.25 * groups[-1][0]:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def run(
    preset: str = DEFAULT_PRESET,
    *,
    threads: int | None = None,
    rounds: int = 3,
    new_tokens: int = 32,
    prompt: int = 256,
    progress: Callable[[str], None] | None = None,
    plan: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Measure every row of :data:`ROWS`, samples interleaved; return the report (a dict).

    Args:
        preset: a name of ``multihead.pretrained.PRESETS`` (default llama-20m; llama-155m the full one).
        threads: torch threads during the run (restored after); None keeps torch's own.
        rounds: timed samples per call at least (more while they add up to under 0.2 s).
        new_tokens: tokens generated per timed call (>= 2: the rate is of the steps after the first).
        prompt: prompt tokens (random ids, fixed seed).
        progress: called with a short text before each measurement.
        plan: called once the models are built with how many more times ``progress`` will be called
            at least (a stage each, and each timed sample at ``rounds`` samples a call; short calls
            take more): the total of a progress bar, so that it shows the time left.

    Returns:
        ``{"preset", "threads", "prompt_len", "new_tokens", "rounds", "read_bandwidth_GBps" (over the
        largest step), "transformers", "skipped", "bf16_prepacked" (its kernel, or why plain F.linear
        runs), "tokens_identical_fp32" / "_bf16" / "_fp16" (to transformers), "tokens_part_fp32" /
        "_bf16" / "_fp16" (where they part: :func:`multihead.bench.tokens.parting`),
        "tokens_identical_prepacked" (to multihead bf16), "tokens_identical_fp32_prepacked" (to
        multihead fp32), "native" (the native rows' kernel, or why they run F.linear),
        "tokens_identical_native_fp32" / "_bf16" / "_fp16" (to multihead of that dtype), "rows":
        [{"name", "impl", "dtype", "bytes_per_token", "tok_s" (None: too short to measure, with
        "why_no_rate"), "tok_s_spread", "limit_tok_s", "fraction_of_limit" (a refusal text where above
        100%), "vs_hf_fp32", "vs_hf_same_dtype" (HF's time / ours) and their
        "_within_noise" flags}], "int8_native" ({row: :func:`int8_quality`'s dict and
        "tokens_identical_fp32"})}``; ratios to absent rows are None.

    Raises:
        ValueError: an unknown preset; threads, rounds or prompt < 1; new_tokens < 2; a prompt longer
            than the preset's max_position_embeddings allows with the new tokens.
    """
    config = pretrained.preset_config(preset)
    if threads is not None:
        check_int("threads", threads, 1)
    check_int("rounds", rounds, 1)
    check_int("new_tokens", new_tokens, 2)
    check_int("prompt", prompt, 1)
    if prompt + new_tokens > config["max_position_embeddings"]:
        raise ValueError(
            f"prompt + new_tokens = {prompt + new_tokens} exceeds preset {preset!r}'s "
            f"max_position_embeddings={config['max_position_embeddings']}; use a shorter prompt"
        )
    say = progress or (lambda what: None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        say(f"building {preset}")
        ids = torch.randint(0, config["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(1))
        contestants, info = _contestants(preset, ids)
        models = info.pop("models")
        if plan is not None:
            groups = len(_size_groups(sorted({b for _, b in contestants.values()})))
            plan(3 + 2 * len(contestants) * rounds + groups)
        with torch.inference_mode():
            say("greedy tokens against transformers")
            tokens = {name: gen(8) for name, (gen, _) in contestants.items()}  # also a warm-up
            ref = models["multihead fp32"]
            hf = {d: tokens.get(f"HF {d}") for d in FLOATS}
            part = {
                d: None if t is None else parting(tokens[f"multihead {d}"], t, prompt, ref)
                for d, t in hf.items()
            }
            same = {d: None if hf[d] is None else part[d] is None for d in FLOATS}
            same_packed = torch.equal(tokens["multihead bf16"], tokens["multihead bf16 prepacked"])
            same_packed32 = torch.equal(tokens["multihead fp32"], tokens["multihead fp32 prepacked"])
            same_native = {
                d: torch.equal(tokens[f"multihead {d}"], tokens[f"multihead {d} native"]) for d in FLOATS
            }
            int8_native = {k: models[k] for k in INT8_NATIVE if k in models}
            say("int8 logit error against fp32")
            int8_error = int8_quality(models["multihead fp32"], int8_native, tokens["multihead fp32"], prompt)
            for k in int8_error:
                int8_error[k]["tokens_identical_fp32"] = torch.equal(tokens["multihead fp32"], tokens[k])
            steps, bandwidth = _measure(contestants, new_tokens, rounds, say)
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    rows = [
        row(name, impl, dtype, contestants[name][1], steps, new_tokens, bandwidth[contestants[name][1]],
            rounds)
        for name, impl, dtype in ROWS
        if name in contestants
    ]  # fmt: skip
    return {
        "preset": preset,
        "threads": threads_used,
        "prompt_len": prompt,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "read_bandwidth_GBps": bandwidth[max(bandwidth)] / 1e9,
        **info,
        **{f"tokens_identical_{d}": same[d] for d in FLOATS},
        **{f"tokens_part_{d}": part[d] for d in FLOATS},
        "tokens_identical_prepacked": same_packed,
        "tokens_identical_fp32_prepacked": same_packed32,
        **{f"tokens_identical_native_{d}": same_native[d] for d in FLOATS},
        "int8_native": int8_error,
        "rows": rows,
    }
