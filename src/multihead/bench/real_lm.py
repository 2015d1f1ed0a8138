"""What each choice costs a real language model: SmolLM2-135M-Instruct on held-out English Wikipedia.

Every row is one model built from the packaged file (``mh.pretrained.smollm2()``: its Q4_1 blocks
dequantized to fp32) and scored the same way: perplexity by transformers' sliding window
(:func:`multihead.eval.perplexity_scores`) with a percentile-bootstrap interval over windows, the share of
greedy tokens equal to the fp32 model's at the same place, and the KV cache bytes one token adds over
all layers. The rows (:data:`ROWS`):

- precision: ``mh.quant.quantize`` weights bf16 / fp16 / int8 per output channel / int8 per group of
  32 inputs; the file's own Q4_1 blocks in the native kernels (``from_gguf(path)``, activations rounded to
  8 bits per block of 32 as llama.cpp does); an int8 KV cache beside fp32 weights;
- approximations of :mod:`multihead.approx` that a causal LM can use, two sizes each: a sliding window
  (``SparseMask(local(w))``), the same window beside the first 4 tokens (``local_global(w, 4)``: the
  attention sinks of StreamingLLM, Xiao et al., 2024), ``TopK(k)``, ``LowRank(r)`` (the rank-r SVD of each
  head's exact weights: a bound on what low rank can do, and slow: an SVD per head and window) and
  ``Performer(F)`` (FAVOR+ linear attention), put into every layer by ``approx.apply`` with no training;
- head surgery: ``to_gqa(model, 1)`` (3 kv heads mean-pooled into 1), ``to_mla`` at two latent ranks
  with 16 rotary dims kept per kv head (``rope_select="norm"``, and ``"disjoint"``: the pairs a DeepSeek-V3
  checkpoint can hold), and pruning the 3 least important of the 9 query heads of every layer (Michel et
  al.'s importance on training-slice ids); each raw, and (rows ending ``+rec``) after
  ``mh.heads.recover`` for a few CPU-minutes (``clock="cpu"``) on token ids of the training slice.

Shape legend: n sequences, N tokens.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import approx
from ..eval import wikipedia
from ..eval.perplexity import perplexity_scores
from ..heads import importance, kv_cache_bytes_per_token, prune, recover, to_gqa, to_mla
from ..models.quant import quantize
from ..nn.kv_cache import cache_bytes

__all__ = ["ROWS", "Row", "Settings", "measure", "table"]


@dataclass(frozen=True)
class Settings:
    """What every row is measured on (the defaults are the BENCHMARKS.md table's)."""

    texts: int = 8  # held-out articles
    chars: int = 2000  # characters of each (cut at a paragraph)
    context: int = 512
    stride: int = 256
    prompts: int = 3  # greedy prompts (training-slice excerpts)
    prompt_chars: int = 300
    new_tokens: int = 32
    calibration: tuple[int, int] = (4, 256)  # sequences x tokens for to_mla and importance
    recover_minutes: float | None = 8.0  # CPU-minutes of each recovery (the process's, all threads)
    recover_steps: int | None = None  # or (also) a number of optimizer steps
    recover_sequences: int = 512  # training sequences of recover_tokens for recovery
    recover_tokens: int = 128
    bootstrap: int = 1000


@dataclass(frozen=True)
class Row:
    """One choice: ``build(base, settings) -> (model, extra)``; ``kv`` "dense" or "int8"; ``cached``
    False where decode steps cannot run the approximation (greedy tokens are then recomputed from the
    whole sequence each step)."""

    what: str
    build: Callable[[nn.Module, Settings], tuple[nn.Module, dict[str, Any]]]
    kv: str = "dense"
    cached: bool = True


def _ids(articles: Sequence[Any], tokenizer: Any, n: int, N: int) -> list[list[int]]:
    """Up to n id lists of N tokens cut from the articles in order."""
    out: list[list[int]] = []
    for a in articles:
        ids = tokenizer.encode(a.text)
        out += [ids[i : i + N] for i in range(0, len(ids) - N + 1, N)]
        if len(out) >= n:
            break
    return out[:n]


def _calibration(model: Any, s: Settings) -> torch.Tensor:
    """(n, N) token ids from the training slice's first articles."""
    n, N = s.calibration
    return torch.tensor(_ids(wikipedia.training(), model.tokenizer, n, N))  # (n, N)


def _keep_text(new: nn.Module, base: nn.Module) -> nn.Module:
    new.tokenizer, new.eos_token_ids = base.tokenizer, base.eos_token_ids
    return new


def _file_blocks(base: nn.Module) -> nn.Module:
    """The packaged file loaded again with its Q4_1 / Q8_0 blocks kept (``from_gguf``'s default)."""
    from ..pretrained.gguf import from_gguf, smollm2_path

    return from_gguf(smollm2_path())


def _plain(
    build: Callable[[nn.Module], nn.Module],
) -> Callable[[nn.Module, Settings], tuple[nn.Module, dict]]:
    return lambda base, s: (build(base), {})


def _pruned(whole_group: bool) -> Callable[[nn.Module, Settings], nn.Module]:
    """3 of the 9 query heads of every layer removed, by Michel et al.'s importance on calibration ids:
    the least important one of each kv group (the cache keeps its 3 kv heads), or (``whole_group``) the
    kv group whose 3 query heads sum to the least (its kv head goes too: 2/3 of the cache)."""

    def build(base: nn.Module, s: Settings) -> nn.Module:
        scores = importance(base, _calibration(base, s), batch_size=2)  # (L, Hq)
        L, Hq = scores.shape
        Hkv = base.layers[0].self_attn.n_kv_heads  # type: ignore[index, union-attr]
        groups = scores.reshape(L, Hkv, Hq // Hkv)  # (L, Hkv, Hq / Hkv): query heads of each kv head
        if whole_group:
            worst = groups.sum(-1).argmin(-1).tolist()  # (L,) the weakest group of each layer
            drop = {i: [worst[i] * (Hq // Hkv) + j for j in range(Hq // Hkv)] for i in range(L)}
        else:
            within = groups.argmin(-1)  # (L, Hkv) the weakest query head of each group
            drop = {i: [g * (Hq // Hkv) + int(within[i, g]) for g in range(Hkv)] for i in range(L)}
        return prune(copy.deepcopy(base), drop)

    return build


def _mla(rank: int, select: str) -> Callable[[nn.Module, Settings], nn.Module]:
    def build(base: nn.Module, s: Settings) -> nn.Module:
        m = to_mla(base, rank, rope_dims=16, calibration=_calibration(base, s), rope_select=select)
        return _keep_text(m, base)

    return build


def _recovered(surgery: Callable[[nn.Module, Settings], nn.Module]) -> Callable[..., tuple[nn.Module, dict]]:
    """The surgery, then ``recover`` for ``s.recover_minutes`` CPU-minutes (and / or ``s.recover_steps``) on
    ``recover_sequences`` id lists of the training slice, batches of 8, a held-out stop on 16 of them."""

    def build(base: nn.Module, s: Settings) -> tuple[nn.Module, dict[str, Any]]:
        student = surgery(base, s)
        train = _ids(wikipedia.training()[4:], base.tokenizer, s.recover_sequences, s.recover_tokens)
        report: dict[str, Any] = {}
        t0 = time.perf_counter()
        recover(student, base, train, minutes=s.recover_minutes, steps=s.recover_steps, clock="cpu",
                batch_size=8, holdout=16, checks=8, progress=False, report=report)  # fmt: skip
        extra = {"recover_steps": report.get("steps"), "recover_best_step": report.get("best_step"),
                 "recover_seconds": time.perf_counter() - t0, "recover_stopped": report.get("stopped"),
                 "recover_sequences": len(train)}  # fmt: skip
        return student, extra

    return build


def _surgery(build: Callable[[nn.Module, Settings], nn.Module]) -> Callable[..., tuple[nn.Module, dict]]:
    return lambda base, s: (build(base, s), {})


def _approx(a: approx.Approximation) -> Callable[[nn.Module, Settings], tuple[nn.Module, dict]]:
    return lambda base, s: (_keep_text(approx.apply(base, a), base), {})


_GQA = lambda base, s: _keep_text(to_gqa(copy.deepcopy(base), 1), base)  # noqa: E731
_SURGERY = {
    "gqa-1": ("GQA 3 -> 1 kv head (mean)", _GQA),
    "mla-48": ("MLA latent 48 + 3x16 rotary", _mla(48, "norm")),
    "mla-48-disjoint": ("MLA latent 48 + 3x16 rotary, disjoint pairs", _mla(48, "disjoint")),
    "mla-80": ("MLA latent 80 + 3x16 rotary", _mla(80, "norm")),
    "prune-group": ("1 of 3 kv groups (3 of 9 query heads) pruned per layer", _pruned(True)),
}

ROWS: dict[str, Row] = {
    "fp32": Row("fp32 weights, fp32 KV", _plain(lambda m: m)),
    "bf16": Row("bf16 weights, bf16 KV", _plain(lambda m: quantize(m, weights="bf16", kv=None))),
    "fp16": Row("fp16 weights, fp16 KV", _plain(lambda m: quantize(m, weights="fp16", kv=None))),
    "int8-channel": Row("int8 weights per channel", _plain(lambda m: quantize(m, weights="int8", kv=None))),
    "int8-g32": Row(
        "int8 weights per 32", _plain(lambda m: quantize(m, weights="int8", kv=None, group_size=32))
    ),
    "q4_1-blocks": Row("the file's own Q4_1 blocks, native (8-bit activations)", _plain(_file_blocks)),
    "kv-int8": Row(
        "fp32 weights, int8 KV", _plain(lambda m: quantize(m, weights=None, kv="int8")), kv="int8"
    ),
    "window-64": Row("sliding window 64", _approx(approx.SparseMask(approx.local(64)))),
    "window-256": Row("sliding window 256", _approx(approx.SparseMask(approx.local(256)))),
    "sinks-window-64": Row(
        "first 4 tokens + window 64", _approx(approx.SparseMask(approx.local_global(64, 4)))
    ),
    "sinks-window-256": Row(
        "first 4 tokens + window 256", _approx(approx.SparseMask(approx.local_global(256, 4)))
    ),
    "topk-16": Row("top-16 keys per query", _approx(approx.TopK(16))),
    "topk-64": Row("top-64 keys per query", _approx(approx.TopK(64))),
    "lowrank-32": Row(
        "rank-32 SVD of the attention weights",
        _approx(approx.LowRank(32, clamp=True)),
        cached=False,
    ),
    "lowrank-128": Row(
        "rank-128 SVD of the attention weights",
        _approx(approx.LowRank(128, clamp=True)),
        cached=False,
    ),
    "performer-64": Row("Performer, 64 features", _approx(approx.Performer(64))),
    "performer-256": Row("Performer, 256 features", _approx(approx.Performer(256))),
}
ROWS["prune-3"] = Row("1 query head of each kv group pruned per layer, raw", _surgery(_pruned(False)))
for _name, (_what, _build) in _SURGERY.items():
    ROWS[_name] = Row(f"{_what}, raw", _surgery(_build))
    ROWS[f"{_name}+rec"] = Row(f"{_what}, recovered", _recovered(_build))


def kv_bytes(model: nn.Module, kind: str = "dense") -> int:
    """KV cache bytes one token adds over all layers (int8: values and their per-token scales)."""
    if kind == "int8":
        attns = [layer.self_attn for layer in model.layers]  # type: ignore[union-attr]
        return sum(
            cache_bytes(1, a.n_kv_heads, a.head_dim, a.head_dim, 1, "int8", torch.float32) for a in attns
        )
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return kv_cache_bytes_per_token(model, dtype)


def prompts(model: Any, s: Settings) -> list[torch.Tensor]:
    """(1, N) ids of the first paragraph-cut ``prompt_chars`` of the first training articles."""
    texts = [wikipedia.excerpt(a.text, s.prompt_chars) for a in wikipedia.training()[: s.prompts]]
    return [torch.tensor([model.tokenizer.encode(t)]) for t in texts]


def greedy(model: Any, ps: list[torch.Tensor], n: int, cached: bool = True) -> list[list[int]]:
    """``n`` greedy tokens after each prompt, no stop ids; uncached: the whole sequence each step."""
    out = []
    with torch.no_grad():
        for p in ps:  # p (1, N)
            if cached:
                out.append(model.generate(p, n, eos_token_id=[])[0, p.shape[1] :].tolist())
                continue
            ids = p
            for _ in range(n):
                nxt = model(ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                ids = torch.cat([ids, nxt], dim=1)  # (1, N + t)
            out.append(ids[0, p.shape[1] :].tolist())
    return out


def measure(
    names: Sequence[str],
    s: Settings = Settings(),
    *,
    base: nn.Module | None = None,
    log: Callable[[str], Any] = print,
    on_row: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> list[dict[str, Any]]:
    """One dict per row: perplexity, interval, tokens scored, greedy agreement, KV bytes per token.

    ``log`` receives a line per row; ``on_row`` the rows so far after each (to save a long run as it goes).

    Raises:
        ValueError: an unknown row name.
    """
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"rows must be names from {list(ROWS)}, got unknown {unknown or names}")
    if base is None:
        from ..pretrained.gguf import smollm2

        base = smollm2()
    base = base.eval()
    texts = wikipedia.held_out_texts(s.texts, s.chars)
    ps = prompts(base, s)
    reference = greedy(base, ps, s.new_tokens)
    rows = []
    for name in names:
        row, t0 = ROWS[name], time.perf_counter()
        model, extra = row.build(base, s)
        model.eval()
        sc = perplexity_scores(model, texts, context=s.context, stride=s.stride, tokenizer=base.tokenizer)
        got = reference if name == "fp32" else greedy(model, ps, s.new_tokens, row.cached)
        same = sum(a == b for g, r in zip(got, reference) for a, b in zip(g, r)) / (len(ps) * s.new_tokens)
        low, high = sc.interval(samples=s.bootstrap)
        rows.append({
            "row": name, "what": row.what, "perplexity": sc.perplexity, "low": low, "high": high,
            "tokens": sc.scored, "windows": int(sc.tokens.numel()), "greedy_same": same,
            "kv_bytes_per_token": kv_bytes(model, row.kv), "seconds": time.perf_counter() - t0, **extra,
        })  # fmt: skip
        r = rows[-1]
        log(f"{name}: ppl {r['perplexity']:.3f} [{low:.3f}, {high:.3f}], greedy {100 * same:.0f}% same, "
            f"KV {r['kv_bytes_per_token']} B/token ({r['seconds']:.0f} s)")  # fmt: skip
        if on_row is not None:
            on_row(rows)
    return rows


def _number(x: float) -> str:
    return f"{x:.2f}" if x < 1000 else f"{x:.0f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (KV bytes also as a share of the fp32 row's, when it is there)."""
    fp32 = next((r["kv_bytes_per_token"] for r in rows if r["row"] == "fp32"), None)
    lines = [
        "| choice | perplexity [95%] | greedy = fp32 | KV bytes / token |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        n = r["kv_bytes_per_token"]
        kv = f"{n:,}" + (f" ({fp32 / n:.1f}x less)" if fp32 and n != fp32 else "")
        steps = f" ({r['recover_steps']} steps)" if r.get("recover_steps") is not None else ""
        lines.append(
            f"| {r['what']}{steps} | {_number(r['perplexity'])} [{_number(r['low'])}, {_number(r['high'])}] "
            f"| {100 * r['greedy_same']:.0f}% | {kv} |"
        )
    return "\n".join(lines)
