"""What the request handlers share: the engine, the served model's facts, metrics, helpers."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from dsv4.server.async_engine import AsyncEngine, EngineError, EngineStopped
from dsv4.server.metrics import ServerMetrics
from dsv4.server.protocol import ApiError, bad_request, param_of

log = logging.getLogger("dsv4.server")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))  # a `tokenizers.Tokenizer` returns an Encoding


def _engine_max_model_len(engine: Any) -> int | None:
    for owner in (engine, getattr(engine, "scheduler", None), getattr(engine, "engine_config", None),
                  getattr(engine, "options", None)):
        value = getattr(owner, "max_model_len", None) if owner is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


class ServerState:
    """The served model and everything the handlers need besides the request.

    Args:
        engine: the running ``AsyncEngine``.
        model_name: the name clients use in ``model`` (and ``/v1/models`` lists).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_model_len: prompt + output limit (default: the engine's).
        default_thinking: thinking mode when a chat request does not say.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, *, api_key: str | None = None,
                 max_model_len: int | None = None, default_thinking: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.default_thinking = default_thinking
        core = engine.engine
        self.variant: str = getattr(core.config, "variant", "v4")
        self.vocab_size: int | None = getattr(core.config, "vocab_size", None)
        self.max_model_len = max_model_len or _engine_max_model_len(core)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        # The server thread tokenizes with its own copy: the engine thread detokenizes at the
        # same time, and a fast tokenizer's state is not safe to share across threads.
        try:
            self._tokenizer = copy.deepcopy(core.tokenizer)
        except Exception:
            self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ model facts
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of a prompt, computed off the event loop (long prompts take a while)."""
        if self._tokenizer is not None:
            return await asyncio.to_thread(self._encode_locked, text)
        return await self.engine.call(lambda e: _encode(e.tokenizer, text))

    def _encode_locked(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return _encode(self._tokenizer, text)

    def token_text(self, token_id: int) -> str:
        """The text of one token (logprobs), memoized."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode([token_id])
            self._token_text[token_id] = text
        return text

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:  # no private copy: the engine's (its decode is read-only)
            return self.engine.engine.tokenizer.decode(ids, skip_special_tokens=False)
        with self._tokenizer_lock:
            return self._tokenizer.decode(ids, skip_special_tokens=False)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        for j, t in enumerate(ids):
            if self.vocab_size is not None and not 0 <= t < self.vocab_size:
                raise bad_request(f"{param}[{j}]: token id {t} is out of range "
                                  f"[0, {self.vocab_size})", param=param)

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        if num_prompt == 0:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        limit = self.max_model_len
        if limit is None:
            return
        if num_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{num_prompt} tokens (it must leave room for at least one generated token).",
                param=param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} "
                "to generate). Reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")

    def sampling_params(self, kwargs: dict[str, Any]) -> Any:
        from dsv4.engine.sampling_params import SamplingParams

        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise bad_request(str(e), param=param_of(str(e))) from None

    def tracker(self, num_prompt: int, arrival: float) -> "RequestTracker":
        return RequestTracker(self.metrics, num_prompt, arrival)


class RequestTracker:
    """Timings and token counts of one HTTP request (possibly several engine requests)."""

    def __init__(self, metrics: ServerMetrics, num_prompt: int, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        self.first: float | None = None
        self.last: float | None = None
        self.tokens: dict[tuple[str, int], int] = {}
        self.done = False
        metrics.add_tokens(prompt=num_prompt)

    @property
    def generated(self) -> int:
        return sum(self.tokens.values())

    def on_output(self, out: Any) -> None:
        now = time.monotonic()
        grew = False
        for o in out.outputs:
            key = (out.request_id, o.index)
            n = len(o.token_ids)
            if n > self.tokens.get(key, 0):
                self.tokens[key] = n
                grew = True
        if grew:
            if self.first is None:
                self.first = now
                self.metrics.observe_ttft(now - self.arrival)
            self.last = now

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.count_request(outcome)
        self.metrics.add_tokens(generated=self.generated)
        longest = max(self.tokens.values(), default=0)
        if outcome == "ok" and longest > 1 and self.first is not None and self.last is not None:
            self.metrics.observe_tpot((self.last - self.first) / (longest - 1))


def engine_failure(e: BaseException) -> ApiError:
    """The API error for an exception raised while a request ran in the engine."""
    if isinstance(e, ValueError):  # the engine refused the request (add_request)
        return bad_request(str(e), param=param_of(str(e)))
    if isinstance(e, EngineStopped):
        return ApiError(503, str(e), code="engine_stopped")
    if isinstance(e, EngineError):
        return ApiError(500, str(e), code="engine_error")
    return ApiError(500, f"{type(e).__name__}: {e}")


def outcome_of(err: ApiError) -> str:
    return "bad_request" if err.status == 400 else "error"


async def until_done_or_disconnected(request: Request, work: Awaitable[Any],
                                     poll_s: float = 0.25) -> Any:
    """Await ``work``; cancel it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def collect_or_abort(request: Request, tracker: RequestTracker,
                           work: Awaitable[Any]) -> JSONResponse | None:
    """Run a non-streamed request's ``work`` and record its outcome on ``tracker``.

    Returns the empty 499 answer if the client left, else None once ``work`` is done; an engine
    failure is raised as its (already counted) API error.
    """
    try:
        await until_done_or_disconnected(request, work)
    except ClientDisconnected:
        tracker.finish("aborted")
        return JSONResponse({}, status_code=499)
    except Exception as e:
        err = engine_failure(e)
        tracker.finish(outcome_of(err))
        err.counted = True
        raise err from None
    tracker.finish("ok")
    return None


def usage_of(num_prompt: int, num_completion: int) -> dict:
    """The OpenAI ``usage`` object."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators: yields (which, item); closing it closes them all."""
    if len(streams) == 1:  # the common case, without tasks
        it = streams[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((k, item))
            await queue.put((k, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((k, e))
            raise
        finally:
            await it.aclose()

    tasks = [asyncio.ensure_future(pump(k, it)) for k, it in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                 separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(err: ApiError) -> str:
    """The server-sent event that reports ``err`` inside a stream already under way."""
    return sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                          "code": err.code}})


async def sse_response(chunks: AsyncIterator[dict], tracker: "RequestTracker",
                       usage_chunk: Callable[[], dict | None]) -> AsyncIterator[str]:
    """The SSE body of a streamed response: every chunk of ``chunks``, then ``usage_chunk()``
    (when it returns one), then ``[DONE]``.  An engine failure mid-stream becomes an error event
    before ``[DONE]``; a client that leaves closes ``chunks`` (which aborts the engine request).
    ``tracker`` records the outcome either way."""
    outcome = "aborted"
    try:
        async with aclosing(chunks) as it:
            async for chunk in it:
                yield sse(chunk)
        last = usage_chunk()
        if last is not None:
            yield sse(last)
        outcome = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:
        err = engine_failure(e)
        outcome = outcome_of(err)
        yield sse_error(err)
    finally:
        tracker.finish(outcome)
    yield sse("[DONE]")
