"""A multihead :class:`TransformerLM` back to a transformers model, so head surgery reaches HF checkpoints.

:func:`to_hf` is the inverse of ``from_hf`` for the LLaMA family (LLaMA, Mistral, Qwen2: rotary, RMSNorm,
SwiGLU) and GPT-2 (learned positions, LayerNorm, GELU). The config is written from the model as it is
now, so a model changed by ``mh.heads.to_gqa`` gets its new ``num_key_value_heads`` and one changed by
``mh.heads.prune`` (the same number of heads left in every layer) its new ``num_attention_heads`` with an
explicit ``head_dim``. ``save_pretrained`` on the result writes a checkpoint that plain transformers
loads. transformers is imported only when :func:`to_hf` runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from .to_hf_mla import block_state_dict, deepseek_state

__all__ = ["to_hf"]


def _attentions(model: Any) -> list[MultiHeadAttention]:
    attns = [layer.self_attn for layer in model.layers]
    bad = [i for i, a in enumerate(attns) if type(a) is not MultiHeadAttention]
    if bad:
        raise ValueError(
            f"layers {bad} hold {type(attns[bad[0]]).__name__}, not a MultiHeadAttention: transformers "
            "models have no such layer (a layer pruned to zero heads cannot be written back)"
        )
    shapes = [(a.n_heads, a.n_kv_heads, a.head_dim) for a in attns]
    if len(set(shapes)) > 1:
        per_layer = ", ".join(f"layer {i}: {h}/{kv}/{d}" for i, (h, kv, d) in enumerate(shapes))
        raise ValueError(
            f"layers have different (heads, kv heads, head_dim): {per_layer}. The transformers configs of "
            "the families to_hf writes (LLaMA, Mistral, Qwen2, GPT-2, BERT) hold one num_attention_heads / "
            "num_key_value_heads / head_dim for every layer, and their modeling code does not read a "
            "per_layer_config override of them (transformers refuses the global value then), so a model "
            "with uneven per-layer pruning cannot be written back: prune or convert every layer to the same "
            "head counts (e.g. mh.heads.prune with the same number of heads in each layer), or keep the "
            "multihead model"
        )
    return attns


def _split_qkv(attn: Any, prefix: str, sd: dict[str, Tensor], names=("q", "k", "v")) -> None:
    """qkv_proj rows q|k|v -> three HF projections."""
    D = attn.head_dim
    sizes = [attn.n_heads * D, attn.n_kv_heads * D, attn.n_kv_heads * D]
    for what in ("weight", "bias"):
        t = getattr(attn.qkv_proj, what)
        if t is None:
            continue
        for name, part in zip(names, torch.split(t.detach(), sizes, dim=0)):
            sd[f"{prefix}{name}_proj.{what}"] = part.clone()


def _family(model: Any) -> str:
    layer = model.layers[0]
    ffn = layer.ffn
    designs = {type(lyr.self_attn).__name__ for lyr in model.layers} - {"MultiHeadAttention"}
    if designs:
        raise ValueError(
            f"to_hf writes the textbook attention of these families (and latent attention as DeepSeek-V3); "
            f"this model's layers use {sorted(designs)}, which their transformers classes cannot hold; "
            "save it with mh.heads.save_converted instead"
        )
    if model.positions == "rotary" and hasattr(ffn, "w1") and hasattr(ffn, "w3"):
        attn = layer.self_attn
        has_qkv_bias = getattr(attn.qkv_proj, "bias", None) is not None
        if has_qkv_bias:
            return "qwen2"
        return "mistral" if model.sliding_window is not None else "llama"
    if model.positions == "learned" and hasattr(ffn, "linear1"):
        return "gpt2"
    raise ValueError(
        f"to_hf supports TransformerLMs of the LLaMA family (rotary + SwiGLU) and GPT-2 (learned positions), "
        f"got positions={model.positions!r} with a {type(ffn).__name__} feed-forward"
    )


def _llama(model: Any, family: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    attns = _attentions(model)
    a0 = attns[0]
    d = model.embed.weight.shape[1]
    tied = model.lm_head.weight is model.embed.weight
    config: dict[str, Any] = {
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": d,
        "intermediate_size": model.layers[0].ffn.w1.out_features,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": a0.n_heads,
        "num_key_value_heads": a0.n_kv_heads,
        "head_dim": a0.head_dim,
        "max_position_embeddings": model.max_len,
        "rms_norm_eps": model.final_norm.eps,
        "rope_theta": a0.rotary.base if a0.rotary is not None else 10000.0,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
    }
    if family == "mistral":
        config["sliding_window"] = model.sliding_window
    if family == "qwen2":
        config["use_sliding_window"] = model.sliding_window is not None
        config["sliding_window"] = model.sliding_window
    if family == "llama":
        config["attention_bias"] = False
    sd = block_state_dict(model)
    for i, attn in enumerate(attns):
        p = f"model.layers.{i}."
        _split_qkv(attn, p + "self_attn.", sd)
        sd[p + "self_attn.o_proj.weight"] = attn.o_proj.weight.detach().clone()
        if attn.o_proj.bias is not None:
            raise ValueError(f"layer {i} has an o_proj bias, which {family} checkpoints do not hold")
    return config, sd


_GPT2_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _gpt2_activation(model: Any) -> str:
    act = model.layers[0].ffn.activation
    if act not in _GPT2_ACT:
        raise ValueError(f"GPT-2 checkpoints have no {act!r} activation; supported: {sorted(_GPT2_ACT)}")
    return act


def _gpt2(model: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    attns = _attentions(model)
    a0 = attns[0]
    d = model.embed.weight.shape[1]
    if a0.n_kv_heads != a0.n_heads or a0.n_heads * a0.head_dim != d:
        raise ValueError(
            "GPT-2 has full multi-head attention with n_heads * head_dim = d_model; this model has "
            f"{a0.n_heads} heads, {a0.n_kv_heads} kv heads of dim {a0.head_dim} "
            f"(d_model={d}): GPT-2 checkpoints cannot hold it"
        )
    config: dict[str, Any] = {
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_embd": d,
        "n_layer": len(model.layers),
        "n_head": a0.n_heads,
        "n_positions": model.max_len,
        "n_inner": model.layers[0].ffn.linear1.out_features,
        "layer_norm_epsilon": model.final_norm.eps,
        "activation_function": _GPT2_ACT[_gpt2_activation(model)],
        "tie_word_embeddings": model.lm_head.weight is model.embed.weight,
    }

    def conv(t: Tensor) -> Tensor:  # Linear (d_out, d_in) -> Conv1D (d_in, d_out)
        return t.detach().t().contiguous() if t.dim() == 2 else t.detach().clone()

    sd: dict[str, Tensor] = {
        "transformer.wte.weight": model.embed.weight.detach().clone(),
        "transformer.wpe.weight": model.pos_embed.weight.detach().clone(),
    }
    for i, layer in enumerate(model.layers):
        p = f"transformer.h.{i}."
        for src, dst in (
            (layer.attn_norm, "ln_1"),
            (layer.ffn_norm, "ln_2"),
            (layer.self_attn.qkv_proj, "attn.c_attn"),
            (layer.self_attn.o_proj, "attn.c_proj"),
            (layer.ffn.linear1, "mlp.c_fc"),
            (layer.ffn.linear2, "mlp.c_proj"),
        ):
            lin = isinstance(src, nn.Linear)
            sd[f"{p}{dst}.weight"] = conv(src.weight) if lin else src.weight.detach().clone()
            sd[f"{p}{dst}.bias"] = src.bias.detach().clone()
    sd["transformer.ln_f.weight"] = model.final_norm.weight.detach().clone()
    sd["transformer.ln_f.bias"] = model.final_norm.bias.detach().clone()
    sd["lm_head.weight"] = model.lm_head.weight.detach().clone()
    return config, sd


_BERT_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _bert(model: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    layers = list(model.encoder.layers)
    attns = [layer.self_attn for layer in layers]
    a0 = attns[0]
    d = model.embeddings.word.weight.shape[1]
    if any(type(a) is not MultiHeadAttention for a in attns) or any(
        (a.n_heads, a.n_kv_heads, a.head_dim) != (a0.n_heads, a0.n_heads, d // a0.n_heads) for a in attns
    ):
        raise ValueError(
            "BERT checkpoints hold full multi-head attention with n_heads * head_dim = hidden_size in every "
            "layer; this encoder was changed (GQA or pruned heads), which BertModel cannot hold"
        )
    act = layers[0].ffn.activation
    if act not in _BERT_ACT:
        raise ValueError(f"BERT checkpoints have no {act!r} activation; supported: {sorted(_BERT_ACT)}")
    emb = model.embeddings
    config: dict[str, Any] = {
        "model_type": "bert",
        "vocab_size": emb.word.weight.shape[0],
        "hidden_size": d,
        "num_hidden_layers": len(layers),
        "num_attention_heads": a0.n_heads,
        "intermediate_size": layers[0].ffn.linear1.out_features,
        "max_position_embeddings": model.max_len,
        "type_vocab_size": emb.token_type.weight.shape[0],
        "layer_norm_eps": emb.norm.eps,
        "hidden_act": _BERT_ACT[act],
    }
    sd: dict[str, Tensor] = {
        "embeddings.word_embeddings.weight": emb.word.weight.detach().clone(),
        "embeddings.position_embeddings.weight": emb.position.weight.detach().clone(),
        "embeddings.token_type_embeddings.weight": emb.token_type.weight.detach().clone(),
        "embeddings.LayerNorm.weight": emb.norm.weight.detach().clone(),
        "embeddings.LayerNorm.bias": emb.norm.bias.detach().clone(),
    }
    for i, (layer, attn) in enumerate(zip(layers, attns)):
        p = f"encoder.layer.{i}."
        _split_qkv(attn, p + "attention.self.", sd, names=("query", "key", "value"))
        for key in [k for k in sd if k.startswith(p + "attention.self.") and "_proj." in k]:
            sd[key.replace("_proj.", ".")] = sd.pop(key)
        for src, dst in (
            (attn.o_proj, "attention.output.dense"),
            (layer.attn_norm, "attention.output.LayerNorm"),
            (layer.ffn.linear1, "intermediate.dense"),
            (layer.ffn.linear2, "output.dense"),
            (layer.ffn_norm, "output.LayerNorm"),
        ):
            sd[f"{p}{dst}.weight"] = src.weight.detach().clone()
            sd[f"{p}{dst}.bias"] = src.bias.detach().clone()
    if model.pooler is not None:
        sd["pooler.dense.weight"] = model.pooler.weight.detach().clone()
        sd["pooler.dense.bias"] = model.pooler.bias.detach().clone()
    return config, sd


def _bert_to_hf(model: Any) -> nn.Module:
    import transformers

    config, sd = _bert(model)
    hf = transformers.BertModel(
        transformers.BertConfig(**{k: v for k, v in config.items() if k != "model_type"}),
        add_pooling_layer=model.pooler is not None,
    ).to(model.embeddings.word.weight.dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith("embeddings.") or "position_ids" not in k]
    missing = [k for k in missing if "token_type_ids" not in k]
    if missing or unexpected:
        raise ValueError(
            f"BertModel does not take the converted weights: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    return hf.to(model.embeddings.word.weight.device).eval()


def to_hf(model: nn.Module) -> nn.Module:
    """The transformers model with the weights and the current shape of ``model``.

    Args:
        model: a :class:`TransformerLM` of the LLaMA family (from ``from_hf`` of a LLaMA / Mistral / Qwen2
            checkpoint, or ``random_lm``) or of GPT-2, possibly changed by ``mh.heads.to_gqa`` or
            ``mh.heads.prune`` (every layer left with the same heads); a LLaMA-family model converted by
            ``mh.heads.to_mla`` (``rope_select="disjoint"`` - see :mod:`multihead.pretrained.to_hf_mla`)
            or loaded from DeepSeek-V3; or a :class:`Bert` (unchanged heads).

    Returns:
        A ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``GPT2LMHeadModel`` /
        ``DeepseekV3ForCausalLM`` (latent attention, all layers dense) / ``BertModel`` in eval mode, in
        the model's dtype, whose config carries the edited head counts.

    Raises:
        ValueError: another kind of model, weights the family cannot hold (e.g. latent attention whose
            rotary keys share a frequency, or with a sliding window), or layers of different shapes
            (uneven per-layer pruning: these families' configs hold one head count for every layer, and
            their modeling code does not read transformers' ``per_layer_config`` overrides of it).
        ImportError: transformers is not installed.
    """
    if type(model).__name__ == "Bert" and hasattr(model, "embeddings") and hasattr(model, "encoder"):
        return _bert_to_hf(model)
    if not isinstance(model, TransformerLM):
        raise ValueError(
            f"to_hf expects a multihead TransformerLM or Bert (from mh.pretrained.from_hf), got "
            f"{type(model).__name__}"
        )
    if any(type(layer.self_attn).__name__ == "LatentAttention" for layer in model.layers):
        family = "deepseek_v3"
        config, sd = deepseek_state(model)
    else:
        family = _family(model)
        config, sd = _gpt2(model) if family == "gpt2" else _llama(model, family)
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mh.pretrained.to_hf needs transformers; `pip install multihead[hf]`") from e
    hf_config = transformers.AutoConfig.for_model(**config)
    dtype = model.embed.weight.dtype
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [
        k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))
    ]
    if config.get("tie_word_embeddings"):
        missing = [k for k in missing if k != "lm_head.weight"]
        unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"the {family} model does not take the converted weights: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    if config.get("tie_word_embeddings"):
        hf.tie_weights()
    return hf.to(model.embed.weight.device).eval()
