"""An asyncio front for the synchronous ``LLMEngine``: one background thread runs the steps.

Every call into the engine (add, abort, step, stats, idle check) happens on that one thread,
in the order the commands arrived, so the engine itself needs no locking.  Each request has an
``asyncio.Queue`` that the thread fills (through ``call_soon_threadsafe``) with its cumulative
``RequestOutput`` of each step (the engine builds fresh output objects every step, so the
consumer may read them while later steps run); ``generate`` yields them.  A consumer that stops early (client
disconnect, cancellation, an exception) aborts its request, which frees its cache pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dsv4.server")


class EngineError(RuntimeError):
    """The engine failed while running a step (the request cannot finish)."""


class EngineStopped(RuntimeError):
    """The engine thread is not running (not started yet, or shut down)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    """Runs ``engine.step()`` in one background thread and streams outputs to coroutines.

    Args:
        engine: an ``LLMEngine`` (or anything with its API: ``add_request``, ``abort_request``,
            ``step``, ``has_unfinished_requests``, ``get_stats``, ``check_idle``, ``tokenizer``,
            ``config``).
        idle_poll_s: how long the idle thread sleeps between checks for stop (it wakes at once
            on a new command).
    """

    def __init__(self, engine: Any, *, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self._idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats: dict[str, Any] = {}
        self.num_step_errors = 0
        self.last_error: str | None = None
        self.steps = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self.running:
            return
        self._stopping = False
        self._refresh_stats()
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, end the thread and wait for it."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1f s", timeout)
        else:
            log.info("engine thread stopped")
        self._thread = None

    # ------------------------------------------------------------------ coroutine API
    async def generate(self, prompt: str | list[int], params: Any,
                       request_id: str) -> AsyncIterator[Any]:
        """Add a request and yield its cumulative outputs until it finishes.

        Raises whatever ``add_request`` raised (e.g. ValueError for a bad prompt), EngineError
        when a step failed, EngineStopped on shutdown.  Leaving early aborts the request.
        """
        if not self.running or self._stopping:
            raise EngineStopped("the engine is not running")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._submit(("add", request_id, prompt, params, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._submit(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    async def check_idle(self) -> None:
        """The engine's own invariant check (all pages and slots free), on its thread."""
        await self.call(lambda e: e.check_idle())

    # ------------------------------------------------------------------ engine thread
    def _submit(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _deliver(self, stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.get_stats())
        except Exception:  # stats are best effort; never take the loop down for them
            log.exception("get_stats failed")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, stream = cmd
                if rid in self._streams:
                    self._deliver(stream, ValueError(f"request id {rid!r} is already in use"))
                    continue
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # bad request: report it to its caller only
                    self._deliver(stream, e)
                    continue
                self._streams[rid] = stream
            elif kind == "abort":
                if self._streams.pop(cmd[1], None) is not None:
                    try:
                        self.engine.abort_request(cmd[1])
                    except Exception:
                        log.exception("abort_request(%r) failed", cmd[1])
            elif kind == "call":
                _, fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:
                        fut.set_exception(e)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            self._deliver(stream, exc)
        self._streams.clear()

    def _loop(self) -> None:
        try:
            self._run_steps()
        except BaseException as e:  # a bug here must fail the waiting requests, not hang them
            log.exception("engine thread crashed")
            self.last_error = f"{type(e).__name__}: {e}"
            self._fail_all(EngineError(f"engine thread crashed: {self.last_error}"))
            raise
        # shutting down: abort everything still running, tell its consumers
        self._drain()
        self._fail_all(EngineStopped("the server is shutting down"))
        self._refresh_stats()

    def _run_steps(self) -> None:
        while True:
            self._drain()
            if self._stopping:
                return
            if not self.engine.has_unfinished_requests():
                self._refresh_stats()
                self._wake.wait(self._idle_poll_s)
                self._wake.clear()
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:
                # Fail the requests in flight, keep serving: one bad step must not take the
                # server down.
                log.exception("engine step failed")
                self.num_step_errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._fail_all(EngineError(f"engine step failed: {self.last_error}"))
                continue
            self.steps += 1
            if not outputs and time.perf_counter() - started < 1e-3:
                # an empty step (nothing could be scheduled): do not spin on it
                self._wake.wait(0.002)
                self._wake.clear()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if out.finished:
                    del self._streams[out.request_id]
                self._deliver(stream, out)
            self._refresh_stats()
