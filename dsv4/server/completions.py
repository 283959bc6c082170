"""``POST /v1/completions``: raw prompts (text or token ids, one or several) in, text out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from dsv4.server.protocol import CompletionRequest, bad_request, completion_logprobs, sampling_kwargs
from dsv4.server.state import (
    RequestTracker,
    ServerState,
    collect_or_abort,
    merged,
    sse_response,
    usage_of,
)


@dataclass
class _Choice:
    echo: str = ""
    echoed: bool = False
    text: str = ""
    text_len: int = 0
    num_tokens: int = 0
    offset: int = 0
    logprobs: dict | None = None
    finish_reason: str | None = None


async def _prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt of the request."""
    if isinstance(prompt, str):
        return [(prompt, await state.tokenize(prompt))]
    if not prompt:
        raise bad_request("prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        state.check_token_ids(prompt, "prompt")
        return [(None, list(prompt))]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append((p, await state.tokenize(p)))
        else:
            state.check_token_ids(p, f"prompt[{i}]")
            out.append((None, list(p)))
    return out


class _CompletionRun:
    def __init__(self, state: ServerState, req: CompletionRequest, echoes: list[str],
                 num_prompt: int, tracker: RequestTracker) -> None:
        self.state = state
        self.req = req
        self.num_prompt = num_prompt
        self.tracker = tracker
        self.choices = [_Choice(echo=echoes[i // req.n]) for i in range(len(echoes) * req.n)]

    def advance(self, which: int, out: Any) -> list[tuple[int, str, dict | None, str | None]]:
        """(choice index, new text, logprobs, finish reason) of each choice that moved."""
        self.tracker.on_output(out)
        moved = []
        for o in out.outputs:
            index = which * self.req.n + o.index
            ch = self.choices[index]
            if ch.finish_reason is not None:
                continue
            text = o.text[ch.text_len:] if len(o.text) > ch.text_len else ""
            if not ch.echoed:
                text, ch.echoed = ch.echo + text, True
            ch.text_len = max(ch.text_len, len(o.text))
            ch.text += text
            logprobs = None
            k = self.req.logprobs
            if k is not None and len(o.token_ids) > ch.num_tokens and o.logprobs:
                logprobs = completion_logprobs(o.logprobs[ch.num_tokens:len(o.token_ids)],
                                               o.token_ids[ch.num_tokens:], k,
                                               self.state.token_text, ch.offset)
                ch.offset += sum(len(t) for t in logprobs["tokens"])
                if ch.logprobs is None:
                    ch.logprobs = logprobs
                else:
                    for key in ch.logprobs:
                        ch.logprobs[key] += logprobs[key]
            ch.num_tokens = len(o.token_ids)
            if o.finish_reason is not None:
                ch.finish_reason = "stop" if o.finish_reason == "abort" else o.finish_reason
            if text or logprobs or ch.finish_reason:
                moved.append((index, text, logprobs, ch.finish_reason))
        return moved

    def usage(self) -> dict:
        return usage_of(self.num_prompt, sum(ch.num_tokens for ch in self.choices))


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Any:
    """Validate, run every prompt, and answer (JSON or SSE)."""
    arrival = time.monotonic()
    state.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix: not supported by this model", param="suffix")
    prompts = await _prompts(state, req.prompt)
    for i, (_, ids) in enumerate(prompts):
        state.check_length(len(ids), req.max_tokens, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    params = state.sampling_params(sampling_kwargs(
        req, max_tokens=req.max_tokens, logprobs=req.logprobs,
        skip_special_tokens=req.skip_special_tokens))
    rid = f"cmpl-{uuid.uuid4().hex}"
    echoes = [(text if text is not None else state.decode(ids)) if req.echo else ""
              for text, ids in prompts]
    num_prompt = sum(len(ids) for _, ids in prompts)
    tracker = state.tracker(num_prompt, arrival)
    run = _CompletionRun(state, req, echoes, num_prompt, tracker)
    streams = [state.engine.generate(ids, params, f"{rid}-{i}") for i, (_, ids) in enumerate(prompts)]
    if req.stream:
        return StreamingResponse(_stream(state, req, run, rid, streams),
                                 media_type="text/event-stream")

    async def collect() -> None:
        async with aclosing(merged(streams)) as it:
            async for which, out in it:
                run.advance(which, out)

    aborted = await collect_or_abort(request, tracker, collect())
    if aborted is not None:
        return aborted
    choices = [{"index": i, "text": ch.text, "logprobs": ch.logprobs,
                "finish_reason": ch.finish_reason} for i, ch in enumerate(run.choices)]
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                         "model": state.model_name, "choices": choices, "usage": run.usage()})


async def _stream(state: ServerState, req: CompletionRequest, run: _CompletionRun, rid: str,
                  streams: list[AsyncIterator[Any]]) -> AsyncIterator[str]:
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    usage_null = {"usage": None} if req.include_usage else {}

    async def chunks() -> AsyncIterator[dict]:
        async with aclosing(merged(streams)) as it:
            async for which, out in it:
                for index, text, logprobs, finish in run.advance(which, out):
                    yield {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish}], **usage_null}

    def usage_chunk() -> dict | None:
        return {**head, "choices": [], "usage": run.usage()} if req.include_usage else None

    async for line in sse_response(chunks(), run.tracker, usage_chunk):
        yield line
