"""A tiny LLaMA checkpoint in Hugging Face's layout (config.json + model.safetensors), written without
transformers, for the tests that break checkpoint files on purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The config of the tiny checkpoint: 2 layers, 2 query heads over 1 kv head, width 16.
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def tiny_state_dict(config: dict[str, Any] = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights named as transformers' LlamaForCausalLM names them (tied head: no lm_head)."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    sd = {"model.embed_tokens.weight": torch.randn(v, d, generator=g), "model.norm.weight": torch.ones(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (d, d),
            "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d),
            "self_attn.o_proj.weight": (d, d),
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
        }
        sd.update({p + k: 0.1 * torch.randn(*s, generator=g) for k, s in shapes.items()})
        sd[p + "input_layernorm.weight"] = torch.ones(d)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(d)
    return sd


def write_tiny(folder: Path, config: dict[str, Any] | None = None, sd: dict | None = None) -> Path:
    """Write the tiny checkpoint (or ``config`` / ``sd`` in its place) into ``folder``; return it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    save_file(tiny_state_dict() if sd is None else sd, str(folder / "model.safetensors"))
    return folder
