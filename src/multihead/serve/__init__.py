"""Serving many sequences at once: a paged KV cache, attention over its pages, and (``Engine``) a runtime
that batches every running sequence's decode step into one forward (continuous batching).

The library part only: the HTTP server is the ``multihead serve`` command (``multihead.cli.serve``).
"""

from .blocks import BlockAllocator, OutOfBlocks
from .engine import Engine
from .paged_attention import paged_attention, paged_attention_batched, paged_slots
from .paged_cache import PAGED_KINDS, PagedKVCache
from .request import FinishReason, Request, RequestOutput
from .sampling import SamplingParams

__all__ = [
    "PAGED_KINDS",
    "BlockAllocator",
    "Engine",
    "FinishReason",
    "OutOfBlocks",
    "PagedKVCache",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "paged_attention",
    "paged_attention_batched",
    "paged_slots",
]
