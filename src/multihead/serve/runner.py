"""The model's forward over a paged KV cache: a batch of sequences at different lengths in one call.

The runtime, not the model, decides how a step is laid out; the model's layers stay as they are and
receive, as their ``cache``, a :class:`PagedLayer` whose ``update`` writes the new keys and values into
the pages and returns the keys and values each query may read. Two layouts:

- **decode** (one new token per sequence): ids (B, 1), rotary positions (B, 1) = each sequence's length,
  keys gathered into (B, Hkv, Lmax, D) and masked by ``mh.padding(lengths)`` - one batched forward for
  every running sequence, whatever their lengths;
- **packed** (prefills and prefill chunks, any mix of lengths and cached prefixes): all new tokens
  packed into one row (1, T) with no padding, each token's keys being its own sequence's cached and
  new ones - the varlen layout (:func:`multihead.varlen_attention`) carried through the model as a bool
  (1, 1, T, K) mask that is block-diagonal and causal per sequence.

Shape legend: B decode rows, T packed new tokens, K packed keys, L a sequence's length, d model width,
V vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.masks import Mask, causal, document, padding
from ..models.gemv_linear import GemvLinear
from ..nn.attention import MultiHeadAttention
from ..variants.latent import LatentAttention
from ..variants.latent_cache import LatentCache
from .paged_attention import paged_slots
from .paged_cache import PagedKVCache

__all__ = [
    "PagedLatentLayer",
    "PagedLayer",
    "cache_shape",
    "forward_decode",
    "forward_packed",
    "runtime_copy",
    "why_not_model",
]


class PagedLayer:
    """One layer's view of the paged cache for one forward: the ``cache`` its attention calls.

    ``update(k_new (b, Hkv, n, D), v_new)`` writes the b*n new tokens at ``write_slots`` (b*n,) and
    returns the keys and values at ``read_slots`` (b, L): (b, Hkv, L, D) and (b, Hkv, L, Dv).
    """

    position = 0  # rotary positions are always passed explicitly

    def __init__(self, cache: PagedKVCache, layer: int, write_slots: Tensor, read_slots: Tensor):
        self.cache, self.layer = cache, layer
        self.write_slots, self.read_slots = write_slots, read_slots

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        H = self.cache.n_kv_heads
        k = k_new.transpose(1, 2).reshape(-1, H, k_new.shape[-1])  # (b*n, Hkv, D) in token order
        v = v_new.transpose(1, 2).reshape(-1, H, v_new.shape[-1])  # (b*n, Hkv, Dv)
        self.cache.write(self.layer, self.write_slots, k, v)
        k_all, v_all = self.cache.read(self.layer, self.read_slots)  # (b, L, Hkv, D), (b, L, Hkv, Dv)
        return k_all.transpose(1, 2), v_all.transpose(1, 2)  # (b, Hkv, L, D), (b, Hkv, L, Dv)


class PagedLatentLayer(LatentCache):
    """:class:`PagedLayer` for a :class:`~multihead.variants.LatentAttention` layer, which takes only a
    :class:`~multihead.variants.latent_cache.LatentCache` of its sizes: one holding no storage of its own
    (the pages hold the latent keys ``[c_kv | k_R]``), whose ``update`` is the paged one."""

    def __init__(self, paged: PagedLayer, kv_rank: int, rope_dims: int):
        nn.Module.__init__(self)  # not LatentCache.__init__: nothing to allocate
        self.kv_rank, self.rope_dims, self._seen = kv_rank, rope_dims, 0
        self.paged = paged

    def update(self, k_new: Tensor, v_new: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write the latent keys (b, 1, n, r + R); return (b, 1, L, r + R) and c_kv (b, 1, L, r)."""
        return self.paged.update(k_new, k_new[..., : self.kv_rank] if v_new is None else v_new)


def cache_shape(model: Any) -> tuple[int, int, int | None]:
    """(kv heads, key width, latent values or None) of the pages ``model`` needs (checked by
    :func:`why_not_model`): a latent layer stores one latent key of width r + G R, its values the first r."""
    attn = model.layers[0].self_attn
    if isinstance(attn, LatentAttention):
        return 1, attn.kv_rank + attn.rope_heads * attn.rope_dims, attn.kv_rank
    return attn.n_kv_heads, attn.head_dim, None


