"""Attention beyond one process, on torch.distributed (gloo on CPU, NCCL on GPU).

- :func:`tensor_parallel`: split a model's heads (and FFN width) across the ranks of a group.
- :func:`ring_attention`: exact attention over a sequence split across ranks (context parallelism),
  K/V shards travelling around a ring; :func:`shard` / :func:`unshard` split and rebuild sequences.
- :func:`launch`: start N local gloo processes and run a function on each (tests, benchmarks).

Failures of a peer surface as :class:`CommError` (on the surviving ranks) or :class:`LaunchError` (from
:func:`launch`) within a timeout, never as a hang or a partial result. Per-rank memory, time and traffic
of ring attention as N grows: ``python -m multihead.parallel bench`` (:mod:`multihead.bench.distributed`).
"""

from .comm import CommError, Traffic, traffic
from .launch import LaunchError, launch
from .layout import LAYOUTS, shard, shard_ranges, unshard
from .ring import ring_attention
from .tensor_parallel import tensor_parallel

__all__ = [
    "LAYOUTS",
    "CommError",
    "LaunchError",
    "Traffic",
    "launch",
    "ring_attention",
    "shard",
    "shard_ranges",
    "tensor_parallel",
    "traffic",
    "unshard",
]
