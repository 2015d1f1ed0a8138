"""Block accounting of a paged KV cache: a free list and a reference count per block.

A block is ``block_size`` consecutive token slots of every layer's pool (:mod:`.paged_cache`); a sequence
holds an ordered list of block ids (its block table). Blocks are shared between sequences with the same
prefix by counting references (vLLM's ``BlockAllocator``): a block returns to the free list when its last
holder lets it go. Nothing here touches tensors.
"""

from __future__ import annotations

from ..core.checks import check_int

__all__ = ["BlockAllocator", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs (the scheduler preempts or waits).

    A RuntimeError, not a ValueError: the input was fine, the pool is full right now.
    """


class BlockAllocator:
    """Free list and reference counts of ``num_blocks`` blocks, ids 0 .. num_blocks - 1.

    Args:
        num_blocks: how many blocks the pool holds.

    Raises:
        ValueError: num_blocks not an int >= 1.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = check_int("num_blocks", num_blocks, 1, owner="BlockAllocator")
        # lowest ids first: a fresh pool hands out 0, 1, 2, ... (easy to read in tests and pictures)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        """How many block tables hold ``block``."""
        return self._refs[block]

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each).

        Raises:
            OutOfBlocks: fewer than n blocks are free (nothing is taken then).
        """
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks`` (a prefix shared with another sequence)."""
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free and cannot be shared"
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of ``blocks``; those left with none go back to the free list."""
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} released more often than held"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
