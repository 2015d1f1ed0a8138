"""``PagedKVCache``: the keys and values of many sequences in fixed-size blocks of one pool per layer.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(vLLM). Each layer's pool is ``(num_blocks, block_size, Hkv, D)`` (the paged layout of FlashAttention's
``flash_attn_with_kvcache``); a sequence owns a block table (block ids, in position order) and a length.
Position p of a sequence lies in block ``table[p // block_size]`` at offset ``p % block_size``, i.e. in
the flat slot ``table[p // block_size] * block_size + p % block_size`` of the pool seen as
``(num_blocks * block_size, Hkv, D)``. Every layer uses the same table: one allocation serves all.

Memory is the sum of the sequences' lengths rounded up to a block, not batch x longest. Sequences share
blocks (:meth:`PagedKVCache.fork`, :meth:`PagedKVCache.share_prefix`) with reference counts; a write into
a shared block that is not full first copies it (copy-on-write), so no holder ever sees another's tokens.

Kinds: ``"dense"`` stores keys and values in ``dtype``; ``"int8"`` stores per-token symmetric int8 with a
float32 (float64) scale per (token, head), exactly the rounding of ``mh.KVCache(kind="int8")``, and
dequantises on read.

Shape legend: Hkv kv heads, D key head dim, Dv value head dim, n tokens written or read, L a sequence's
length, bs block size, S = num_blocks * bs slots.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from ..core.checks import check_int
from ..core.limits import check_fits
from ..nn.kv_cache import dequantize_int8, quantize_int8
from .blocks import BlockAllocator, OutOfBlocks

__all__ = ["PAGED_KINDS", "PagedKVCache"]

#: the storage kinds of a paged cache
PAGED_KINDS = ("dense", "int8")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PagedKVCache:
    """Block pools of ``n_layers`` attention layers and the block tables of the sequences in them.

    Args:
        n_layers: layers, one pool each.
        n_kv_heads: Hkv of every layer.
        head_dim: D of the keys.
        num_blocks: blocks in each pool.
        block_size: token slots per block (16 by default, as vLLM).
        kind: ``"dense"`` or ``"int8"``.
        dtype: dtype of the keys and values written and read (default ``torch.get_default_dtype()``).
        device: where the pools live.
        v_head_dim: Dv of the values, default ``head_dim``.
        latent_values: for multi-head latent attention (MLA): the values are the first
            ``latent_values`` features of the keys (the latent c_kv of ``[c_kv | k_R]``), so no value
            pools are kept and :meth:`read` returns a view of the keys (``"dense"`` only).

    Raises:
        ValueError: sizes that are not ints >= 1, an unknown kind, a non-float dtype, or pools larger than
            the free memory.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        *,
        block_size: int = 16,
        kind: str = "dense",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        v_head_dim: int | None = None,
        latent_values: int | None = None,
    ):
        own = "PagedKVCache"
        for name, val in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_int(name, val, 1, owner=own)
        check_int("block_size", block_size, 1, owner=own)
        self.allocator = BlockAllocator(num_blocks)
        if kind not in PAGED_KINDS:
            raise ValueError(f"{own} kind must be one of {list(PAGED_KINDS)}, got {kind!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _FLOATS:
            raise ValueError(f"{own} dtype must be float16, bfloat16, float32 or float64, got {dtype}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.v_head_dim = (
            head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1, owner=own)
        )
        self.block_size, self.kind, self.dtype = block_size, kind, dtype
        self.latent_values = latent_values
        if latent_values is not None:
            check_int("latent_values", latent_values, 1, head_dim, owner=own)
            if kind != "dense":
                raise ValueError(f"{own} latent pages are kind='dense' only (the latent is the compression)")
            self.v_head_dim = latent_values
        self.scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        check_fits(
            self.block_bytes * num_blocks,
            f"a {kind} PagedKVCache of {n_layers} layers x {num_blocks} blocks of {block_size} tokens",
            "use fewer blocks, kind='int8', or a smaller block_size",
            device,
        )
        store = torch.int8 if kind == "int8" else dtype
        shape = (num_blocks, block_size, n_kv_heads)  # (num_blocks, bs, Hkv)
        self.k = [torch.zeros(*shape, head_dim, dtype=store, device=device) for _ in range(n_layers)]
        values = 0 if latent_values is not None else n_layers  # latent pages: the values are in the keys
        self.v = [torch.zeros(*shape, self.v_head_dim, dtype=store, device=device) for _ in range(values)]
        scales = kind == "int8"
        self.k_scale = (
            [torch.zeros(*shape, 1, dtype=self.scale_dtype, device=device) for _ in self.k] if scales else []
        )
        self.v_scale = (
            [torch.zeros(*shape, 1, dtype=self.scale_dtype, device=device) for _ in self.k] if scales else []
        )
        self.device = self.k[0].device
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    # -- sizes --------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks in each layer's pool."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return self.allocator.num_free

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers: keys, values and (int8) their scales."""
        elt = 1 if self.kind == "int8" else torch.empty(0, dtype=self.dtype).element_size()
        per_token = (self.head_dim + (0 if self.latent_values else self.v_head_dim)) * elt
        if self.kind == "int8":
            per_token += 2 * torch.empty(0, dtype=self.scale_dtype).element_size()
        return self.n_layers * self.block_size * self.n_kv_heads * per_token

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks held by sequences (each shared block counted once)."""
        return self.allocator.num_used * self.block_bytes

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that ``n_tokens`` tokens of one sequence fill: ceil(n / block_size)."""
        return -(-n_tokens // self.block_size)

    # -- sequences ----------------------------------------------------------------------------------------
    @property
    def sequences(self) -> list[Hashable]:
        """Ids of the sequences held, in the order they were added."""
        return list(self._tables)

    def _known(self, seq: Hashable, name: str = "seq") -> None:
        if seq not in self._tables:
            raise ValueError(
                f"PagedKVCache has no sequence {name}={seq!r}; add it with add_sequence first "
                f"(held: {len(self._tables)} sequences)"
            )

    def add_sequence(self, seq: Hashable) -> None:
        """Start an empty sequence ``seq`` (no blocks until tokens are appended).

        Raises:
            ValueError: a sequence with that id is already held.
        """
        if seq in self._tables:
            raise ValueError(f"PagedKVCache already holds a sequence {seq!r}; free it first or pick a new id")
        self._tables[seq], self._lengths[seq] = [], 0

    def length(self, seq: Hashable) -> int:
        """Tokens held for ``seq``.

        Raises:
            ValueError: an unknown sequence.
        """
        self._known(seq)
        return self._lengths[seq]

    def block_table(self, seq: Hashable) -> list[int]:
        """A copy of ``seq``'s block ids, in position order.

        Raises:
            ValueError: an unknown sequence.
        """
        self._known(seq)
        return list(self._tables[seq])

    def free(self, seq: Hashable) -> None:
        """Drop ``seq``: its blocks lose a holder (those it held alone become free).

        Raises:
            ValueError: an unknown sequence.
        """
        self._known(seq)
        self.allocator.release(self._tables.pop(seq))
        del self._lengths[seq]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """A new sequence ``child`` holding all of ``parent``'s tokens, sharing every block (no copy).

        Raises:
            ValueError: an unknown parent or a child id already held.
        """
        self.share_prefix(parent, child, self.length(parent))

    def share_prefix(self, source: Hashable, seq: Hashable, n_tokens: int) -> None:
        """A new sequence ``seq`` holding the first ``n_tokens`` tokens of ``source``, sharing the blocks
        that hold them. A last block only partly covered is shared too and copied on the first write.

        Raises:
            ValueError: an unknown source, a ``seq`` already held, or n_tokens not in [0, length(source)].
        """
        check_int("n_tokens", n_tokens, 0, self.length(source), owner="PagedKVCache.share_prefix")
        self.add_sequence(seq)
        blocks = self._tables[source][: self.blocks_for(n_tokens)]
        self.allocator.share(blocks)
        self._tables[seq], self._lengths[seq] = list(blocks), n_tokens

    def blocks_needed(self, seq: Hashable, n: int) -> int:
        """Free blocks that appending n tokens to ``seq`` takes: new blocks, plus one when its last block
        is shared and not full (copied before the write).

        Raises:
            ValueError: an unknown sequence.
        """
        length, table = self.length(seq), self._tables[seq]
        new = self.blocks_for(length + n) - len(table)
        cow = length % self.block_size != 0 and self.allocator.refcount(table[-1]) > 1
        return new + int(cow and n > 0)

    def append_slots(self, seq: Hashable, n: int) -> Tensor:
        """Room for n more tokens of ``seq``: allocates blocks (copying a shared, partly filled last block
        first), advances its length by n, and returns the n flat slots (n,) int64 to :meth:`write` the
        tokens' keys and values to in every layer.

        Raises:
            ValueError: an unknown sequence or n not an int >= 0.
            OutOfBlocks: fewer free blocks than :meth:`blocks_needed` (nothing changes then).
        """
        check_int("n", n, 0, owner="PagedKVCache.append_slots")
        need = self.blocks_needed(seq, n)
        if need > self.allocator.num_free:
            raise OutOfBlocks(
                f"sequence {seq!r} needs {need} blocks for {n} tokens, {self.allocator.num_free} are free"
            )
        table, start = self._tables[seq], self._lengths[seq]
        if start % self.block_size != 0 and n > 0 and self.allocator.refcount(table[-1]) > 1:
            table[-1] = self._copy_block(table[-1])
        table += self.allocator.allocate(self.blocks_for(start + n) - len(table))
        self._lengths[seq] = start + n
        return self._slots(table, start, start + n)

    def _copy_block(self, block: int) -> int:
        """Copy-on-write: a fresh block with ``block``'s contents in every layer; ``block`` loses a holder."""
        (new,) = self.allocator.allocate(1)
        for pools in (self.k, self.v, self.k_scale, self.v_scale):
            for pool in pools:
                pool[new] = pool[block]  # (bs, Hkv, D) or (bs, Hkv, 1)
        self.allocator.release([block])
        return new

    def _slots(self, table: list[int], start: int, end: int) -> Tensor:
        """Flat slots (end - start,) of positions start .. end - 1 of a sequence with ``table``."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        blocks = torch.tensor(table[first:last], dtype=torch.long, device=self.device)  # (nb,)
        slots = (blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)  # (nb * bs,)
        return slots[start - first * bs : end - first * bs]  # (end - start,)

    def slots(self, seq: Hashable, start: int = 0, end: int | None = None) -> Tensor:
        """Flat slots (end - start,) int64 of ``seq``'s positions start .. end - 1 (default: all of them).

        Raises:
            ValueError: an unknown sequence, or 0 <= start <= end <= length(seq) violated.
        """
        length = self.length(seq)
        end = length if end is None else check_int("end", end, 0, length, owner="PagedKVCache.slots")
        check_int("start", start, 0, end, owner="PagedKVCache.slots")
        return self._slots(self._tables[seq], start, end)

    # -- data ---------------------------------------------------------------------------------------------
    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store n tokens' keys k (n, Hkv, D) and values v (n, Hkv, Dv) of ``layer`` at ``slots`` (n,)
        (from :meth:`append_slots`); int8 pools store them rounded, with their scales; latent pages
        store only k (v, the keys' first features, is checked and not stored again).

        Raises:
            ValueError: k or v of another shape or dtype than the pools take.
        """
        n = slots.shape[0]
        want = ((n, self.n_kv_heads, self.head_dim), (n, self.n_kv_heads, self.v_head_dim))
        if (tuple(k.shape), tuple(v.shape)) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"PagedKVCache.write takes k {want[0]} and v {want[1]} in {self.dtype} for {n} slots, got "
                f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype}"
            )
        flat = self._flat(layer)
        if self.latent_values is not None:  # the values are the keys' first features: not stored again
            flat[0][0].index_copy_(0, slots, k.detach())  # (S, 1, r + R)
            return
        if self.kind == "int8":
            for (pool, scale), x in zip(flat, (k, v)):
                assert scale is not None
                q, s = quantize_int8(x, self.scale_dtype)  # (n, Hkv, D) int8, (n, Hkv, 1)
                pool.index_copy_(0, slots, q)
                scale.index_copy_(0, slots, s)
            return
        flat[0][0].index_copy_(0, slots, k.detach())  # (S, Hkv, D) written by index
        flat[1][0].index_copy_(0, slots, v.detach())  # (S, Hkv, Dv)

    def read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (..., Hkv, D) and values (..., Hkv, Dv) of ``layer`` at ``slots`` of any shape (...),
        in ``dtype`` (int8 pools dequantised)."""
        flat = self._flat(layer)
        if self.latent_values is not None:
            k = flat[0][0][slots]  # (..., 1, r + R)
            return k, k[..., : self.latent_values]  # the values: a view of the keys
        if self.kind == "int8":
            (kq, ks), (vq, vs) = flat[0], flat[1]
            assert ks is not None and vs is not None
            k = dequantize_int8(kq[slots], ks[slots], self.dtype)  # (..., Hkv, D)
            v = dequantize_int8(vq[slots], vs[slots], self.dtype)  # (..., Hkv, Dv)
            return k, v
        return flat[0][0][slots], flat[1][0][slots]  # (..., Hkv, D), (..., Hkv, Dv)

    def gather(self, layer: int, seq: Hashable) -> tuple[Tensor, Tensor]:
        """All of ``seq``'s keys (Hkv, L, D) and values (Hkv, L, Dv) of ``layer``, in position order:
        what a dense ``KVCache`` of this one sequence holds.

        Raises:
            ValueError: an unknown sequence.
        """
        k, v = self.read(layer, self.slots(seq))  # (L, Hkv, D), (L, Hkv, Dv)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # (Hkv, L, D), (Hkv, L, Dv)

    def _flat(self, layer: int) -> list[tuple[Tensor, Tensor | None]]:
        """(pool, scale or None) of keys then values of ``layer``, seen as (S, Hkv, D) slots."""
        S, H = self.num_blocks * self.block_size, self.n_kv_heads
        out: list[tuple[Tensor, Tensor | None]] = []
        for i, pools in enumerate((self.k, self.v)):
            if not pools:  # latent pages keep no values
                continue
            pool = pools[layer].view(S, H, -1)  # (S, Hkv, D or Dv)
            scales = (self.k_scale, self.v_scale)[i]
            out.append((pool, scales[layer].view(S, H, 1) if scales else None))  # (S, Hkv, 1)
        return out

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(kind={self.kind!r}, n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, blocks={self.num_blocks} x {self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self._tables)}, dtype={self.dtype})"
        )
