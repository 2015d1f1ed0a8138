"""Study section: KV-cache size of MHA vs GQA vs MQA."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

import torch

from ... import cost
from ..context import Section, StudyContext, Table, dtype_name

# -- section (c): KV cache ---------------------------------------------------------------------------
KV_MODELS = {
    # name: (n_layers, n_heads, head_dim, seq_len, dtype)
    "original Transformer (6 layers, d 512, N 1024)": (6, 8, 64, 1024, torch.float32),
    "LLaMA-7B shape (32 layers, d 4096, 4096 tokens)": (32, 32, 128, 4096, torch.float16),
}


def kv_cache(ctx: StudyContext) -> Section:
    """KV-cache bytes of MHA vs GQA vs MQA for one sequence (batch 1)."""
    rows, data = [], []
    for model, (layers, n_heads, hd, n, dtype) in KV_MODELS.items():
        for var in cost.compare_kv_heads(layers, 1, n, n_heads, hd, dtype):
            dt = dtype_name(dtype)
            rows.append([model, var.name, str(var.n_kv_heads), dt, f"{var.mib:,.1f}", f"{var.vs_mha:.3f}"])
            data.append({"model": model, "dtype": dt, **asdict(var), "mib": var.mib})
    table = Table(
        "KV cache per sequence (K and V, all layers)",
        ["model", "variant", "kv heads", "dtype", "MiB", "vs MHA"],
        rows,
        align="llrlrr",
    )
    note = "The cache holds only the kv heads: GQA with Hkv kv heads stores Hkv/Hq of MHA's bytes."
    figures = ctx.figure(
        "kv-cache",
        "KV-cache MiB per sequence by kv-head count (log scale).",
        partial(_plot_kv, data),
    )
    return Section("kv_cache", "KV cache: MHA vs GQA vs MQA", {"rows": data}, [table], [note], figures)


def _plot_kv(data: list[dict], ax: Any) -> None:
    for model in dict.fromkeys(d["model"] for d in data):
        pts = [(d["n_kv_heads"], d["mib"]) for d in data if d["model"] == model]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("kv heads")
    ax.set_ylabel("MiB per sequence")
    ax.legend(fontsize=7)
