"""BERT (and sentence-transformers' MiniLM) as a multihead :class:`Encoder` of post-LN layers.

    ids (B, N) -> word + position + token-type embeddings -> LayerNorm
               -> n_layers x TransformerLayer, post-LN (docs/equations.md, eq. (8)-(13)), GELU FFN
               -> (B, N, d)

The layer of BERT is exactly the post-LN layer of docs/equations.md, eq. (6)-(7):
``T3 = LayerNorm(X + MHA(X))``, ``H = LayerNorm(T3 + FFN(T3))``. Padded batches use
``mh.key_padding(attention_mask)``; packed batches (several sequences concatenated in one row) use
``mh.document(document_ids)`` and positions that restart at each document,
so a packed row computes what each of its sequences alone would.

Shape legend: B batch rows, N tokens per row, d = hidden size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.masks import Mask, document, key_padding
from ..nn.layers import Encoder, TransformerLayer, per_layer_head_masks
from ..nn.positions import LearnedPositions
from ..nn.unpadded import Varlen, unpadded_layer, why_not_unpadded
from .convert import Rule, align_biases, cfg, fuse_qkv, load_converted, rename

__all__ = ["Bert", "BertEmbeddings", "bert_from_state_dict", "positions_in_documents"]

#: Hugging Face ``hidden_act`` -> FeedForward activation.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """Position of each token within its document: (B, N) ids of contiguous documents -> (B, N) long.

    ``[[7, 7, 7, 3, 3, 9]] -> [[0, 1, 2, 0, 1, 0]]``.
    """
    B, N = document_ids.shape
    idx = torch.arange(N, device=document_ids.device).expand(B, N)  # (B, N)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # (B, N): True where a document begins
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, N) start index
    return idx - first


class BertEmbeddings(nn.Module):
    """Word + learned position + token-type embeddings, then LayerNorm (dropout only in training)."""

    def __init__(self, vocab_size: int, d: int, max_len: int, type_vocab_size: int, eps: float, dropout=0.0):
        super().__init__()
        self.word = nn.Embedding(vocab_size, d)
        self.position = LearnedPositions(max_len, d)
        self.token_type = nn.Embedding(type_vocab_size, d)
        self.norm = nn.LayerNorm(d, eps=eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: Tensor, positions: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """ids (B, N), positions (N,) or (B, N), token types (B, N) or None (all 0) -> (B, N, d)."""
        x = self.word(ids) + self.position(positions)  # (B, N, d)
        if token_type_ids is None:  # type 0 everywhere: one row, looked up (an int8 table has no .weight)
            token_type_ids = ids.new_zeros(1)  # (1,) broadcast over (B, N)
        x = x + self.token_type(token_type_ids)  # (B, N, d)
        return self.drop(self.norm(x))


class Bert(nn.Module):
    """A BERT encoder: :class:`BertEmbeddings`, a multihead :class:`Encoder`, an optional pooler.

    Build it with :func:`multihead.pretrained.from_hf` (a transformers ``BertModel``) or
    :func:`bert_from_state_dict`. ``forward`` returns the last hidden state (B, N, d), what Hugging Face
    calls ``last_hidden_state``; :meth:`pool` gives ``pooler_output``.
    """

    def __init__(self, config: Any):
        super().__init__()
        act = cfg(config, "hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported; supported: {list(ACTIVATIONS)}")
        if cfg(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT with position_embedding_type='absolute' is supported")
        d, eps = cfg(config, "hidden_size"), cfg(config, "layer_norm_eps", 1e-12)
        self.max_len = cfg(config, "max_position_embeddings")
        self.embeddings = BertEmbeddings(
            cfg(config, "vocab_size"), d, self.max_len, cfg(config, "type_vocab_size", 2), eps
        )
        self.encoder = Encoder(
            cfg(config, "num_hidden_layers"),
            d,
            cfg(config, "num_attention_heads"),
            cfg(config, "intermediate_size"),
            norm="layernorm",
            norm_first=False,  # post-LN: eq. (10) and (13)
            activation=ACTIVATIONS[act],
            norm_eps=eps,
        )
        self.pooler: nn.Linear | None = None

    def forward(
        self,
        ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        head_mask: Tensor | Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        """Hidden states (B, N, d) of token ids (B, N).

        Args:
            ids: (B, N) token ids.
            attention_mask: (B, N) 1/True on real tokens, 0 on padding (padded keys are hidden).
            document_ids: (B, N) ids of the packed sequences in each row, contiguous runs (e.g.
                ``[0, 0, 0, 1, 1, -1]``): a token sees only its own document and positions restart
                at each. Give pad slots their own id.
            token_type_ids: (B, N) segment ids (default all 0).
            head_mask: (L, Hq) or (L, B, Hq) float gates on the attention heads, row i for layer i (1
                keeps a head, 0 prunes it; Michel et al., 2019), or a list of L per-layer masks.

        Raises:
            ValueError: ids that are not (B, N) integers, masks of another shape, a sequence longer
                than max_position_embeddings, and what the attention raises.
        """
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"ids must be an integer tensor (B, N), got {shape}; add a batch dim")
        B, N = ids.shape
        mask: Mask | None = None
        if document_ids is not None:
            _check_shape("document_ids", document_ids, B, N)
            positions = positions_in_documents(document_ids)  # (B, N)
            mask = document(document_ids)
        else:
            positions = torch.arange(N, device=ids.device)  # (N,)
        if attention_mask is not None:
            _check_shape("attention_mask", attention_mask, B, N)
            pad = key_padding(attention_mask.bool())
            mask = pad if mask is None else mask & pad
        if int(positions.max()) >= self.max_len:
            raise ValueError(
                f"a sequence of {int(positions.max()) + 1} tokens exceeds max_position_embeddings="
                f"{self.max_len}; truncate the input (the tokenizer's max_length)"
            )
        x = self.embeddings(ids, positions, token_type_ids)  # (B, N, d)
        return self.encoder(x, mask=mask, head_mask=head_mask)  # (B, N, d)

    def why_not_unpadded(self) -> str | None:
        """None when :meth:`forward_unpadded` computes what :meth:`forward` does, else the reason."""
        if self.training:
            return "the model is in training mode (dropout)"
        if not isinstance(self.encoder.final_norm, nn.Identity):
            return "the encoder ends with a final norm (pre-LN)"
        for i, layer in enumerate(self.encoder.layers):
            reason = why_not_unpadded(layer)
            if reason is not None:
                return f"layer {i}: {reason}"
        return None

    def forward_unpadded(
        self, ids: Tensor, lengths: Tensor, *, head_mask: Tensor | Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """Hidden states (T, d) of B sequences packed one after another, without padding.

        The same states :meth:`forward` gives the real tokens of the padded batch, with the token-wise
        work (projections, FFN, norms) done on the T real tokens only; see
        :mod:`multihead.nn.unpadded`. Inference only: call it under ``torch.inference_mode()``.

        Args:
            ids: (T,) token ids of all sequences, concatenated.
            lengths: (B,) tokens per sequence, summing to T.
            head_mask: (L, Hq) float gates on the attention heads, or a list of L per-layer (Hq_i,)
                gates, as :meth:`forward`.

        Raises:
            ValueError: ids not a 1-d integer tensor, lengths that do not sum to T or include an empty
                sequence, a sequence longer than max_position_embeddings, a model
                :meth:`why_not_unpadded` refuses.
        """
        reason = self.why_not_unpadded()
        if reason is not None:
            raise ValueError(f"forward_unpadded cannot run this model: {reason}; use forward()")
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point():
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"ids must be a 1-d integer tensor (T,) of concatenated sequences, got {shape}")
        varlen = Varlen.from_lengths(lengths)
        if int(lengths.sum()) != len(ids):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but ids has {len(ids)} tokens")
        if int(lengths.max()) > self.max_len:
            raise ValueError(
                f"a sequence of {int(lengths.max())} tokens exceeds max_position_embeddings="
                f"{self.max_len}; truncate the input (the tokenizer's max_length)"
            )
        x = self.embeddings(ids[None], varlen.position[None], None)[0]  # (T, d)
        masks = per_layer_head_masks(head_mask, len(self.encoder.layers))
        scratch: dict[int, Tensor] = {}  # the padded q, k, v layout, zeroed once for all layers
        for layer, layer_head_mask in zip(self.encoder.layers, masks):
            assert isinstance(layer, TransformerLayer)  # why_not_unpadded checked it
            x = unpadded_layer(layer, x, varlen, layer_head_mask, scratch=scratch)  # (T, d)
        return x

    def pool(self, hidden: Tensor) -> Tensor:
        """BERT's pooler: ``tanh(W h_[CLS] + b)``, (B, N, d) -> (B, d).

        Raises:
            ValueError: the checkpoint had no pooler.
        """
        if self.pooler is None:
            raise ValueError("this BERT was loaded without pooler weights; use the hidden states instead")
        return torch.tanh(self.pooler(hidden[:, 0]))  # (B, d)


def _check_shape(name: str, t: Any, B: int, N: int) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != (B, N):
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must have the shape of ids (B, N) = ({B}, {N}), got {shape}")


_L = r"encoder\.layer\.(\d+)\."
RULES: list[Rule] = [
    (r"(?:bert\.)?embeddings\.(position_ids|token_type_ids)", None, None),  # buffers, not weights
    (r"(?:bert\.)?embeddings\.word_embeddings\.(weight)", r"embeddings.word.\1", None),
    (r"(?:bert\.)?embeddings\.position_embeddings\.(weight)", r"embeddings.position.\1", None),
    (r"(?:bert\.)?embeddings\.token_type_embeddings\.(weight)", r"embeddings.token_type.\1", None),
    (r"(?:bert\.)?embeddings\.LayerNorm\.(weight|bias)", r"embeddings.norm.\1", None),
    (rf"(?:bert\.)?{_L}attention\.self\.query\.(\w+)", r"encoder.layers.\1.self_attn.q_proj.\2", None),
    (rf"(?:bert\.)?{_L}attention\.self\.key\.(\w+)", r"encoder.layers.\1.self_attn.k_proj.\2", None),
    (rf"(?:bert\.)?{_L}attention\.self\.value\.(\w+)", r"encoder.layers.\1.self_attn.v_proj.\2", None),
    (rf"(?:bert\.)?{_L}attention\.output\.dense\.(\w+)", r"encoder.layers.\1.self_attn.o_proj.\2", None),
    (rf"(?:bert\.)?{_L}attention\.output\.LayerNorm\.(\w+)", r"encoder.layers.\1.attn_norm.\2", None),
    (rf"(?:bert\.)?{_L}intermediate\.dense\.(\w+)", r"encoder.layers.\1.ffn.linear1.\2", None),
    (rf"(?:bert\.)?{_L}output\.dense\.(\w+)", r"encoder.layers.\1.ffn.linear2.\2", None),
    (rf"(?:bert\.)?{_L}output\.LayerNorm\.(\w+)", r"encoder.layers.\1.ffn_norm.\2", None),
    (r"(?:bert\.)?pooler\.dense\.(\w+)", r"pooler.\1", None),
]


def bert_from_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> Bert:
    """A :class:`Bert` with the weights of a Hugging Face ``BertModel`` state dict (keys with or without
    the ``bert.`` prefix), on the checkpoint's device and in its dtype.

    Raises:
        ValueError: unsupported config values, keys of a task head, a config that does not fit the weights.
    """
    sd = fuse_qkv(rename(state_dict, RULES, "BERT"))
    model = Bert(config)
    d = cfg(config, "hidden_size")
    if "pooler.weight" in sd:
        model.pooler = nn.Linear(d, d)
    align_biases(model, sd)
    load_converted(model, sd, "BERT", like="embeddings.word.weight")
    return model.eval()
