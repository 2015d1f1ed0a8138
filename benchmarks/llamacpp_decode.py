"""Decode speed against llama.cpp on the same weights: f32, bf16, f16 and q8_0 GGUF files converted by
llama.cpp's own converter from our model, greedy tokens checked, both rates in one table.

    python benchmarks/llamacpp_decode.py --llamacpp /work/llamacpp/src --bin /work/llamacpp/build/bin
    python benchmarks/llamacpp_decode.py --llamacpp DIR --threads 1 2 --runs 4 --context 256 --json

Builds nothing: ``--llamacpp`` is a llama.cpp source tree (``convert_hf_to_gguf.py`` and ``gguf-py/``),
``--bin`` its build (``llama-bench``, ``llama-simple``; default ``DIR/build/bin``); benchmarks/LLAMACPP.md
says how to build one offline. Steps:

1. The preset's LLaMA model with random weights (transformers' ``LlamaForCausalLM``, seed 0, as
   ``multihead bench decode``), converted with ``mh.pretrained.from_hf`` and written back with
   ``mh.pretrained.to_hf(...).save_pretrained``, with a tokenizer whose every token is one character
   (so a prompt of characters is exactly its token ids on both sides: no merges to disagree on).
2. ``convert_hf_to_gguf.py --outtype f32 | bf16 | f16 | q8_0``.
3. Greedy tokens: ``llama-simple -n N`` on each GGUF against ours in the same precision (native decode
   steps: fp32, bf16, fp16; q8_0 against our int8 with groups of 32 and int8 activations), and where
   they part.
4. Rates, ``--runs`` times, interleaved: ``llama-bench -t T -n NEW -d CONTEXT -p 0`` (NEW tokens
   generated after a CONTEXT-token context: decode only) against ours the same way: a CONTEXT-token
   prompt fills our KV cache once, then NEW greedy tokens are timed from it (each sample rewinds the
   cache; our native greedy runs, as ``generate``; the fastest of 3; :func:`our_rate`). Medians.
5. Ours against our bandwidth limit (the bytes a step reads, ``multihead.bench.decode.step_bytes``, over
   ``read_bandwidth`` of as many bytes at the same thread count), probed in every run right before and
   right after our rate, the faster of the two counting: "of limit" is the median over the runs of our
   rate over that run's limit (a machine whose read rate moves between minutes moves both alike; one
   probe after all the runs compared each run with another minute's memory; and where the rate moved
   during our measurement, the faster probe keeps our share from reading above what the memory allowed),
   "of one limit" the median rate over the best of the runs' probes. And our
   greedy tokens in each precision against our fp32 model's: where they part and the fp32 logit margin
   there. Each run's figures are in the JSON's "runs".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import multihead as mh
from multihead.bench import decode, timing, tokens
from multihead.bench.runs import median_rate, paired_limit_text
from multihead.models import quant
from multihead.native import hugepages

#: GGUF type -> (our quantize arguments, the row's name on our side)
PRECISIONS = {
    "f32": ({"weights": "fp32", "kv": None, "kernel": "native"}, "fp32 native"),
    "bf16": ({"weights": "bf16", "kv": None, "kernel": "native"}, "bf16 native"),
    "f16": ({"weights": "fp16", "kv": None, "kernel": "native"}, "fp16 native"),
    "q8_0": ({"weights": "int8", "kv": "int8", "kernel": "native", "group_size": 32}, "int8 native g32"),
}
#: each run's figures in the JSON's "runs": llama.cpp's and our tokens/s, our limit in tokens/s (the faster
#: probe, before or after our rate)
RUN_KEYS = ("llamacpp_tok_s", "multihead_tok_s", "limit_tok_s")
FIRST_CHAR = 0x4E00  # token i >= 4 is the character FIRST_CHAR + i - 4 (CJK, then on into Hangul)
SPECIAL = ["<unk>", "<s>", "</s>", "\u2581"]  # ids 0-3; 3 is the space marker SentencePiece prepends


def _char(i: int) -> str:
    c = FIRST_CHAR + i - len(SPECIAL)
    return chr(c if c <= 0x9FFF else 0xAC00 + c - 0xA000)  # past the CJK block: Hangul syllables


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A LLaMA-style fast tokenizer (BPE with byte fallback, SentencePiece's space marker) of
    ``vocab_size`` tokens, each non-special token one character: llama.cpp reads it as its "llama"
    vocabulary, and the text of characters c_1..c_n tokenizes to [3, id(c_1), ..., id(c_n)]."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if vocab_size - len(SPECIAL) > (0x9FFF - FIRST_CHAR + 1) + (0xD7A3 - 0xAC00 + 1):
        raise ValueError(f"vocab_size {vocab_size} exceeds the one-character tokens this script has")
    vocab = {t: i for i, t in enumerate(SPECIAL)} | {_char(i): i for i in range(len(SPECIAL), vocab_size)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        **dict(zip(("unk_token", "bos_token", "eos_token"), SPECIAL)),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def build_model(preset: str, out: Path) -> mh.TransformerLM:
    """Our model of ``preset`` (random weights, seed 0), saved at ``out`` as a transformers checkpoint."""
    import transformers as tf

    config = tf.LlamaConfig(
        **{k: v for k, v in mh.pretrained.preset_config(preset).items() if k != "model_type"}
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, None
    torch.manual_seed(0)
    ours = mh.pretrained.from_hf(tf.LlamaForCausalLM(config).eval())
    assert isinstance(ours, mh.TransformerLM)
    mh.pretrained.to_hf(ours).save_pretrained(out)
    write_tokenizer(out, config.vocab_size)
    return ours


def convert(llamacpp: Path, model_dir: Path, outtype: str, out: Path) -> Path:
    """``convert_hf_to_gguf.py`` of the checkpoint at ``model_dir`` to ``out/model-<outtype>.gguf``."""
    gguf = out / f"model-{outtype}.gguf"
    if not gguf.exists():
        env = {
            **os.environ,
            "PYTHONPATH": f"{llamacpp / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        cmd = [sys.executable, str(llamacpp / "convert_hf_to_gguf.py"), str(model_dir)]
        subprocess.run(
            [*cmd, "--outtype", outtype, "--outfile", str(gguf)], check=True, env=env, capture_output=True
        )
    return gguf


def llamacpp_tokens(bin_dir: Path, gguf: Path, prompt_ids: list[int], n: int, vocab_size: int) -> list[int]:
    """llama.cpp's greedy ids after ``prompt_ids`` (which start with the space marker 3), ``llama-simple``."""
    text = "".join(_char(i) for i in prompt_ids[1:])
    done = subprocess.run(
        [str(bin_dir / "llama-simple"), "-m", str(gguf), "-n", str(n), text],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ids = {_char(i): i for i in range(len(SPECIAL), vocab_size)} | {" ": 3}
    at = done.stdout.find(text)  # the prompt is echoed first (its space marker as a space)
    chars = done.stdout[at + len(text) :].rstrip("\n") if at >= 0 else ""
    return [ids.get(c, -1) for c in chars][:n]  # -1: a token that is not a character (a special one)


def llamacpp_rate(bin_dir: Path, gguf: Path, threads: int, new: int, context: int) -> float:
    """llama-bench's decode tokens/s: ``new`` tokens after a ``context``-token context, one run."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-n", str(new)]
    cmd += ["-d", str(context), "-p", "0", "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def our_rate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    new: int,
    reps: int = 3,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Our decode tokens/s after ``prompt`` (1, context), timed as ``llama-bench -d`` times its tokens: the
    prompt fills the KV cache once (not timed); each sample rewinds the cache to the prompt's end and
    decodes ``new`` greedy tokens, each a whole step (the output head's pick, then every layer on it), in
    the model's native greedy runs (``greedy_steps``: what ``generate`` runs); ``new`` over the fastest
    of at least ``reps`` samples (:func:`multihead.bench.timing.measure`: load only ever adds time).
    A model without native greedy runs: ``(new - 1) / (t(new) - t(1))`` of ``generate`` (the prefill's
    own noise then lands in the difference). NaN when too short to measure."""
    direct = _filled_cache_run(model, prompt, new)
    if direct is not None:
        best = timing.measure(direct, min_samples=reps, clock=clock).best
        return float("nan") if best is None else new / best
    calls = {str(n): functools.partial(model.generate, prompt, n) for n in (1, new)}
    t = timing.measure_all(calls, min_samples=reps, clock=clock)  # type: ignore[arg-type]
    one, many = t["1"].best, t[str(new)].best
    if one is None or many is None or many - one <= 0:
        return float("nan")
    return (new - 1) / (many - one)


def _filled_cache_run(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> Callable[[], None] | None:
    """A call decoding ``new`` greedy tokens natively after ``prompt``'s filled cache (rewound first), or
    None where the model has no native greedy run for them (no ``greedy_steps``, or it declines)."""
    if not callable(getattr(model, "greedy_steps", None)):
        return None
    context = prompt.shape[1]
    cache = model.make_cache(1, context + new + 1, getattr(model, "cache_kind", "dense"))  # type: ignore[operator]
    h = model.hidden_states(prompt, cache=cache)[:, -1:]  # type: ignore[operator]  # (1, 1, d)
    out = prompt.new_zeros(1, context + new + 1)  # (1, context + new + 1)

    def run() -> None:
        for kv in cache:
            kv.reset()
            kv.advance(context)
        ran = model.greedy_steps(h, out, context, new, False, None, cache)  # type: ignore[operator]
        if ran is None or ran[0] != new:
            raise RuntimeError(f"the native greedy run stopped after {ran and ran[0]} of {new} tokens")

    taken = model.greedy_steps(h, out, context, 1, False, None, cache)  # type: ignore[operator]  # natively?
    return None if taken is None else run


def streamed_in_huge_pages(model: torch.nn.Module) -> str:
    """The share of the weights a decode step streams (every parameter and buffer but the input
    embedding's, a tied head's included) that lie in huge pages, as text ("98%"; "-" where Linux's smaps
    cannot tell): a row slower than its neighbours can be checked against it."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    share = hugepages.coverage([t for n, t in named if not n.startswith("embed.")])  # a tied head: lm_head.*
    return "-" if share is None else f"{share:.0%}"


def _cell(x: float | None, spec: str, unit: str = "") -> str:
    return timing.TOO_SHORT if x is None else format(x, spec) + unit


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))
    )


def run(args: argparse.Namespace) -> dict:
    """Convert, check tokens, measure; the report as a dict (see the module docstring)."""
    bin_dir = args.bin or args.llamacpp / "build" / "bin"
    work = Path(args.work or tempfile.mkdtemp(prefix="mh-llamacpp-"))
    ours32 = build_model(args.preset, work / "hf")
    vocab = ours32.vocab_size
    g = torch.Generator().manual_seed(1)
    check_prompt = [3, *torch.randint(len(SPECIAL), vocab, (15,), generator=g).tolist()]
    context = torch.randint(len(SPECIAL), vocab, (1, args.context), generator=g)  # (1, context)
    doc: dict = {"preset": args.preset, "context": args.context, "new_tokens": args.new_tokens, "rows": []}
    for outtype in args.types:
        kwargs, name = PRECISIONS[outtype]
        gguf = convert(args.llamacpp, work / "hf", outtype, work)
        ours = quant.quantize(ours32, **kwargs)
        with torch.inference_mode():
            want = ours.generate(torch.tensor([check_prompt]), args.check_tokens)[
                0, len(check_prompt) :
            ].tolist()  # type: ignore[operator]
        got = llamacpp_tokens(bin_dir, gguf, check_prompt, args.check_tokens, vocab)
        prompt = torch.tensor([check_prompt])  # (1, P)
        with torch.inference_mode():
            fp32 = ours32.generate(prompt, args.check_tokens)  # type: ignore[operator]
        mine_seq = prompt.new_tensor([check_prompt + want])  # (1, P + new)
        vs_fp32 = tokens.parting(mine_seq, fp32, len(check_prompt), ours32)
        nbytes = decode.step_bytes(ours, "embed")
        for threads in args.threads:
            torch.set_num_threads(threads)
            theirs, mine, limits = [], [], []
            with torch.inference_mode():
                for _ in range(args.runs):  # interleaved: a load change hits both sides
                    theirs.append(llamacpp_rate(bin_dir, gguf, threads, args.new_tokens, args.context))
                    before = decode.read_bandwidth(nbytes, reps=3) / nbytes  # tokens/s at best
                    mine.append(our_rate(ours, context, args.new_tokens))
                    limits.append(max(before, decode.read_bandwidth(nbytes, reps=3) / nbytes))
            ours_tok_s = median_rate(mine)  # None: too short to measure
            doc["rows"].append(
                {
                    "gguf": outtype,
                    "ours": name,
                    "threads": threads,
                    "llamacpp_tok_s": statistics.median(theirs),
                    "multihead_tok_s": ours_tok_s,
                    "ratio": None if ours_tok_s is None else ours_tok_s / statistics.median(theirs),
                    "multihead_step_bytes": nbytes,
                    "multihead_of_limit": paired_limit_text(mine, limits),
                    "multihead_of_one_limit": timing.limit_text(ours_tok_s, max(limits)),
                    "multihead_huge_pages": streamed_in_huge_pages(ours),
                    "tokens_first_difference": _first_difference(want, got),
                    "ours_vs_fp32": tokens.parting_text(vs_fp32),
                    "runs": [
                        dict(zip(RUN_KEYS, run, strict=True))
                        for run in zip(theirs, mine, limits, strict=True)
                    ],
                }
            )
            print(json.dumps(doc["rows"][-1]), file=sys.stderr)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--llamacpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)"
    )
    p.add_argument("--bin", type=Path, default=None, help="its build's bin directory (default DIR/build/bin)")
    p.add_argument("--preset", default="llama-155m")
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--runs", type=int, default=4, help="interleaved runs per side; medians (default 4)")
    p.add_argument("--context", type=int, default=256, help="tokens before the timed ones (default 256)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared (default 16)")
    p.add_argument("--types", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument("--work", default=None, help="where the checkpoint and GGUF files go (default a temp dir)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    doc = run(a)
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print(
        f"{doc['preset']}: {doc['new_tokens']} tokens decoded after a {doc['context']}-token context, medians"
    )
    print(
        f"{'GGUF':6s} {'ours':16s} {'threads':>7s} {'llama.cpp':>10s} {'multihead':>10s} {'ratio':>6s}"
        f" {'of limit':>8s} {'of one':>8s} {'huge pg':>7s}"
        "  tokens (llama.cpp vs ours)"
    )
    for r in doc["rows"]:
        diff = r["tokens_first_difference"]
        same = "identical" if diff is None else f"part at token {diff}"
        print(
            f"{r['gguf']:6s} {r['ours']:16s} {r['threads']:7d} {r['llamacpp_tok_s']:10.1f} "
            f"{_cell(r['multihead_tok_s'], '10.1f')} {_cell(r['ratio'], '5.2f', 'x')} "
            f"{r['multihead_of_limit']:>8s} {r['multihead_of_one_limit']:>8s} "
            f"{r['multihead_huge_pages']:>7s}  {same}"
        )
    print("ours against our fp32 model, greedy:")
    for r in doc["rows"][:: len(set(x["threads"] for x in doc["rows"]))]:
        print(f"  {r['ours']}: {r['ours_vs_fp32']}")


if __name__ == "__main__":
    main()
