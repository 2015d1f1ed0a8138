"""``Engine``: many requests decoded together over one paged KV cache (continuous batching).

    engine = mh.serve.Engine(model)
    engine.add(mh.serve.Request(prompt_ids, mh.serve.SamplingParams(max_tokens=64, temperature=0.7, seed=1)))
    while engine.has_unfinished():
        for out in engine.step():        # the news of every request this step touched
            print(out.id, out.new_text, out.finished)

Each :meth:`Engine.step` schedules (:mod:`.scheduler`), runs one batched decode forward for every
running sequence and one packed forward for the prompts being prefilled (:mod:`.runner`), picks each
request's next token with its own sampler (:mod:`.sampling`), and frees the blocks of the requests that
finished. Sequences join and leave the batch at every step. The engine owns the cache pool; the model
is only read: the engine runs a copy of its modules in eval mode on the same weight tensors, its plain
linears replaced by native-GEMV ones for the few-row products of a decode step
(:func:`.runner.runtime_copy`; a parameter replaced on the model after the engine was built is not
seen). Greedy outputs equal ``model.generate`` of each prompt alone (within the float rounding of a
batched matmul against a one-row one, which decides a token only on a near tie).

The engine is not thread-safe by itself: :meth:`add`, :meth:`abort` and :meth:`step` take a lock, so a
server may call them from different threads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import Any

import torch

from .. import threads
from ..models.generation import stop_ids
from .paged_cache import PagedKVCache
from .request import FinishReason, Request, RequestOutput, Sequence
from .runner import cache_shape, forward_decode, forward_packed, runtime_copy, why_not_model
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = ["Engine"]

#: the KV memory an engine takes by default when ``num_blocks`` is not given
DEFAULT_KV_BYTES = 256 * 2**20


class Engine:
    """Continuous batching of requests over a :class:`PagedKVCache` built for ``model``.

    Args:
        model: a :class:`~multihead.TransformerLM` (multi-head / grouped-query attention layers, or
            latent attention (MLA) layers, whose pages hold one latent key per token).
        num_blocks: blocks of the pool; default: as many as :data:`DEFAULT_KV_BYTES` (256 MiB) hold, or
            fewer when ``max_seqs`` sequences of the model's whole context fit in less.
        block_size: tokens per block.
        max_seqs: the most sequences decoded in one step.
        max_prefill_tokens: the most prompt tokens fed in one step (longer prompts go in chunks).
        kv: ``"dense"`` (the model's dtype) or ``"int8"`` pages.
        tokenizer: decodes the text of the outputs and finds stop strings (default ``model.tokenizer``).

    Raises:
        ValueError: a model the engine cannot run (says why), or sizes out of range.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_seqs: int = 16,
        max_prefill_tokens: int = 512,
        kv: str = "dense",
        tokenizer: Any = None,
    ):
        why = why_not_model(model)
        if why is not None:
            raise ValueError(f"Engine cannot serve this model: {why}")
        heads, width, latent = cache_shape(model)
        p = _float_weight(model)  # the activations' dtype and device (an int8 model's embedding is int8)
        for name, val in (("max_seqs", max_seqs), ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"Engine {name} must be an int >= 1, got {val!r}")
        make = lambda n: PagedKVCache(  # noqa: E731
            len(model.layers),
            heads,
            width,
            n,
            block_size=block_size,
            kind=kv,
            dtype=p.dtype,
            device=p.device,
            latent_values=latent,
        )
        if num_blocks is None:  # 256 MiB, or less when max_seqs sequences of the whole context fit in less
            whole = max_seqs * -(-model.max_len // block_size)
            num_blocks = max(1, min(DEFAULT_KV_BYTES // make(1).block_bytes, whole))
        self.model, self.cache = model, make(num_blocks)
        self.runtime = runtime_copy(model)  # the model's weights, native GEMV for a few rows, eval mode
        self.tokenizer = getattr(model, "tokenizer", None) if tokenizer is None else tokenizer
        self.scheduler = Scheduler(self.cache, max_seqs, max_prefill_tokens)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        tensors = [*model.parameters(), *model.buffers()]
        self._params = sum(t.numel() for t in tensors)
        self._bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.tokens_generated = 0

    # -- requests -----------------------------------------------------------------------------------------
    def add(self, request: Request) -> str:
        """Queue ``request``; returns its id. It joins the batch at a later :meth:`step`.

        Raises:
            ValueError: an id already queued or running, an empty prompt or ids outside the vocabulary,
                a prompt plus max_tokens past the model's context, or one that could not fit in the whole
                pool even alone.
        """
        prompt = list(request.prompt)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"request {request.id!r} prompt must be a non-empty list of token ids (ints)")
        vocab = self.model.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(
                f"request {request.id!r} prompt ids must lie in [0, vocab_size={vocab}), got min "
                f"{min(prompt)} and max {max(prompt)}"
            )
        total = len(prompt) + request.params.max_tokens
        if total > self.model.max_len:
            raise ValueError(
                f"request {request.id!r}: {len(prompt)} prompt tokens + max_tokens="
                f"{request.params.max_tokens} = {total} exceed the model's context of {self.model.max_len}; "
                f"ask for at most {max(self.model.max_len - len(prompt), 0)} tokens or shorten the prompt"
            )
        if self.cache.blocks_for(total) > self.cache.num_blocks:
            raise ValueError(
                f"request {request.id!r} needs {self.cache.blocks_for(total)} blocks of "
                f"{self.cache.block_size} tokens for {total} tokens, the pool has {self.cache.num_blocks}; "
                "build the engine with more num_blocks or lower max_tokens"
            )
        with self._lock:
            if request.id in self._seqs:
                raise ValueError(
                    f"a request with id {request.id!r} is already queued or running; pick another"
                )
            stops = stop_ids(self.model, request.params.stop_token_ids)
            seq = Sequence(request, stops, self.tokenizer, next(self._arrivals))
            self._seqs[request.id] = seq
            self.scheduler.waiting.append(seq)
        return request.id

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; returns its last output (finish_reason "abort"), or
        None for an id that is not queued or running (already finished, or never added)."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                return None
            self.scheduler.finish(seq)
            seq.finish_reason = FinishReason.ABORT
            return seq.report()

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._seqs)

    # -- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once for the decode rows and once for the prefill rows, sample, and
        report every request that got a token or finished (in the order they were added)."""
        with self._lock:
            plan = self.scheduler.schedule()
            touched: list[Sequence] = []
            tokens = len(plan.decode) + sum(n for _, n in plan.prefill)
            with threads.limited(threads.threads_for(2.0 * self._params * tokens, self._bytes)):
                self._run(plan, touched)
            out = []
            for seq in sorted(touched, key=lambda s: s.arrival):
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                    self._seqs.pop(seq.id, None)
                out.append(seq.report())
            return out

    def _run(self, plan: Any, touched: list[Sequence]) -> None:
        if plan.decode:
            ids = [s.tokens[-1] for s in plan.decode]
            logits = forward_decode(self.runtime, self.cache, [s.id for s in plan.decode], ids)  # (B, V)
            for s, row in zip(plan.decode, logits):
                s.cached += 1
                self._sample(s, row, touched)
        if plan.prefill:
            chunks = [s.tokens[s.cached : s.cached + n] for s, n in plan.prefill]
            logits = forward_packed(
                self.runtime, self.cache, [s.id for s, _ in plan.prefill], chunks
            )  # (n, V)
            for (s, n), row in zip(plan.prefill, logits):
                s.cached += n
                if s.pending == 0:  # the whole sequence is in the cache: its next token
                    self._sample(s, row, touched)

    def _sample(self, s: Sequence, logits: torch.Tensor, touched: list[Sequence]) -> None:
        s.append(s.sampler.pick(logits))
        self.tokens_generated += 1
        touched.append(s)

    # -- conveniences -------------------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` to the end together; their final outputs, in the order given."""
        ids = [self.add(Request(list(p), params or SamplingParams())) for p in prompts]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.id] = o
        return [final[i] for i in ids]

    def stats(self) -> dict[str, int]:
        """Counts for a metrics endpoint: requests running and waiting, blocks free and used, preemptions,
        tokens generated."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": self.cache.num_blocks,
            "blocks_free": self.cache.num_free_blocks,
            "blocks_used": self.cache.num_blocks - self.cache.num_free_blocks,
            "preemptions": self.scheduler.preemptions,
            "tokens_generated": self.tokens_generated,
        }


def _float_weight(model: Any) -> torch.Tensor:
    """A floating-point weight of ``model`` (the final norm's first): the dtype and device the engine's
    pages take.

    Raises:
        ValueError: a model with no floating-point parameter or buffer.
    """
    norm = getattr(getattr(model, "final_norm", None), "weight", None)
    if isinstance(norm, torch.Tensor) and norm.is_floating_point():
        return norm
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t
    raise ValueError(f"Engine needs a model with floating-point weights, {type(model).__name__} has none")
