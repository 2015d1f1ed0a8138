"""How a sequence of N positions is split over W ranks for ring attention, and helpers to (un)shard.

Two layouts (rank r of W, positions as half-open ranges):

    contiguous   rank r holds one block; when W does not divide N the first N % W ranks hold one more
                 position (torch.tensor_split's rule). Under a causal mask rank W-1 does W times the work
                 of rank 0.
    zigzag       the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r, one from
                 each end, so every rank does the same causal work (Brandon et al. 2023, "striped" /
                 zigzag ring attention). N must be a multiple of 2W.

    N = 8, W = 2      contiguous:  r0 = [0 1 2 3]   r1 = [4 5 6 7]
                      zigzag:      r0 = [0 1 6 7]   r1 = [2 3 4 5]

A rank's shard is its ranges concatenated in order along the sequence dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import DEFAULT_TIMEOUT, all_gather_ints, resolve_group, wait

__all__ = ["LAYOUTS", "shard", "shard_ranges", "unshard"]

LAYOUTS = ("contiguous", "zigzag")

Ranges = list[tuple[int, int]]


def check_layout(layout: str) -> str:
    """Raise ValueError unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def shard_ranges(n: int, world_size: int, layout: str = "contiguous") -> list[Ranges]:
    """The global position ranges each rank holds: ``[rank][segment] = (start, stop)``.

    Raises:
        ValueError: an unknown layout, ``n < world_size``, or a zigzag ``n`` not divisible by 2W.
    """
    check_layout(layout)
    if n < world_size:
        raise ValueError(f"the sequence has {n} positions, fewer than the world size {world_size}")
    if layout == "zigzag":
        if n % (2 * world_size) != 0:
            up = -(-n // (2 * world_size)) * 2 * world_size
            raise ValueError(
                f"layout='zigzag' needs the sequence length ({n}) to be a multiple of 2 * world_size "
                f"({2 * world_size}); pad it to {up} (and mask the padding) or use layout='contiguous'"
            )
        c = n // (2 * world_size)
        return [
            [(r * c, (r + 1) * c), ((2 * world_size - 1 - r) * c, (2 * world_size - r) * c)]
            for r in range(world_size)
        ]
    base, extra = divmod(n, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append([(start, start + size)])
        start += size
    return out


def ranges_from_lengths(lengths: list[int], layout: str) -> list[Ranges]:
    """Each rank's ranges given every rank's local length (what ring attention gathers).

    Raises:
        ValueError: a rank with no positions; for zigzag, local lengths that are unequal or odd.
    """
    world = len(lengths)
    if min(lengths) < 1:
        raise ValueError(f"every rank needs at least one position, got local lengths {lengths}")
    if layout == "zigzag":
        if len(set(lengths)) != 1 or lengths[0] % 2 != 0:
            raise ValueError(
                f"layout='zigzag' needs every rank to hold the same even number of positions, got local "
                f"lengths {lengths}; pad the sequence to a multiple of 2 * world_size ({2 * world}) "
                "and split it with mh.parallel.shard(x, layout='zigzag'), or use layout='contiguous'"
            )
        return shard_ranges(lengths[0] * world, world, "zigzag")
    out, start = [], 0
    for n in lengths:
        out.append([(start, start + n)])
        start += n
    return out


def positions(ranges: Ranges, device: torch.device | None = None) -> Tensor:
    """The global positions of a shard, in local order: (n_local,) int64."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])  # (n_local,)


def shard(
    x: Tensor, *, dim: int = 2, layout: str = "contiguous", group: dist.ProcessGroup | None = None
) -> Tensor:
    """This rank's shard of a global tensor along ``dim`` (default 2: the N of (B, H, N, D)).

    Raises:
        ValueError: an unknown layout or a length the layout cannot split (see :func:`shard_ranges`).
        RuntimeError: torch.distributed is not initialised.
    """
    _, rank, world = resolve_group(group)
    ranges = shard_ranges(x.shape[dim], world, layout)[rank]
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def unshard(
    x: Tensor,
    *,
    dim: int = 2,
    layout: str = "contiguous",
    group: dist.ProcessGroup | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Tensor:
    """Gather every rank's shard and put the positions back in global order (inverse of :func:`shard`).

    Collective: every rank must call it. Shards may differ in length for the contiguous layout.

    Raises:
        ValueError: shards the layout cannot have produced.
        CommError: a peer rank did not take part within ``timeout`` seconds.
    """
    check_layout(layout)
    pg, rank, world = resolve_group(group)
    lengths = [row[0] for row in all_gather_ints([x.shape[dim]], pg, timeout=timeout, what="unshard lengths")]
    ranges = ranges_from_lengths(lengths, layout)
    longest = max(lengths)
    pad_shape = list(x.shape)
    pad_shape[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).contiguous()  # (.., longest, ..)
    parts = [torch.empty_like(padded) for _ in range(world)]
    work = dist.all_gather(parts, padded, group=pg, async_op=True)
    assert work is not None
    wait(work, timeout=timeout, what=f"unshard (rank {rank} of {world})")
    pieces: list[tuple[int, Tensor]] = []
    for r in range(world):
        offset = 0
        for a, b in ranges[r]:
            pieces.append((a, parts[r].narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda s: s[0])], dim=dim)
