"""``EngineThread``: an :class:`~multihead.serve.Engine` stepped on a thread of its own, its outputs handed
to asyncio queues, so that an async server (or any asyncio code) awaits them without blocking its loop.

    runner = EngineThread(engine).start()
    queue = runner.submit(request)               # in a coroutine: an asyncio.Queue of RequestOutput
    while not (out := await queue.get()).finished:
        ...
    runner.stop()

The thread steps while any request is queued or running and sleeps on an event otherwise. A step that
raises ends every request in flight with that exception (each queue receives it), and the thread goes on
serving new ones. The thread is started and stopped by the caller: nothing runs at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from .engine import Engine
from .request import Request, RequestOutput

__all__ = ["EngineThread"]


class EngineThread:
    """Steps ``engine`` on a daemon thread; see the module docstring.

    Args:
        engine: the engine to run (only this thread calls its :meth:`~Engine.step`).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> EngineThread:
        """Start the thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="multihead-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to end after its current step and wait for it up to ``timeout`` seconds."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._queues)

    def submit(self, request: Request) -> asyncio.Queue[Any]:
        """Queue ``request`` from a coroutine; returns the asyncio queue its outputs arrive on (the last
        one has ``finished`` True; an exception instance arrives instead when a step failed).

        Raises:
            ValueError: what :meth:`Engine.add` raises (nothing is queued then).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self.engine.add(request)
            self._queues[request.id] = (loop, queue)
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """End a request (a client gone away): its blocks are freed, its queue gets nothing more."""
        with self._lock:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outs: list[RequestOutput] = self.engine.step()
            except Exception as e:  # every request in flight learns of it; the thread serves on
                self._fail(e)
                continue
            with self._lock:
                for o in outs:
                    target = self._queues.pop(o.id, None) if o.finished else self._queues.get(o.id)
                    if target is not None:
                        _hand(target, o)

    def _fail(self, error: Exception) -> None:
        with self._lock:
            for rid, (loop, queue) in list(self._queues.items()):
                self.engine.abort(rid)
                _hand((loop, queue), error)
            self._queues.clear()


def _hand(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]], item: Any) -> None:
    """Put ``item`` on a queue of another thread's loop; a loop already closed (its client gone) drops it."""
    with contextlib.suppress(RuntimeError):
        target[0].call_soon_threadsafe(target[1].put_nowait, item)