def why_not_model(model: Any) -> str | None:
    """None when the engine can run ``model`` over pages, else why not."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "embed") or not hasattr(model, "lm_head"):
        return f"a {type(model).__name__} is not a TransformerLM (embed, layers, final_norm, lm_head)"
    if getattr(model, "sliding_window", None) is not None:
        return "sliding-window models are not served over pages yet (their mask is per row)"
    heads: set[tuple[int, int, int | None]] = set()
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, MultiHeadAttention):
            return f"layer {i}'s self-attention is not a MultiHeadAttention"
        if isinstance(attn, LatentAttention):
            heads.add((1, attn.kv_rank + attn.rope_heads * attn.rope_dims, attn.kv_rank))
            continue
        if type(attn).update_cache is not MultiHeadAttention.update_cache:
            return f"layer {i}'s {type(attn).__name__} keeps a cache of its own kind"
        heads.add((attn.n_kv_heads, attn.head_dim, None))
    if len(heads) != 1:
        shapes = sorted(heads, key=str)
        return f"the layers have different kv heads or head dims {shapes}; one pool shape serves all"
    return None


def runtime_copy(model: Any) -> Any:
    """What the engine runs: a copy of ``model``'s modules in eval mode that shares every weight tensor
    (no copy of the weights; in-place changes to them are seen), each plain ``nn.Linear`` replaced by a
    :class:`~multihead.models.gemv_linear.GemvLinear` on the same weight, whose calls of 1-4 rows (a
    decode step of a few sequences) run the native GEMV. ``model`` itself is left as it is."""
    keep: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        keep[id(tokenizer)] = tokenizer
    out = copy.deepcopy(model, keep)
    for module in list(out.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, GemvLinear.from_linear(child))
    return out.train(False)


def _embed(model: Any, ids: Tensor, positions: Tensor) -> Tensor:
    """Token (and learned / sinusoidal position) embeddings (b, n, d) of ids (b, n)."""
    x = model.embed(ids)  # (b, n, d)
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions)  # (b, n, d)
    return x


def _layers(model: Any, cache: PagedKVCache, x: Tensor, mask, positions, slots) -> Tensor:
    """Every layer on x (b, n, d) with its :class:`PagedLayer`; returns the final-normed (b, n, d)."""
    rope = positions if model.positions == "rotary" else None
    write, read = slots
    for i, layer in enumerate(model.layers):
        view: Any = PagedLayer(cache, i, write, read)
        attn = layer.self_attn
        if isinstance(attn, LatentAttention):
            view = PagedLatentLayer(view, attn.kv_rank, attn.rope_heads * attn.rope_dims)
        x = layer(x, mask=mask, cache=view, positions=rope)  # (b, n, d)
    return model.final_norm(x)  # (b, n, d)


@torch.no_grad()
def forward_decode(model: Any, cache: PagedKVCache, seqs: Sequence[Hashable], ids: Sequence[int]) -> Tensor:
    """One decode step of B sequences: token ``ids[b]`` appended to sequence ``seqs[b]``; returns the
    logits (B, V) of the next token of each. Room for the tokens must be free (see
    :meth:`PagedKVCache.blocks_needed`).

    Raises:
        OutOfBlocks: the pool ran out (the caller checks first).
    """
    dev = cache.device
    lengths = [cache.length(s) for s in seqs]  # positions of the new tokens
    write = torch.cat([cache.append_slots(s, 1) for s in seqs])  # (B,)
    lens = torch.tensor(lengths, device=dev) + 1  # (B,) after the append
    tables = [cache.block_table(s) for s in seqs]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev)  # (B, nb)
    read = paged_slots(bt, lens, cache.block_size)  # (B, Lmax)
    tok = torch.tensor(ids, device=dev)[:, None]  # (B, 1)
    pos = torch.tensor(lengths, device=dev)[:, None]  # (B, 1)
    mask: Mask = padding(lens)
    h = _layers(model, cache, _embed(model, tok, pos), mask, pos, (write, read))  # (B, 1, d)
    return model.lm_head(h[:, 0])  # (B, V)


@torch.no_grad()
def forward_packed(
    model: Any, cache: PagedKVCache, seqs: Sequence[Hashable], chunks: Sequence[Sequence[int]]
) -> Tensor:
    """One packed forward of new token chunks: ``chunks[i]`` (at least one token) appended to sequence
    ``seqs[i]`` after what it holds; returns the logits (n, V) after each chunk's last token.

    Raises:
        OutOfBlocks: the pool ran out (the caller checks first).
    """
    dev = cache.device
    starts = [cache.length(s) for s in seqs]
    write = torch.cat([cache.append_slots(s, len(c)) for s, c in zip(seqs, chunks)])  # (T,)
    read = torch.cat([cache.slots(s) for s in seqs])  # (K,) each sequence's keys, in order
    ns = torch.tensor([len(c) for c in chunks], device=dev)  # (n,)
    ls = torch.tensor([a + len(c) for a, c in zip(starts, chunks)], device=dev)  # (n,) keys per sequence
    which = torch.arange(len(seqs), device=dev)
    q_seq, k_seq = which.repeat_interleave(ns), which.repeat_interleave(ls)  # (T,), (K,)
    q_pos = torch.cat([torch.arange(a, a + len(c), device=dev) for a, c in zip(starts, chunks)])  # (T,)
    k_pos = torch.cat([torch.arange(int(n), device=dev) for n in ls])  # (K,)
    mask: Mask | Tensor
    if all(a == 0 for a in starts):  # fresh prompts: keys in the queries' order, a block-sparse mask
        mask = document(q_seq) & causal()  # the kernels skip the tiles between sequences
    else:  # cached prefixes: each token's keys are its own sequence's, cached ones first
        mask = ((q_seq[:, None] == k_seq[None]) & (k_pos[None] <= q_pos[:, None]))[None, None]  # (1, 1, T, K)
    tok = torch.tensor([t for c in chunks for t in c], device=dev)[None]  # (1, T)
    pos = q_pos[None]  # (1, T)
    h = _layers(model, cache, _embed(model, tok, pos), mask, pos, (write, read[None]))
    last = ns.cumsum(0) - 1  # (n,) the last token of each chunk
    return model.lm_head(h[0, last])  # (n, V)
