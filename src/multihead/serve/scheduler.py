"""Which sequences run in the next step: continuous batching with admission by free blocks and
preemption by recompute (Yu et al. 2022, "Orca"; Kwon et al. 2023, vLLM's scheduler).

Every step:

1. every running sequence with one token to feed is a **decode** row; if the pool lacks the blocks
   those rows need, the newest running sequence is **preempted**: its blocks are freed and it waits at
   the head of the queue to feed all its tokens again (recompute), until the rest fit;
2. sequences still prefilling continue with their next chunk, then waiting ones are **admitted** in
   arrival order while fewer than ``max_seqs`` run, the pool can hold the whole of what they have to
   feed plus their first generated token, and the step's prefill budget of ``max_prefill_tokens`` is not
   spent (a longer prompt is fed in chunks over several steps);
3. a new sequence first takes, without copying, the full blocks of the longest prefix it shares with
   a running sequence (a shared system prompt is stored once).

A waiting request that does not fit waits: nothing behind it jumps the queue (no starvation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .paged_cache import PagedKVCache
from .request import Sequence

__all__ = ["Plan", "Scheduler"]


@dataclass
class Plan:
    """One step: decode rows, prefill rows (sequence, tokens to feed) and the sequences preempted."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """The waiting queue and the running set over one :class:`PagedKVCache`.

    Args:
        cache: the pool the sequences live in.
        max_seqs: the most sequences running at once.
        max_prefill_tokens: the most prompt tokens fed in one step.
    """

    def __init__(self, cache: PagedKVCache, max_seqs: int, max_prefill_tokens: int):
        self.cache, self.max_seqs, self.max_prefill_tokens = cache, max_seqs, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def schedule(self) -> Plan:
        """The next step's :class:`Plan` (the cache is changed only by preemptions and prefix sharing)."""
        plan = Plan()
        plan.decode = [s for s in self.running if s.pending == 1 and s.cached > 0]
        while sum(self.cache.blocks_needed(s.id, 1) for s in plan.decode) > self.cache.num_free_blocks:
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            plan.preempted.append(victim)
            plan.decode = [s for s in plan.decode if s is not victim]
        free = self.cache.num_free_blocks - sum(self.cache.blocks_needed(s.id, 1) for s in plan.decode)
        budget = self.max_prefill_tokens
        for s in self.running:  # chunked prefills under way
            if s not in plan.decode and s.pending > 0 and budget > 0:
                n = min(s.pending, budget)
                need = self.cache.blocks_needed(s.id, n)
                if need > free:
                    break
                plan.prefill.append((s, n))
                budget, free = budget - n, free - need
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            s = self.waiting[0]
            self._share_prefix(s)
            whole = self.cache.blocks_needed(s.id, s.pending + 1)
            if whole > free:
                self.cache.free(s.id)  # keep nothing while waiting
                s.cached = 0
                break
            self.waiting.popleft()
            self.running.append(s)
            n = min(s.pending, budget)
            plan.prefill.append((s, n))
            budget, free = budget - n, free - self.cache.blocks_needed(s.id, n)
        return plan

    def _share_prefix(self, s: Sequence) -> None:
        """Add ``s`` to the cache, holding the full blocks of its longest prefix shared with a running
        sequence (at most all its tokens but the last, which must be fed to get logits)."""
        bs, best, source = self.cache.block_size, 0, None
        for r in self.running:
            n = 0
            limit = min(r.cached, len(s.tokens) - 1)
            while n < limit and r.tokens[n] == s.tokens[n]:
                n += 1
            n -= n % bs
            if n > best:
                best, source = n, r
        if source is None:
            self.cache.add_sequence(s.id)
        else:
            self.cache.share_prefix(source.id, s.id, best)
        s.cached = best

    def _preempt(self, s: Sequence) -> None:
        """Free ``s``'s blocks and put it first in the queue to recompute all its tokens."""
        self.running.remove(s)
        self.cache.free(s.id)
        s.cached = 0
        self.waiting.appendleft(s)
        self.preemptions += 1

    def finish(self, s: Sequence) -> None:
        """Drop a finished or aborted sequence from wherever it is, and free its blocks."""
        if s in self.running:
            self.running.remove(s)
            self.cache.free(s.id)
        elif s in self.waiting:
            self.waiting.remove(s)
