"""The Hugging Face part of ``gpu_check.py``: models with ``attn_implementation="multihead"``.

- A Mistral-shape model (2 layers, d_model 1024, 16 heads / 4 kv heads, head dim 64, sliding window
  1024; random weights, bf16): a 16K-token prefill and a 4K-token training step (forward, backward and
  an AdamW step), against transformers' ``"sdpa"`` with the same weights.
- Tiny Gemma-2-shape (soft-cap) and gpt-oss-shape (sinks) models: one forward through multihead, the
  backends that served it, and the logits against transformers' ``"eager"`` (the only implementation of
  theirs that has both).

Which backend served is counted by wrapping each registered backend's ``run`` for the duration.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

import multihead.hf
from multihead.backends import registry
from multihead.bench.gpu_timing import Budget, first_and_warm, time_ratio


def vocab(small: bool) -> int:
    return 1000 if small else 32000


@contextlib.contextmanager
def served() -> Iterator[Counter]:
    """Count the calls each backend serves inside the block (``auto``'s picks included)."""
    seen: Counter = Counter()
    saved = {}
    for name in registry.names():
        b = registry.get(name)
        saved[name] = b.run

        def counted(p, _name=name, _run=b.run):
            seen[_name] += 1
            return _run(p)

        b.run = counted
    try:
        yield seen
    finally:
        for name, run in saved.items():
            registry.get(name).run = run


def mistral(small: bool, impl: str, device: torch.device) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    multihead.hf.register()  # attn_implementation="multihead"
    d, heads, kv, hd, w = (128, 4, 2, 32, 64) if small else (1024, 16, 4, 64, 1024)
    cfg = MistralConfig(
        vocab_size=vocab(small), hidden_size=d, intermediate_size=4 * d, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, sliding_window=w,
        max_position_embeddings=32768, attn_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).to(device, torch.bfloat16)


def mistral_rows(device: torch.device, small: bool, repeats: int, budget: Budget) -> list[dict]:
    """Prefill and training step, multihead vs sdpa (same weights: same seed)."""
    n_pre, n_train = (512, 256) if small else (16384, 4096)
    models = {impl: mistral(small, impl, device) for impl in ("sdpa", "multihead")}  # the same weights
    ids = torch.randint(
        0, vocab(small), (1, n_pre), device=device, generator=torch.Generator(device).manual_seed(1)
    )
    rows = []
    for what in ("prefill", "train step"):  # the pair of each measurement side by side
        for impl, model in models.items():
            fn = _prefill(model, ids) if what == "prefill" else _train(model, ids[:, :n_train])
            row: dict[str, Any] = {"model": "mistral-shape", "what": what, "impl": impl,
                                   "tokens": n_pre if what == "prefill" else n_train}  # fmt: skip
            if budget.over():
                row["skipped"] = "budget spent"
            else:
                try:
                    with served() as seen:
                        row.update(first_and_warm(fn, device, repeats))
                    row["served_by"] = dict(seen)
                except Exception as e:
                    row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  hf {row}", flush=True)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del models
    for what in ("prefill", "train step"):
        a, b = (
            next((r for r in rows if r["what"] == what and r["impl"] == i), {}) for i in ("multihead", "sdpa")
        )
        ratio = time_ratio(a, b)  # "same within noise" where the spreads overlap
        if ratio is not None:
            rows.append({"model": "mistral-shape", "what": what, "multihead_over_sdpa_time": ratio})
            print(
                f"  hf {what}: multihead takes {ratio}{'x' if isinstance(ratio, float) else ''} sdpa's time"
            )
    return rows


def _prefill(model, ids):
    def fn():
        with torch.no_grad():
            return model(ids, logits_to_keep=1)

    return fn


def _train(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def fn():
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()

    return fn


def tiny_configs() -> dict[str, Any]:
    import transformers as T

    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    return {
        "gemma2-shape (soft-cap 50, window 128)": lambda: T.Gemma2Config(
            **common, sliding_window=128, attn_logit_softcapping=50.0, query_pre_attn_scalar=64
        ),
        "gpt-oss-shape (sinks, window 128)": lambda: T.GptOssConfig(
            **common,
            sliding_window=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
    }


def tiny_rows(device: torch.device, small: bool, budget: Budget) -> list[dict]:
    """Gemma-2 and gpt-oss shapes through multihead: which backend served, logits vs eager."""
    from transformers import AutoModelForCausalLM

    multihead.hf.register()
    n = 96 if small else 1024
    rows = []
    for name, make in tiny_configs().items():
        row: dict[str, Any] = {"model": name, "tokens": n}
        if budget.over():
            rows.append(dict(row, skipped="budget spent"))
            continue
        try:
            torch.manual_seed(0)
            cfg = make()
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(device).eval()
            ids = torch.randint(0, 1000, (1, n), device=device)
            with torch.no_grad():
                ref = model(ids).logits.float()
                model.set_attn_implementation("multihead")
                with served() as seen:
                    got = model(ids).logits.float()
            row["served_by"] = dict(seen)
            row["max_abs_logit_diff_vs_eager"] = float((got - ref).abs().max())
            row["fused"] = (
                bool(seen) and not ({"tiled", "matrix"} & set(seen)) if device.type == "cuda" else None
            )
        except Exception as e:
            row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"  hf {row}", flush=True)
        rows.append(row)
    return rows
