"""A TransformerLM of :class:`~multihead.variants.LatentAttention` layers as a DeepSeek-V3 checkpoint.

``mh.heads.to_mla`` turns a LLaMA / Mistral / Qwen2 model into multi-head latent attention with MHA2MLA's
partial RoPE (one rotary key per kv head, each rotating the pairs that head kept at their original
frequencies) and no latent norm. transformers' ``DeepseekV3Attention`` (DeepSeek-AI, 2024, "DeepSeek-V3
Technical Report") holds one rotary key shared by every head, always RMS-normalises the latent, and has
no query bias outside its low-rank query path. :func:`deepseek_state` writes the converted layer in that
form with the same function, by three exact re-parametrisations:

- **rotary keys**: DeepSeek's rotary key of width ``qk_rope_head_dim = D`` (the source head dim) with the
  source's ``rope_theta`` rotates pair j at ``theta^(-2j/D)`` - exactly the source's frequencies. Kv head
  g's kept pair p goes to pair p of the shared key, its query heads put their rotary features there
  and zeros in every other pair, so ``q_i^R . k^R`` is the score of head i's own rotary key. This needs
  each pair kept by at most one kv head: ``to_mla(..., rope_select="disjoint")`` converts so (two heads
  that keep the same frequency would need two features of it; the error says so). A model with one
  shared ``RotaryEmbedding`` key (DeepSeek-V3 itself, through ``from_hf``) maps pair for pair.
- **the latent norm**: DeepSeek computes ``RMSNorm(c)`` of the latent c (width r) with epsilon 1e-6 and
  no way to switch it off. One extra latent channel holding the constant C = 2^40 (the bias of
  ``kv_a_proj_with_mqa``; its column of ``kv_b_proj`` is zero) makes the norm a constant scale:
  ``C c_j / sqrt((|c|^2 + C^2) / (r + 1)) = sqrt(r + 1) c_j / sqrt(1 + |c|^2 / C^2)``, which is
  ``sqrt(r + 1) c_j`` to float32 rounding for any |c| < 2^28; ``kv_b_proj`` takes ``1 / sqrt(r + 1)``.
  The cache holds one number more per token (r + 1 + D), and the constant needs ``attention_bias``
  (float32 / bfloat16 only: 2^40 overflows float16).
- **query biases** (Qwen2): ``q_proj`` has no bias in DeepSeek-V3, its low-rank path ``q_a_proj`` does,
  so a biased query becomes ``q_a_proj`` = [identity; 0] (width d + 1) with the same constant channel
  trick through ``q_a_layernorm`` and ``q_b_proj`` = [W_Q | b_Q] / sqrt(d + 1).

The softmax scale ``(qk_nope_head_dim + qk_rope_head_dim)^-1/2`` of DeepSeek becomes the source's
1 / sqrt(D) by scaling the queries. Layers are all dense (``first_k_dense_replace`` = the layer count),
``rope_scaling`` none, rotary pairs interleaved (``rope_interleave``, DeepSeek's default layout).

Shape legend: d width, H heads, Dn nope dims, R rope dims per rotary key, G rotary keys, R' =
qk_rope_head_dim, r kv_rank, Dv value head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..nn.positions import PartialRotary, RotaryEmbedding
from ..variants.latent import LatentAttention

__all__ = ["NORM_CONSTANT", "block_state_dict", "deepseek_state", "rope_layout"]

#: The constant latent channel that turns DeepSeek's latent RMSNorm into a fixed scale (a power of two:
#: exact in every float format that holds it).
NORM_CONSTANT = 2.0**40


def block_state_dict(model: Any) -> dict[str, Tensor]:
    """Everything of a LLaMA-style TransformerLM but its attention, under transformers' names:
    embeddings, SwiGLU MLPs, pre-norms, final norm and head (shared by LLaMA and DeepSeek-V3 layers)."""
    sd: dict[str, Tensor] = {"model.embed_tokens.weight": model.embed.weight.detach().clone()}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "mlp.gate_proj.weight"] = layer.ffn.w1.weight.detach().clone()
        sd[p + "mlp.up_proj.weight"] = layer.ffn.w3.weight.detach().clone()
        sd[p + "mlp.down_proj.weight"] = layer.ffn.w2.weight.detach().clone()
        sd[p + "input_layernorm.weight"] = layer.attn_norm.weight.detach().clone()
        sd[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight.detach().clone()
    sd["model.norm.weight"] = model.final_norm.weight.detach().clone()
    sd["lm_head.weight"] = model.lm_head.weight.detach().clone()
    return sd


def _layers(model: Any) -> list[LatentAttention]:
    """The model's LatentAttention layers, all of one shape.

    Raises:
        ValueError: other layers, uneven shapes, no rotary, a sliding window, absolute positions.
    """
    attns = [layer.self_attn for layer in model.layers]
    if any(not isinstance(a, LatentAttention) for a in attns):
        kinds = sorted({type(a).__name__ for a in attns})
        raise ValueError(
            f"DeepSeek-V3 checkpoints hold latent attention in every layer; this model has {kinds}"
        )
    if model.positions != "rotary" or attns[0].rotary is None:
        raise ValueError(
            f"DeepSeek-V3 checkpoints have rotary positions only; this latent-attention model has "
            f"positions={model.positions!r} (a model with absolute positions such as GPT-2 or BERT cannot be "
            "written as one; keep it as a multihead model with mh.heads.save_converted)"
        )
    if model.sliding_window is not None and model.sliding_window < model.max_len:
        raise ValueError(
            f"this model attends over a sliding window of {model.sliding_window} tokens (Mistral); "
            "DeepSeek-V3 attends over every earlier token, so its checkpoint would compute other logits past "
            "the window; keep it as a multihead model (mh.heads.save_converted)"
        )
    keys = [
        (a.n_heads, a.kv_rank, a.q_rank, a.rope_dims, a.nope_dims, a.v_head_dim, a.rope_heads) for a in attns
    ]
    if len(set(keys)) > 1:
        raise ValueError(f"layers have different latent-attention shapes {sorted(set(keys))}: DeepSeek-V3 "
                         "configs hold one shape for every layer")  # fmt: skip
    return attns


def rope_layout(attn: LatentAttention) -> tuple[Tensor, int, float]:
    """Where each rotary feature of ``attn`` goes in DeepSeek's interleaved rotary key: (G, R) indices
    into [0, R'), with R' and the rotary base.

    Raises:
        ValueError: a rotary that is neither a PartialRotary nor a RotaryEmbedding, or pairs kept by two
            kv heads.
    """
    rot, G, R = attn.rotary, attn.rope_heads, attn.rope_dims
    if isinstance(rot, PartialRotary):
        pairs = rot.pairs.cpu()  # (G, P)
        counts = torch.bincount(pairs.flatten(), minlength=rot.full.head_dim // 2)
        if int(counts.max()) > 1:
            shared = torch.nonzero(counts > 1).flatten().tolist()
            raise ValueError(
                f"rotary pairs {shared} are kept by more than one kv head ({G} rotary keys): DeepSeek-V3 has "
                "one rotary key shared by all heads, with each frequency once, so two heads' features of one "
                "frequency cannot both be held. Convert with mh.heads.to_mla(..., rope_select='disjoint') "
                "(`multihead heads convert --rope-select disjoint`), which keeps each pair in one kv head "
                f"(kv heads x rope_dims <= head dim {rot.full.head_dim})"
            )
        layout = torch.cat([2 * pairs, 2 * pairs + 1], dim=1)  # (G, R): first features, then second
        return layout, rot.full.head_dim, rot.base
    if isinstance(rot, RotaryEmbedding) and G == 1:
        j = torch.arange(R // 2)
        layout = torch.arange(R) if rot.interleaved else torch.cat([2 * j, 2 * j + 1])  # (R,)
        return layout[None], R, rot.base  # (1, R)
    raise ValueError(f"DeepSeek-V3 checkpoints rotate with plain RoPE; this layer's rotary is {rot!r}")


def _query_rows(w: Tensor, attn: LatentAttention, layout: Tensor, width: int) -> Tensor:
    """Query rows (H (Dn + R), k) -> DeepSeek's (H (Dn + R'), k): nope rows as they are, rope rows moved
    to their head group's pairs, zeros in the other pairs."""
    H, Dn, R, G = attn.n_heads, attn.nope_dims, attn.rope_dims, attn.rope_heads
    src = w.reshape(H, Dn + R, -1)  # (H, Dn + R, k)
    out = src.new_zeros(H, Dn + width, src.shape[-1])  # (H, Dn + R', k)
    out[:, :Dn] = src[:, :Dn]
    slots = Dn + layout.repeat_interleave(H // G, dim=0)  # (H, R)
    out.scatter_(1, slots[..., None].expand(H, R, src.shape[-1]), src[:, Dn:])
    return out.reshape(H * (Dn + width), -1)  # (H (Dn + R'), k)


def _with_bias(w: Tensor, b: Tensor | None) -> Tensor:
    """[W | b] (m, k + 1): a bias as one more input column."""
    b = w.new_zeros(w.shape[0]) if b is None else b
    return torch.cat([w, b[:, None]], dim=1)  # (m, k + 1)


def _constant_channel(w: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """A down projection (k, d) with one more output row - weight zeros, bias C - and its RMSNorm weight:
    C for the k real channels (out ``sqrt(k + 1) c_j``), 1 for the constant (out ``sqrt(k + 1)``, which
    carries a bias through the up projection's last column); the up projection then takes
    1 / sqrt(k + 1) (see the module docstring). Returns weight (k + 1, d), bias (k + 1,), norm (k + 1,)."""
    k = w.shape[0]
    weight = torch.cat([w, w.new_zeros(1, w.shape[1])])  # (k + 1, d)
    bias = torch.cat([w.new_zeros(k) if b is None else b, w.new_full((1,), NORM_CONSTANT)])  # (k + 1,)
    norm = torch.cat([w.new_full((k,), NORM_CONSTANT), w.new_ones(1)])  # (k + 1,)
    return weight, bias, norm


def _query_bias(attn: LatentAttention) -> bool:
    """Whether the layer has a non-zero query bias on a full query projection."""
    b = None if attn.q_proj is None else attn.q_proj.bias
    return b is not None and bool(b.detach().any())


def _needs_bias(attn: LatentAttention) -> bool:
    """Whether the layer needs DeepSeek-V3's ``attention_bias``."""
    return (
        attn.kv_norm is None or _query_bias(attn) or attn.o_proj.bias is not None
        or attn.kv_down.bias is not None or (attn.q_down is not None and attn.q_down.bias is not None)
    )  # fmt: skip


def _query(attn: LatentAttention, p: str, sd: dict[str, Tensor], identity: bool, gain: float) -> int | None:
    """The query weights into ``sd``: q_proj, the LoRA path as it is, or (``identity``: a query bias)
    q_a_proj = [identity; 0] with the constant channel. Returns q_lora_rank."""
    layout, width, _ = rope_layout(attn)
    if attn.q_proj is not None and not identity:
        sd[p + "q_proj.weight"] = _query_rows(attn.q_proj.weight.detach(), attn, layout, width) * gain
        return None
    if attn.q_proj is not None:  # the query bias becomes a q_b_proj column
        wq, bq, d = attn.q_proj.weight.detach(), attn.q_proj.bias, attn.d_model
        eye = torch.eye(d, dtype=wq.dtype, device=wq.device)  # (d, d)
        sd[p + "q_a_proj.weight"], sd[p + "q_a_proj.bias"], sd[p + "q_a_layernorm.weight"] = (
            _constant_channel(eye, None)
        )
        up = _with_bias(wq, None if bq is None else bq.detach()) / math.sqrt(d + 1)  # (H (Dn + R), d + 1)
        sd[p + "q_b_proj.weight"] = _query_rows(up, attn, layout, width) * gain
        return d + 1
    assert attn.q_down is not None and attn.q_norm is not None and attn.q_up is not None
    sd[p + "q_a_proj.weight"] = attn.q_down.weight.detach().clone()
    b = attn.q_down.bias
    sd[p + "q_a_proj.bias"] = (
        attn.q_down.weight.new_zeros(attn.q_down.out_features) if b is None else b.detach().clone()
    )
    sd[p + "q_a_layernorm.weight"] = attn.q_norm.weight.detach().clone()
    sd[p + "q_b_proj.weight"] = _query_rows(attn.q_up.weight.detach(), attn, layout, width) * gain
    return attn.q_rank


def _attention(
    attn: LatentAttention, p: str, sd: dict[str, Tensor], bias: bool, identity: bool
) -> dict[str, Any]:
    """One layer's DeepSeek-V3 attention weights into ``sd`` under prefix ``p`` (biases when ``bias``:
    ``attention_bias`` is one switch for every layer); return its config values."""
    layout, width, base = rope_layout(attn)
    Dn, r, G, R, d = attn.nope_dims, attn.kv_rank, attn.rope_heads, attn.rope_dims, attn.d_model
    scale = attn.score_scale
    assert scale is not None  # LatentAttention always sets it
    q_rank = _query(attn, p, sd, identity, scale * math.sqrt(Dn + width))
    w, bias_ = attn.kv_down.weight.detach(), attn.kv_down.bias
    b = w.new_zeros(w.shape[0]) if bias_ is None else bias_.detach()
    up = attn.kv_up.weight.detach()  # (H (Dn + Dv), r)
    if attn.kv_norm is None:
        w_lat, b_lat, norm = _constant_channel(w[:r], b[:r])  # (r + 1, d), (r + 1,), (r + 1,)
        up = torch.cat([up, up.new_zeros(up.shape[0], 1)], dim=1) / math.sqrt(r + 1)  # (H (Dn+Dv), r+1)
    else:
        w_lat, b_lat, norm = w[:r], b[:r], attn.kv_norm.weight.detach()
    rope_w, rope_b = w.new_zeros(width, d), w.new_zeros(width)  # (R', d), (R',): unkept pairs stay zero
    rope_w[layout.flatten()] = w[r:].reshape(G * R, d)
    rope_b[layout.flatten()] = b[r:]
    sd[p + "kv_a_proj_with_mqa.weight"] = torch.cat([w_lat, rope_w])  # (r' + R', d)
    sd[p + "kv_a_layernorm.weight"] = norm.clone()
    sd[p + "kv_b_proj.weight"] = up.clone()
    sd[p + "o_proj.weight"] = attn.o_proj.weight.detach().clone()
    if bias:
        sd[p + "kv_a_proj_with_mqa.bias"] = torch.cat([b_lat, rope_b])  # (r' + R',)
        o_b = attn.o_proj.bias
        sd[p + "o_proj.bias"] = w.new_zeros(d) if o_b is None else o_b.detach().clone()
    else:
        sd.pop(p + "q_a_proj.bias", None)
    return {"kv_lora_rank": norm.shape[0], "q_lora_rank": q_rank, "qk_rope_head_dim": width,
            "rope_theta": base}  # fmt: skip


def deepseek_state(model: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The DeepSeek-V3 config (a dict for ``AutoConfig.for_model``) and state dict of a TransformerLM of
    LatentAttention layers (see the module docstring).

    Raises:
        ValueError: layers other than LatentAttention or of different shapes, absolute positions, a
            sliding window, rotary keys that share a frequency, a float16 model that needs the constant
            latent channel.
    """
    attns = _layers(model)
    a0 = attns[0]
    if model.embed.weight.dtype == torch.float16 and (a0.kv_norm is None or a0.q_proj is not None):
        raise ValueError(
            "a float16 model cannot hold the constant latent channel (2^40) that neutralises DeepSeek-V3's "
            "latent RMSNorm: convert in float32 or bfloat16 (model.float()) and cast afterwards to bfloat16"
        )
    bias = any(_needs_bias(a) for a in attns)
    identity = any(_query_bias(a) for a in attns)
    sd = block_state_dict(model)
    per_layer = [
        _attention(a, f"model.layers.{i}.self_attn.", sd, bias, identity) for i, a in enumerate(attns)
    ]
    sizes = per_layer[0]
    if any(s != sizes for s in per_layer):
        raise ValueError(f"layers convert to different DeepSeek-V3 sizes {per_layer}: its config holds one")
    config: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "vocab_size": model.vocab_size,
        "hidden_size": a0.d_model,
        "intermediate_size": model.layers[0].ffn.w1.out_features,
        "num_hidden_layers": len(attns),
        "first_k_dense_replace": len(attns),  # every layer a dense MLP
        "num_attention_heads": a0.n_heads,
        "num_key_value_heads": a0.n_heads,
        "qk_nope_head_dim": a0.nope_dims,
        "v_head_dim": a0.v_head_dim,
        "max_position_embeddings": model.max_len,
        "rms_norm_eps": model.final_norm.eps,
        "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": sizes.pop("rope_theta")},
        "tie_word_embeddings": model.lm_head.weight is model.embed.weight,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "attention_bias": bias,
        **sizes,
    }
    return config, sd
